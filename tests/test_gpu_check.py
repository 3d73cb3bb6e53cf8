"""scripts/gpu-check (issue 29): the device check's plan, what it reads back from its parts'
logs, and its errors. `--dry-run` runs nothing, so this stays fast; `--cpu` runs the parts
themselves (by hand: minutes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO

from ckptrun.strategies import REGISTRY

sys.path.insert(0, str(REPO / "scripts"))
from gpucheck import execute, plan  # noqa: E402

ORDER = ["device", "install", "cuda-timed", "cuda-tests", "crash-matrix", "bench-every-10", "bench-every-1"]
METHODS = ",".join(["none", "torch.save", "dcp-thread", "dcp-process", *REGISTRY])  # references first


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / "scripts" / "gpu-check"), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHON": sys.executable})


def dry_run(*args: str) -> tuple[list[tuple[str, int]], str]:
    """The parts with their budgets, and the plan's text without whitespace (commands wrap)."""
    proc = gpu_check("--dry-run", *args)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    parts = [(m.group(1), int(m.group(2))) for m in (re.match(r"\d+\. (\S+), (\d+) s:", line) for line in lines) if m]
    return parts, re.sub(r"\s+", "", proc.stdout)


def test_dry_run_lists_every_part_in_order_within_seven_minutes():
    parts, flat = dry_run()
    assert [name for name, _ in parts] == ORDER
    assert sum(budget for _, budget in parts) <= 7 * 60
    assert "CKPTRUN_TEST_DEVICE=cuda" in flat
    assert "-m'cudaandtimed'tests/test_cuda.py" in flat and "-m'cudaandnottimed'tests/test_cuda.py" in flat
    for every in (10, 1):
        assert f"bench--devicecuda--modellarge--strategies{METHODS}--every{every}--steps" in flat
    assert "-mgpucheck.install" in flat and "gpucheck.install--cpu" not in flat


def test_cpu_dry_run_runs_the_same_parts_with_tiny_sizes():
    parts, flat = dry_run("--cpu", "--parts", "crash-matrix,bench-every-1", "--budget", "bench-every-1=33")
    assert [name for name, _ in parts] == ["device", "install", "crash-matrix", "bench-every-1"]
    assert parts[3] == ("bench-every-1", 33)
    assert "CKPTRUN_TEST_DEVICE=cpu" in flat and f"--devicecpu--modeltiny--strategies{METHODS}--every1" in flat


def test_bad_input_is_one_line_and_exit_2():
    for args in (["--parts", "nope"], ["--parts", ""], ["--no-such-flag"], ["--budget", "install=0"],
                 ["--budget", "nope=3"], ["--budget", "install"]):
        proc = gpu_check("--dry-run", *args)
        assert proc.returncode == 2, proc
        assert proc.stderr.strip().splitlines()[-1].startswith("scripts/gpu-check: error: "), proc.stderr


def test_what_a_part_reached_is_read_from_its_log():
    tests = plan.Part("t", "", 1, ("true",), tests=("tests/x.py",))
    log = ("tests/x.py::test_a PASSED [ 50%]\n"
           "[gw1] [ 75%] FAILED tests/x.py::test_b[cuda]\n"
           "tests/x.py::test_c SKIPPED (no CUDA device here) [100%]\n")
    assert execute.reached(tests, log) == ({"tests/x.py::test_a", "tests/x.py::test_b[cuda]", "tests/x.py::test_c"},
                                           ["tests/x.py::test_b[cuda]"])
    bench = plan.Part("b", "", 1, ("true",), configs=("none", "sync", "lowdiff+"))
    log = ("[1/3] none (repetition 1): 110.0 ms/step, stall 0.0 ms/step [9 s]\n"
           "[2/3] sync (repetition 1): FAILED: exited with code 1 [20 s]\n")
    assert execute.reached(bench, log) == ({"none", "sync"}, ["sync"])
