"""--no-dist-env: a script that turns distributed when RANK is set (nanoGPT-style: NCCL, a GPU)
runs under ckptrun as under plain python, on the CPU: it sees the same environment, checkpoints,
restores bit-exact, and resumes exactly after a kill; without the flag it asks for NCCL."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import (
    SCRIPTS,
    STEPS,
    assert_training_state,
    ckptrun,
    error_line,
    load,
    restore,
    resumed_beside_plain,
)

SCRIPT = SCRIPTS / "nanogpt_style.py"


def _own_env(path) -> dict[str, str]:
    """The environment a script saw, but ckptrun's own variables (its config, the resume step)."""
    return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("CKPTRUN_")}


def test_nanogpt_style_script_runs_resumes_and_restores_exactly(tmp_path):
    args = ["--steps", STEPS, "--save-at", STEPS, "--env-out", "env.json", "--save-path"]
    plain, managed = resumed_beside_plain(tmp_path, SCRIPT, args, ["--no-dist-env", "--dir", "ckpts", "--keep", "0"],
                                          "kill:step=7")
    assert _own_env(managed / "env.json") == _own_env(plain / "env.json")
    truth = load(plain / "truth.pt")
    assert_training_state(load(managed / "resumed.pt"), truth)
    assert_training_state(restore(managed, managed / "ckpts", STEPS)[0], truth)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the script's NCCL/GPU path works on a GPU machine")
def test_without_the_flag_the_script_asks_for_nccl(tmp_path):
    proc = ckptrun(tmp_path, "--dir", "ckpts", SCRIPT, "--steps", "2")
    assert proc.returncode != 0
    assert "NCCL" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("flag", ["--nproc-per-node", "--nnodes"])
def test_refused_with_more_than_one_process(flag, tmp_path):
    proc = ckptrun(tmp_path, "--no-dist-env", flag, "2", "--dir", "ckpts", SCRIPT)
    line = error_line(proc)
    assert proc.returncode == 2 and f"{flag} 2" in line and "--no-dist-env" in line, line
    assert not (tmp_path / "ckpts").exists()
