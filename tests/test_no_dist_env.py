"""--no-dist-env: a script that turns distributed when RANK is set (nanoGPT-style: NCCL, a GPU)
runs under ckptrun as under plain python, on the CPU: it sees the same environment, checkpoints,
restores bit-exact, and resumes exactly after a kill; without the flag it asks for NCCL."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import (
    SCRIPTS,
    STEPS,
    TIMEOUT_S,
    assert_training_state,
    ckptrun,
    clean_env,
    error_line,
    load,
    ok,
    restore,
    run_events,
)

SCRIPT = SCRIPTS / "nanogpt_style.py"


def _own_env(path) -> dict[str, str]:
    """The environment a script saw, but ckptrun's own variables (its config, the resume step)."""
    return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("CKPTRUN_")}


def test_nanogpt_style_script_runs_resumes_and_restores_exactly(tmp_path):
    args = ["--steps", STEPS, "--save-at", STEPS, "--env-out", "env.json", "--save-path"]
    plain, managed = tmp_path / "plain", tmp_path / "ckptrun"
    plain.mkdir()
    managed.mkdir()
    # The uninterrupted plain-python run goes alongside the ckptrun run (2 cores).
    truth_run = subprocess.Popen([sys.executable, str(SCRIPT), *map(str, args), "truth.pt"], cwd=plain,
                                 env=clean_env(None), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    proc = ckptrun(managed, "--no-dist-env", "--dir", "ckpts", "--keep", "0", "--max-restarts", "1",
                   "--metrics-dir", "metrics", SCRIPT, *args, "resumed.pt", fault="kill:step=7")
    _, truth_err = truth_run.communicate(timeout=TIMEOUT_S)
    assert truth_run.returncode == 0, truth_err
    ok(proc)
    assert [e["restart_count"] for e in run_events(managed / "metrics")] == [0, 1], "the fault did not fire"
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
