"""Leftovers after kills (issue 10, item 11). A SIGKILL of a run's whole tree leaves its staging
files (shared memory) and temporary folder behind; the next run removes them, and never a live
run's. A SIGKILL of the launcher alone ends its engines, which remove their staging files. What a
dead worker started ends with it (tests/test_scripts.py runs it with a DataLoader's forkserver)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from conftest import EXAMPLE, TINY, ckptrun, kill_tree, ok, spawn

from ckptrun.config import RunConfig
from ckptrun.ipc.staging import shm_root
from ckptrun.launcher.worker_groups import end_groups
from ckptrun.storage.leftovers import Owner, new_tag, owned, run_name, staging_path, sweep_stale
from ckptrun.storage.store import Store

LONG = [*TINY, "--steps", "2000"]  # runs far longer than any test waits for it


def wait_for(what: str, cond: Callable[[], object], proc: subprocess.Popen | None = None, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc is None or proc.poll() is None, f"the run exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def owned_by(pid: int) -> list[Path]:
    """The staging files and temporary folders whose names say that launcher `pid` owns them."""
    return sorted(path for path, owner in owned() if owner.pid == pid)


def start_and_commit(cwd: Path, *args: str, fault: str | None = None,
                     ready: Callable[[], bool] = lambda: True) -> subprocess.Popen:
    """A long run of the example, returned once it has committed a checkpoint and `ready()`."""
    cwd.mkdir(exist_ok=True)
    proc = spawn(cwd, "--dir", "ckpts", "--metrics-dir", "metrics", "--no-dashboard", *args, EXAMPLE, *LONG,
                 fault=fault)
    try:
        wait_for("committed checkpoint", lambda: Store(cwd / "ckpts").manifests(warn=False) and ready(), proc)
    except AssertionError:
        kill_tree(proc.pid)
        raise
    return proc


def dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def log(cwd: Path, name: str) -> list[dict]:
    path = cwd / "metrics" / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def pid_of(cwd: Path, name: str, kind: str, attempt: int) -> int | None:
    """The pid in the `attempt`-th (0-based) start event of an engine or worker metrics file."""
    starts = [e for e in log(cwd, name) if e.get("type") == kind]
    return starts[attempt]["pid"] if len(starts) == attempt + 1 else None


def committed_since_start(cwd: Path) -> bool:
    """The newest engine (local rank 0) has committed a record."""
    events = log(cwd, "engine-0.jsonl")
    starts = [i for i, e in enumerate(events) if e.get("type") == "engine"]
    return bool(starts) and any(e.get("type") == "commit" for e in events[starts[-1]:])


def test_names_carry_their_owner():
    me, tag = Owner.current(), new_tag()
    assert me.pid == os.getpid() and me.alive()
    assert Owner.of(run_name(tag, 0, 3)) == me == Owner.of(staging_path(tag, 1, 0).name)
    assert Owner.of(run_name(tag, "") + "k2j4_x1z") == me  # the temporary folder (mkdtemp's suffix)
    assert Owner.of("ckptrun-bench-k2j4_x1z") is None and Owner.of("ckptrun-0123456789ab-0-1") is None
    assert not Owner(me.pid, me.start - 1000).alive()  # the pid reused by another process


@pytest.fixture
def private_roots(tmp_path, monkeypatch):
    """Staging files and temporary folders under this test's own folders: a run in another test
    process sweeps what it finds stale in the shared ones, this test's leftovers included."""
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir(), tmp.mkdir()
    monkeypatch.setenv("CKPTRUN_STAGING_DIR", str(shm))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def test_whole_tree_kill_leftovers_are_swept_by_the_next_run(tmp_path, private_roots):
    proc = start_and_commit(tmp_path / "killed", "--strategy", "checkfreq")
    left = owned_by(proc.pid)
    kill_tree(proc.pid)
    proc.wait()
    assert any(p.is_file() for p in left) and any(p.is_dir() for p in left), left
    assert all(p.exists() for p in left), "nothing should have removed them before the next run"

    # A live run's files (this test process owns them), and a dead run's whose pid was reused by this process.
    live_tag, reused_tag = new_tag(), Owner(os.getpid(), Owner.current().start - 1000).tag()
    live = [staging_path(live_tag, 0, 0), Path(tempfile.mkdtemp(prefix=run_name(live_tag, "")))]
    reused = [staging_path(reused_tag, 0, 0), Path(tempfile.mkdtemp(prefix=run_name(reused_tag, "")))]
    for slot in (live[0], reused[0]):
        slot.write_bytes(b"x" * 8192)
    try:
        run = ok(ckptrun(tmp_path, "--dir", "ckpts", EXAMPLE, *TINY))
        freed = [line for line in run.stderr.splitlines() if line.startswith("ckptrun: freed ")]
        assert len(freed) == 1 and int(freed[0].split()[2].replace(",", "")) > 0, run.stderr
        assert not any(p.exists() for p in left + reused), [p for p in left + reused if p.exists()]
        assert all(p.exists() for p in live)
        left_here = [p for p in private_roots.iterdir() if p != live[1] and not p.name.startswith("torchinductor_")]
        assert not left_here, f"a run left {left_here} (torch's compile cache, for every run, is not a leftover)"
    finally:
        live[0].unlink(missing_ok=True)
        live[1].rmdir()


@pytest.mark.parametrize("engine", ["first", "restarted"])
def test_engines_end_with_their_launcher(engine, tmp_path):
    """A SIGKILL of the launcher alone: its engine exits and removes its staging files, and the
    worker follows. A restarted engine (started from the launcher's monitor thread, so without
    the kernel's parent-death signal) too."""
    attempt = int(engine == "restarted")
    cwd = tmp_path / "run"
    proc = start_and_commit(cwd, "--strategy", "checkfreq", "--max-restarts", "1",
                            fault="kill-engine:step=3:phase=write" if attempt else None,
                            ready=lambda: pid_of(cwd, "engine-0.jsonl", "engine", attempt) is not None
                            and pid_of(cwd, "worker-0.jsonl", "run", attempt) is not None
                            and committed_since_start(cwd))
    engine_pid = pid_of(cwd, "engine-0.jsonl", "engine", attempt)
    worker_pid = pid_of(cwd, "worker-0.jsonl", "run", attempt)
    staging = [p for p in owned_by(proc.pid) if p.parent == shm_root()]
    assert staging and not dead(engine_pid) and not dead(worker_pid)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_for("engine exit", lambda: dead(engine_pid), timeout=10)
        assert not any(p.exists() for p in staging), "the engine left its staging files"
        wait_for("worker exit", lambda: dead(worker_pid), timeout=10)
        assert "launcher (pid" in (cwd / "ckptrun.log").read_text()
    finally:
        kill_tree(proc.pid) if not dead(proc.pid) else None
        for pid in (engine_pid, worker_pid):
            if not dead(pid):
                os.kill(pid, signal.SIGKILL)
    sweep_stale()  # the temporary folder, left for the next run
    assert owned_by(proc.pid) == []


def test_a_staging_dir_that_is_not_a_writable_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTRUN_STAGING_DIR", str(tmp_path / "missing"))
    run = ckptrun(tmp_path, "--dir", "ckpts", EXAMPLE, *TINY)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0, run.stderr
    assert "CKPTRUN_STAGING_DIR" in run.stderr and "writable folder" in run.stderr
    assert not (tmp_path / "ckpts").exists()


def test_an_engine_socket_under_a_long_temporary_folder_takes_an_abstract_name():
    """A socket's address holds 107 bytes: under a longer TMPDIR the engine listened nowhere."""
    short, long = RunConfig(engine_dir="/tmp/ckptrun-x"), RunConfig(engine_dir="/tmp/" + "d" * 90 + "/ckptrun-x")
    assert short.engine_address(0) == "/tmp/ckptrun-x/engine-0.sock"
    assert long.engine_address(1) == "\0ckptrun-x-engine-1"


def test_what_a_dead_worker_left_in_its_group_is_ended_a_process_ignoring_sigterm_killed():
    """A worker in a session of its own (as torch elastic starts one) starts a child that
    ignores SIGTERM and one that does not, and dies: both go, the first after the grace period."""
    code = ("import os, signal, subprocess, sys, time\n"
            "stubborn = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'\n"
            "kids = [subprocess.Popen([sys.executable, '-c', c]) for c in (stubborn, 'import time; time.sleep(600)')]\n"
            "print(*[k.pid for k in kids], flush=True)\n"
            "time.sleep(0.5)\n"  # (the stubborn one has its handler)
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    worker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    kids = [psutil.Process(int(p)) for p in worker.stdout.readline().split()]
    worker.wait()
    assert all(k.is_running() for k in kids)
    t0 = time.monotonic()
    end_groups([worker.pid, os.getpgrp()], grace_s=1.0)  # (its own group: never signalled)
    _, alive = psutil.wait_procs(kids, timeout=5)
    assert not alive, alive
    assert 1.0 <= time.monotonic() - t0 < 5
