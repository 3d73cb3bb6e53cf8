"""The core's promises in ordinary use (issue 10): a committed step is never lost or changed by a
re-run, a second launcher, a failed write or a signal; save errors are loud, bounded and
recovered from; the script's exit code is the run's."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from conftest import (
    EXAMPLE,
    FULL,
    LONG,
    REPRESENTATIVES,
    STEPS,
    TINY,
    assert_training_state,
    ckptrun,
    copy_dir,
    error_line,
    example_run_argv,
    kill_tree,
    load,
    ok,
    restore,
    run_events,
    spawn,
    strategy_params,
    verify,
)

from ckptrun.engine.drain import Drain
from ckptrun.errors import AlreadyCommitted
from ckptrun.ipc.events import EventLog
from ckptrun.restore.recovery import find, load_state, optimizer_classes, plans, restorable
from ckptrun.storage.dirlock import DirectoryReplaced, DirLock
from ckptrun.storage.fsutil import _no_fault
from ckptrun.storage.store import Store, full_name
from ckptrun.storage.tiers import open_tier


def wait_committed(ckpt: Path, at_least: int = 1, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (ckpt.is_dir() and len(Store(ckpt).manifests(warn=False)) >= at_least):
        assert time.monotonic() < deadline, f"nothing committed in {ckpt} after {timeout} s"
        time.sleep(0.1)


def stray_files(ckpt: Path) -> list[str]:
    """Anything a failed save may leave behind: temp files and record dirs without a manifest."""
    temps = [str(p.relative_to(ckpt)) for p in ckpt.rglob(".*.tmp-*")]
    return temps + Store(ckpt).incomplete()


def final_run(cwd: Path, strategy: str, ckpt: Path, *extra, fault: str | None = None):
    return ckptrun(cwd, "--strategy", strategy, "--dir", ckpt, "--keep", "0", "--metrics-dir", cwd / "metrics",
                   *extra, EXAMPLE, *TINY, "--save-at", STEPS, "--save-path", cwd / "final.pt", fault=fault)


# ---- 1. a re-run of a finished command --------------------------------------------------
# One strategy per family by default (record folders, replay chains, a region reusing its slots);
# every registered one under --full. The finished run is the crash matrix's (`example_run`,
# shared): the same command runs again on a copy of its directory.
@pytest.mark.parametrize("strategy", strategy_params(REPRESENTATIVES))
def test_rerun_of_a_finished_command_keeps_every_step(strategy, example_run, example_truth, tmp_path):
    ckpt = copy_dir(example_run(strategy), tmp_path / "ckpts")
    before = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("step-*/*")}
    ok(ckptrun(tmp_path, *example_run_argv(strategy, ckpt)))
    ok(verify(tmp_path, ckpt))
    after = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("step-*/*")}
    assert {k: v for k, v in after.items() if k in before} == before, "a committed record changed"
    store, classes = Store(ckpt), optimizer_classes()
    assert restorable(store)[-1] == STEPS
    for step in restorable(store):  # in-process: what `restore` assembles (the CLI is run once below)
        load_state(store, find(store, step, classes), 0, classes)
    assert_training_state(restore(tmp_path, ckpt, STEPS)[0], example_truth(STEPS))


def test_store_refuses_a_committed_record_without_touching_it(tmp_path):
    store = Store(tmp_path / "ckpts")
    store.ensure_writable()
    data = memoryview(bytes(4096))
    spec = {"x": {"dtype": "uint8", "shape": [8], "offset": 0, "nbytes": 8}}
    store.write_rank(full_name(3), 0, data, spec, {}, {})
    assert store.try_commit(full_name(3), kind="full", step=3, first_step=3, world_size=1)
    files = {p: p.read_bytes() for p in (tmp_path / "ckpts" / full_name(3)).iterdir()}
    with pytest.raises(AlreadyCommitted):
        store.write_rank(full_name(3), 0, memoryview(bytes(8192)), spec, {}, {})
    store.discard_rank(full_name(3), 0)
    store.abandon(full_name(3))
    assert {p: p.read_bytes() for p in (tmp_path / "ckpts" / full_name(3)).iterdir()} == files


def test_a_deleted_directory_is_a_save_error_not_a_fresh_start(tmp_path):
    store = Store(tmp_path / "ckpts")
    store.ensure_writable()
    for p in sorted(store.root.rglob("*"), reverse=True):
        p.unlink()
    store.root.rmdir()
    with pytest.raises(FileNotFoundError):
        store.write_rank(full_name(1), 0, memoryview(bytes(4096)), {}, {}, {})
    assert not store.root.exists()


# ---- 2. one run owns a directory ---------------------------------------------------------
def test_second_launcher_is_refused_and_the_first_is_unharmed(long_truth, tmp_path):
    ckpt = tmp_path / "ckpts"
    first = spawn(tmp_path, "--no-dashboard", "--dir", ckpt, EXAMPLE, *LONG)
    try:
        wait_committed(ckpt)
        t0 = time.monotonic()
        line = error_line(ckptrun(tmp_path, "--dir", ckpt, EXAMPLE, *TINY, "--seed", "3"))
        assert time.monotonic() - t0 < 30
        assert "in use by another ckptrun run" in line and f"pid {first.pid}" in line and "--dir" in line
        for cmd in (["ls", "--dir", ckpt], ["verify", "--dir", ckpt]):  # readers never need the lock
            ok(ckptrun(tmp_path, *cmd))
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
    assert first.returncode == 143, (tmp_path / "ckptrun.log").read_text()
    ok(verify(tmp_path, ckpt))
    step = restorable(Store(ckpt))[-1]
    assert_training_state(restore(tmp_path, ckpt, step)[0], long_truth(step))


def test_a_dead_runs_lock_is_taken_over_and_said(tmp_path):
    ckpt = tmp_path / "ckpts"
    dead = spawn(tmp_path, "--no-dashboard", "--dir", ckpt, EXAMPLE, *LONG)
    wait_committed(ckpt)
    kill_tree(dead.pid)
    dead.wait(timeout=30)
    proc = ok(ckptrun(tmp_path, "--dir", ckpt, EXAMPLE, *TINY))
    assert f"took over {ckpt}/ckptrun.lock" in proc.stderr and f"pid {dead.pid}" in proc.stderr
    ok(verify(tmp_path, ckpt))


def _files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("made_again", [True, False], ids=["replaced", "deleted"])
def test_a_run_whose_directory_was_replaced_never_writes_into_the_new_one(made_again, tmp_path):
    """The OS lock is on the locked directory's file, which a deleted --dir takes with it: once the
    path names another directory (deleted and made again by another run) or none, the run's store
    refuses every write, commit and retention there (an OSError: a save error), removes nothing,
    and says which; its --durable drain uploads nothing from there."""
    ckpt, spec = tmp_path / "ckpts", {"x": {"dtype": "uint8", "shape": [8], "offset": 0, "nbytes": 8}}
    Store(ckpt).ensure_writable()
    lock = DirLock(ckpt).acquire()
    try:
        ours = Store(ckpt, claim=lock.claim)
        ours.write_rank(full_name(1), 0, memoryview(bytes(4096)), spec, {}, {})
        assert ours.try_commit(full_name(1), kind="full", step=1, first_step=1, world_size=1)
        ours.write_rank(full_name(2), 0, memoryview(bytes(4096)), spec, {}, {})
        shutil.rmtree(ckpt)
        if made_again:  # another run's: its steps 1 and 2 committed, its step 3 on its way
            other = Store(ckpt)
            other.ensure_writable()
            for step in (1, 2, 3):
                other.write_rank(full_name(step), 0, memoryview(bytes(4096)), spec, {}, {})
                if step < 3:
                    other.try_commit(full_name(step), kind="full", step=step, first_step=step, world_size=1)
        before = _files(ckpt) if made_again else {}
        said = "was replaced by another directory" if made_again else "is gone"
        for write in (lambda: ours.write_rank(full_name(4), 0, memoryview(bytes(4096)), spec, {}, {}),
                      lambda: ours.write_rank(full_name(1), 0, memoryview(bytes(4096)), spec, {}, {}),
                      lambda: ours.try_commit(full_name(2), kind="full", step=2, first_step=2, world_size=1),
                      lambda: ours.try_commit(full_name(3), kind="full", step=3, first_step=3, world_size=1),
                      lambda: ours.prune(1, incomplete_grace_s=0)):
            with pytest.raises(DirectoryReplaced, match=f"checkpoint directory {ckpt} {said} since this run locked it"):
                write()
        remote = tmp_path / "remote"
        for rank in (0, 1):  # (the leader, a follower)
            drain = Drain(ours, open_tier(str(remote)), 1, 0, EventLog(None, "drain"), lambda step: _no_fault, rank)
            with pytest.raises(DirectoryReplaced):
                drain.round(final=True)
        assert not remote.exists() or not list(remote.iterdir())
        ours.discard_rank(full_name(3), 0)
        ours.mark_failed(full_name(3), 0)
        ours.abandon(full_name(3))
        assert ours.sweep_incomplete() == [] and not ours.owned()
        assert _files(ckpt) == before if made_again else not ckpt.exists()
    finally:
        lock.release()


def test_a_live_run_whose_directory_is_made_again_says_so_once_and_writes_nothing_there(tmp_path):
    """End to end: a live run's --dir deleted and made again (as another run starting on the
    path does): the run says so in one line, its saves fail as save errors (loud, not fatal),
    and nothing of it ever lands in the new directory, to the end of the run."""
    ckpt, log = tmp_path / "ckpts", tmp_path / "ckptrun.log"
    first = spawn(tmp_path, "--no-dashboard", "--dir", ckpt, EXAMPLE, *LONG)
    try:
        wait_committed(ckpt)
        while ckpt.exists():  # (its engine may add a file while the tree goes)
            shutil.rmtree(ckpt, ignore_errors=True)
        Store(ckpt).ensure_writable()
        before = _files(ckpt)
        deadline = time.monotonic() + 60
        while log.read_text().count("save error") < 2:
            assert time.monotonic() < deadline and first.poll() is None, log.read_text()
            time.sleep(0.1)
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
    text = log.read_text()
    assert first.returncode == 143, text
    said = [line for line in text.splitlines() if "this run writes nothing more there" in line]
    assert len(said) == 1 and f"checkpoint directory {ckpt} " in said[0], text
    assert _files(ckpt) == before and Store(ckpt).manifests() == []


# ---- 7-9. save errors: loud, bounded, recovered from -----------------------------------
# (strategy, fault point, failing writes): one point of each strategy by default (a part's data
# before its commit, the manifest's directory after it, a manifest renamed), the others --full.
ENOSPC_CASES = [pytest.param(*case, marks=FULL if i % 2 else ()) for i, case in enumerate([
    ("sync", "data.written", 2), ("sync", "manifest.synced", 3),
    ("checkfreq", "manifest.dir-synced", 1), ("checkfreq", "index.renamed", 2),
    ("lowdiff", "manifest.renamed", 2), ("lowdiff", "data.synced", 2),
])]


@pytest.mark.parametrize(("strategy", "point", "times"), ENOSPC_CASES)
def test_disk_full_for_a_while_is_reported_and_the_run_recovers_exactly(strategy, point, times, example_truth,
                                                                         tmp_path):
    ckpt = tmp_path / "ckpts"
    # lowdiff: no regular full checkpoint after step 0, so only a new chain can commit after the outage
    extra = ["--full-every", "100", "--batch", "2"] if strategy == "lowdiff" else []
    proc = final_run(tmp_path, strategy, ckpt, "--max-steps", STEPS - 3, *extra,
                     fault=f"enospc:step=3:at={point}:times={times}")
    ok(proc)
    assert "No space left on device" in proc.stderr and "training goes on" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert stray_files(ckpt) == []
    ok(verify(tmp_path, ckpt))
    steps = restorable(Store(ckpt))
    assert steps[-1] == STEPS - 3, f"nothing committed after the outage: {steps}"
    if strategy == "lowdiff" and not point.startswith("manifest.dir"):
        assert "starting a new chain" in proc.stderr
    # resumed to the end: bit-exact
    ok(final_run(tmp_path, strategy, ckpt, *extra))
    assert run_events(tmp_path / "metrics")[-1]["resume_step"] == STEPS - 3
    assert_training_state(load(tmp_path / "final.pt"), example_truth(STEPS))
    assert stray_files(ckpt) == []


def test_a_commit_that_keeps_failing_is_given_up_and_fails_the_run_when_asked(tmp_path):
    ckpt = tmp_path / "ckpts"
    t0 = time.monotonic()
    proc = final_run(tmp_path, "sync", ckpt, "--on-save-error", "fail", fault="enospc:step=4:at=manifest.written"
                     ":times=1000")
    assert time.monotonic() - t0 < 120
    line = error_line(proc)
    assert "--on-save-error=fail" in line and "step 4" in line and "No space left on device" in line
    assert restorable(Store(ckpt))[-1] == 3
    assert stray_files(ckpt) == []


# ---- 10. no wait on the engine without a way out ---------------------------------------
def test_lowdiff_resumes_at_a_full_checkpoint_with_a_fresh_engine(example_truth, tmp_path):
    ckpt = tmp_path / "ckpts"
    lowdiff = ["--full-every", "4", "--batch", "2"]
    ok(final_run(tmp_path, "lowdiff", ckpt, "--max-steps", 4, *lowdiff))
    plan = plans(Store(ckpt))[4]
    assert (max(plans(Store(ckpt))), plan.base.name, plan.diffs) == (4, full_name(4), [])  # no replay on resume
    ok(final_run(tmp_path, "lowdiff", ckpt, *lowdiff))
    assert_training_state(load(tmp_path / "final.pt"), example_truth(STEPS))


# ---- 12. signals ---------------------------------------------------------------------------
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_commits_the_last_finished_step_and_exits_in_time(sig, code, long_truth, tmp_path):
    ckpt = tmp_path / "ckpts"
    run = spawn(tmp_path, "--no-dashboard", "--strategy", "checkfreq", "--every", "5", "--term-timeout", "20s",
                "--dir", ckpt, EXAMPLE, *LONG)
    wait_committed(ckpt)  # a step is taken when it is due; the stop saves the last one whatever it is
    t0 = time.monotonic()
    os.killpg(run.pid, sig)  # as a terminal's Ctrl-C does: the launcher's group (engines included)
    run.wait(timeout=60)
    err = (tmp_path / "ckptrun.log").read_text()
    assert time.monotonic() - t0 < 20
    assert run.returncode == code, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"ckptrun: stopped by {sig.name}; step ") and "is committed" in last, err
    assert "Traceback" not in err and "died" not in err
    step = int(last.split("step ")[1].split()[0])
    assert restorable(Store(ckpt))[-1] == step and step >= 5
    ok(verify(tmp_path, ckpt))
    if sig != signal.SIGTERM:  # the stop is the same whichever signal; its resume is checked once
        return
    # resumed for a few more steps: bit-exact with the uninterrupted run
    ok(ckptrun(tmp_path, "--strategy", "checkfreq", "--every", "5", "--max-steps", step + 2, "--dir", ckpt,
               EXAMPLE, *LONG))
    assert_training_state(restore(tmp_path, ckpt, step + 2)[0], long_truth(step + 2))


def test_ddp_ranks_agree_on_the_step_they_stop_after(tmp_path):
    ckpt = tmp_path / "ckpts"
    run = spawn(tmp_path, "--no-dashboard", "--nproc-per-node", "2", "--dir", ckpt, EXAMPLE, *LONG)
    wait_committed(ckpt, at_least=2)
    run.send_signal(signal.SIGTERM)  # the launcher alone: the agent forwards it to both workers
    run.wait(timeout=60)
    err = (tmp_path / "ckptrun.log").read_text()
    assert run.returncode == 143, err
    ok(verify(tmp_path, ckpt))
    newest = Store(ckpt).manifests()[-1]
    assert newest.world_size == 2 and f"step {newest.step} is committed" in err
    assert Store(ckpt).incomplete() == []


# ---- 13. exit codes ------------------------------------------------------------------------
EXIT3 = """
import sys, torch
m = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(3):
    m(torch.ones(2)).sum().backward()
    opt.step()
    opt.zero_grad()
sys.exit(3)
"""


# The code comes through the restart too: without one, under --full.
@pytest.mark.parametrize("restarts", [pytest.param("0", marks=FULL), "1"])
def test_the_scripts_exit_code_is_the_runs(restarts, tmp_path):
    (tmp_path / "exit3.py").write_text(EXIT3)
    proc = ckptrun(tmp_path, "--max-restarts", restarts, "--dir", "ckpts", "exit3.py")
    line = error_line(proc)
    assert proc.returncode == 3 and "exited with code 3" in line and "restart" not in line
    # what it trained is committed (a restarted attempt resumes at 3 and trains 3 more steps)
    assert restorable(Store(tmp_path / "ckpts"))[-1] == 3 * (1 + int(restarts))
