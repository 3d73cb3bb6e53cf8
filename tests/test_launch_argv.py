"""What the launcher hands torchrun parses under this torch, and asks for the same behaviour
from torch 2.11's torchrun (the GPU image's) as from 2.13's: both found on an H200."""

import argparse

import pytest
from conftest import EXAMPLE, TINY, ckptrun, ok
from torch.distributed import run as torchrun

from ckptrun.launcher.run import LaunchOptions, shutdown_timeout_flag, torchrun_namespace

# A script's own words that torchrun's parser took for its flags (an abbreviation, an exact flag,
# its -m) or that look like ckptrun's.
SCRIPT_WORDS = ["--log", "out.txt", "--n", "3", "-m", "x", "--nproc", "2", "--nnodes", "2", "--every", "5",
                "--dir", "d", "--help", "--", "-h"]


def argv(opts: LaunchOptions) -> list[str]:
    return [*opts.torchrun_argv(), *shutdown_timeout_flag(7), "--log-dir", "logs", "train.py", "--lr", "1"]


@pytest.mark.parametrize("opts", [LaunchOptions(), LaunchOptions(nproc_per_node="2", max_restarts=3),
                                  LaunchOptions(nnodes="2", node_rank=1, rdzv_backend="c10d",
                                                rdzv_endpoint="10.0.0.1:29400", rdzv_id="job"),
                                  LaunchOptions(master_addr="127.0.0.1", master_port=29511)])
def test_torchrun_takes_the_launchers_argv(opts):
    args = torchrun.get_args_parser().parse_args(argv(opts))
    assert args.training_script == "train.py" and args.training_script_args == ["--lr", "1"]
    assert args.shutdown_timeout == 7


def test_one_node_without_an_address_takes_a_free_port():
    """torch 2.11's torchrun binds 29500 for one node unless told otherwise, so a second job on
    the machine failed; a port or rendezvous the user names is kept."""
    assert "--standalone" in LaunchOptions().torchrun_argv()
    assert "--standalone" in LaunchOptions(nnodes="1:1").torchrun_argv()
    for named in (LaunchOptions(master_port=29511), LaunchOptions(rdzv_endpoint="h:1", rdzv_backend="c10d"),
                  LaunchOptions(nnodes="2")):
        assert "--standalone" not in named.torchrun_argv()


def test_a_torchrun_without_shutdown_timeout_is_not_given_one(monkeypatch):
    """torch 2.11's torchrun has no --shutdown-timeout: passing it made every run exit 2."""
    def older() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser()
        parser.add_argument("--nproc-per-node")
        return parser

    monkeypatch.setattr(torchrun, "get_args_parser", older)
    assert shutdown_timeout_flag(7) == []


def test_the_scripts_arguments_reach_the_worker_unparsed():
    """Whatever follows SCRIPT is handed to the worker as it was given: torchrun's parser saw
    it and stopped the run at `--log` (ambiguous: --log-dir, --logs-specs, ...)."""
    args = torchrun_namespace([*LaunchOptions().torchrun_argv(), "--log-dir", "logs"], "train.py", SCRIPT_WORDS)
    assert (args.module, args.training_script) == (True, "ckptrun.worker.bootstrap")
    assert args.training_script_args == ["train.py", *SCRIPT_WORDS]
    assert args.log_dir == "logs" and args.nnodes == "1"


def test_a_script_flag_that_abbreviates_torchruns_runs(tmp_path):
    """End to end: the example's `--log 1` (its own --log-every, abbreviated) reaches it."""
    proc = ok(ckptrun(tmp_path, "--dir", "ckpts", "--no-dashboard", EXAMPLE, *TINY, "--steps", "2", "--log", "1"))
    assert "step 2 loss" in proc.stdout, proc.stdout
