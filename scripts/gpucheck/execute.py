"""Run a part: its command in a process tree of its own, its output in its log, stopped (the
whole tree) at its budget; then what it did not reach: tests or bench configurations."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .plan import REPO, Part

# A pytest -v result line (with or without xdist's "[gw0] [ 10%]" in front) and a bench progress line.
TEST_LINE = re.compile(r"(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)|"
                       r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+::\S+)")
BENCH_LINE = re.compile(r"^\[\d+/\d+\] (\S+) \(repetition \d+\): (FAILED)?")
NO_TESTS = 5  # pytest's exit status when no test is selected


@dataclass
class Result:
    part: Part
    status: str  # "passed", "failed (exit N)", "stopped at its budget", "not run (why)"
    seconds: float = 0.0
    not_reached: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # tests or configurations that failed
    passed: list[str] = field(default_factory=list)  # tests or configurations it finished, not failed or skipped

    @property
    def ok(self) -> bool:
        return self.status == "passed"


def run(part: Part, out: Path, env: dict[str, str]) -> Result:
    t0 = time.monotonic()
    planned = collect(part, env) if part.tests else list(part.configs)
    log = out / part.log_name
    with log.open("a") as sink:
        sink.write(f"==== {part.name}: {part.shown()}\n")
        sink.flush()
        proc = subprocess.Popen(part.argv, cwd=REPO, env={**env, **part.env}, stdout=sink, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc: int | None = proc.wait(max(1.0, part.budget_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            rc = None
    if part.scratch is not None:
        shutil.rmtree(part.scratch, ignore_errors=True)
    done, failed, skipped = reached(part, log.read_text(errors="replace"))
    if rc == NO_TESTS and part.tests and not planned:  # (nothing owed: every test it selects passed last time)
        rc = 0
    status = "passed" if rc == 0 else "stopped at its budget" if rc is None else f"failed (exit {rc})"
    return Result(part, status, time.monotonic() - t0, [p for p in planned if p not in done], failed,
                  sorted(set(done) - set(failed) - set(skipped)))


def collect(part: Part, env: dict[str, str]) -> list[str]:
    """The test ids the part selects (pytest --collect-only)."""
    try:
        proc = subprocess.run([part.argv[0], "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               *part.tests], cwd=REPO, env={**env, **part.env}, capture_output=True, text=True,
                              timeout=part.budget_s / 2)
    except subprocess.TimeoutExpired:  # (the run itself then says what is wrong)
        return []
    return [line.strip() for line in proc.stdout.splitlines() if "::" in line]


def reached(part: Part, text: str) -> tuple[set[str], list[str], list[str]]:
    """What the part's log shows it finished, which of those failed, and which were skipped
    (finished, not passed: no CUDA device, say)."""
    done, failed, skipped = set(), [], []
    for line in text.splitlines():
        if part.tests:
            m = TEST_LINE.search(line)
            if m:
                test, status = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
                done.add(test)
                failed += [test] if status in ("FAILED", "ERROR") else []
                skipped += [test] if status == "SKIPPED" else []
        elif m := BENCH_LINE.match(line):
            name = m.group(1).split("@")[0]
            done.add(name)
            failed += [name] if m.group(2) else []
    return done, failed, skipped


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the part and everything under it: ckptrun's workers run in sessions of their own."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        victims = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        victims = []
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            continue
    proc.wait()


def environment(pythonpath: str) -> dict[str, str]:
    """The parts' environment: this one, with `pythonpath` first and unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTRUN_")}
    env["PYTHONPATH"] = os.pathsep.join([pythonpath, *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env
