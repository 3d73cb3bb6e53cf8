"""scripts/gpu-check (issue 29): the device check's plan, what it reads back from its parts'
logs, and its errors. `--dry-run` runs nothing, so this stays fast; `--cpu` runs the parts
themselves (by hand: minutes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from conftest import REPO

from ckptrun.bench.plan import REFERENCES
from ckptrun.strategies import REGISTRY

sys.path.insert(0, str(REPO / "scripts"))
from gpucheck import execute, lastrun, plan, report  # noqa: E402

EVERY = (10, 1)


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / "scripts" / "gpu-check"), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHON": sys.executable})


def dry_run(*args: str) -> tuple[list[list[tuple[str, int]]], str, str]:
    """Each call's parts with their budgets, the plan's text without whitespace (commands wrap),
    and what neither call reaches."""
    proc = gpu_check("--dry-run", *args)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    calls: list[list[tuple[str, int]]] = []
    for line in lines:
        if re.match(r"call \d", line):
            calls.append([])
        elif m := re.match(r"\d+\. (\S+), (\d+) s:", line):
            calls[-1].append((m.group(1), int(m.group(2))))
    flat = re.sub(r"\s+", "", proc.stdout)
    return calls, flat, flat.partition("reachedbyneithercall(alatersession):")[2]


def bench_rows(flat: str) -> list[tuple[int, list[str]]]:
    """Each bench invocation of the plan, in order: its --every and its configurations."""
    return [(int(m.group(2)), m.group(1).split(",")) for m in re.finditer(r"--strategies(\S+?)--every(\d+)", flat)]


def test_two_calls_fit_one_session_the_owed_tests_first_then_rows_not_measured_before():
    calls, flat, left = dry_run()
    assert len(calls) == 2 and [n for n, _ in calls[0][:4]] == ["device", "install", "owed-cuda", "owed-crash"]
    assert all([n for n, _ in call[:2]] == ["device", "install"] for call in calls)  # (each call: a fresh machine)
    assert [sum(b for _, b in call) for call in calls] <= list(plan.CALL_S) and sum(plan.CALL_S) <= 13 * 60
    assert "GPUCHECK_KEEP=owed" in flat and "CKPTRUN_TEST_DEVICE=cuda" in flat and "-pgpucheck.lastrun" in flat
    assert "-m'cudaandnottimed'tests/test_cuda.py" in flat and "-mgpucheck.install" in flat
    # Every row of the matrix is in one call or named as left: every registered strategy and the
    # references at --every 10 and 1, each invocation with its own `none`, at steady state.
    benches = bench_rows(flat)
    assert all(configs[0] == "none" for _, configs in benches)
    for every in EVERY:
        planned = [c for e, configs in benches if e == every for c in configs[1:]]
        named = re.findall(rf"bench-every-{every}(?!\d)([^,]+)", left)
        assert sorted(planned + named) == sorted([*REFERENCES, *REGISTRY]), (every, planned, named)
        steps, warmup = plan.STEADY[every]
        assert warmup > every and (steps - warmup) % every == 0  # the first checkpoint untimed; whole intervals
    measured = plan.last_run(plan.LAST_RUN)["bench"][10]
    first = benches[0][1][1:]
    assert benches[0][0] == 10 and first and not set(first) & set(measured), first
    assert plan.REFERENCES == tuple(REFERENCES)  # (bench's names; the check imports no ckptrun before its install)


def test_with_every_row_measured_before_the_rows_come_in_the_registrys_order(tmp_path):
    """A `--last` record (a check's own reached.json) in which every row at --every 10 was
    measured: the rows come references first, then in the registry's order; the tests read it."""
    last = tmp_path / "reached.json"
    last.write_text(json.dumps({"passed": [], "bench": {"10": ["none", *REFERENCES, *REGISTRY]}}))
    _, flat, _ = dry_run("--last", str(last))
    assert bench_rows(flat)[0][1] == ["none", *[*REFERENCES, *REGISTRY][: len(bench_rows(flat)[0][1]) - 1]]
    assert f"GPUCHECK_LAST={last}".replace(" ", "") in flat


def test_cpu_dry_run_runs_the_same_plan_with_tiny_sizes():
    calls, flat, _ = dry_run("--cpu", "--parts", "owed-crash,bench-every-10", "--budget", "owed-crash=33")
    assert [n for n, _ in calls[0]] == ["device", "install", "owed-crash", "bench-every-10"]
    assert calls[0][2] == ("owed-crash", 33)
    assert "CKPTRUN_TEST_DEVICE=cpu" in flat and "--devicecpu--modeltiny--strategiesnone," in flat


def test_bad_input_is_one_line_and_exit_2():
    for args in (["--parts", "nope"], ["--parts", ""], ["--no-such-flag"], ["--budget", "install=0"],
                 ["--budget", "nope=3"], ["--budget", "install"], ["--call", "3"], ["--last", "/nonexistent"]):
        proc = gpu_check("--dry-run", *args)
        assert proc.returncode == 2, proc
        assert proc.stderr.strip().splitlines()[-1].startswith("scripts/gpu-check: error: "), proc.stderr


def test_what_a_part_reached_is_read_from_its_log():
    tests = plan.Part("t", "", 1, ("true",), tests=("tests/x.py",))
    log = ("tests/x.py::test_a PASSED [ 50%]\n"
           "[gw1] [ 75%] FAILED tests/x.py::test_b[cuda]\n"
           "tests/x.py::test_c SKIPPED (no CUDA device here) [100%]\n")
    assert execute.reached(tests, log) == ({"tests/x.py::test_a", "tests/x.py::test_b[cuda]", "tests/x.py::test_c"},
                                           ["tests/x.py::test_b[cuda]"], ["tests/x.py::test_c"])
    bench = plan.Part("b", "", 1, ("true",), configs=("none", "sync", "lowdiff+"))
    log = ("[1/3] none (repetition 1): 110.0 ms/step, stall 0.0 ms/step [9 s]\n"
           "[2/3] sync (repetition 1): FAILED: exited with code 1 [20 s]\n")
    assert execute.reached(bench, log) == ({"none", "sync"}, ["sync"], [])


def test_the_owed_and_the_passed_tests_are_told_apart_by_the_last_record(tmp_path, monkeypatch):
    last = tmp_path / "last.json"
    last.write_text(json.dumps({"passed": ["t.py::a", "t.py::c[x]"], "bench": {}}))
    monkeypatch.setenv(lastrun.LAST, str(last))

    class Item:
        def __init__(self, nodeid: str) -> None:
            self.nodeid = nodeid

    class Config:
        class hook:  # noqa: N801 - pytest's hook relay, as the plugin calls it
            @staticmethod
            def pytest_deselected(items):
                dropped.extend(i.nodeid for i in items)

    for keep, kept in (("owed", ["t.py::b", "t.py::c[y]"]), ("passed", ["t.py::a", "t.py::c[x]"])):
        monkeypatch.setenv(lastrun.KEEP, keep)
        items, dropped = [Item(n) for n in ("t.py::a", "t.py::b", "t.py::c[x]", "t.py::c[y]")], []
        lastrun.pytest_collection_modifyitems(Config(), items)
        assert [i.nodeid for i in items] == kept and len(dropped) == 2


def test_the_record_for_the_next_call_adds_what_passed_and_what_was_measured(tmp_path):
    tests = plan.Part("owed-cuda", "", 1, ("true",), tests=("tests/x.py",))
    bench = plan.Part("bench-every-1", "", 1, ("true",), configs=("none", "sync", "checkfreq"))
    results = [execute.Result(tests, "failed (exit 1)", failed=["t::b"], passed=["t::a"]),
               execute.Result(bench, "stopped at its budget", failed=["sync"], passed=["none"])]
    path = report.reached(tmp_path, {"passed": ["t::b", "t::c"], "bench": {10: ["none"]}}, results)
    doc = json.loads(path.read_text())
    assert doc["passed"] == ["t::a", "t::c"] and doc["bench"] == {"10": ["none"], "1": ["none"]}
    assert plan.last_run(path)["bench"] == {10: ["none"], 1: ["none"]}
