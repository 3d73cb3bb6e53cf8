"""The memory tier of the snapshot strategies (`--persist-every` with every strategy whose
registry entry takes it as a snapshot strategy does): every step held in the engine's memory,
every P-th written. A worker crash resumes from the engine's memory, bit-exact, with one and two
(DDP) ranks; an engine crash from the newest write; what cannot work is refused at start."""

from __future__ import annotations

import pytest
from conftest import (
    EXAMPLE,
    FULL,
    STEPS,
    TINY,
    assert_ddp_ranks_resume_from_memory,
    assert_training_state,
    ckptrun,
    error_line,
    load,
    run_events,
)
from test_crash_matrix import FAULTS, assert_clean_and_final, resume_run

from ckptrun.config import RunConfig
from ckptrun.engine.held import HeldSnapshot
from ckptrun.ipc.messages import RecordSpec
from ckptrun.storage.store import Store
from ckptrun.strategies import REGISTRY
from ckptrun.strategies.memory_first import SNAPSHOT_PERSIST_EVERY

HOLDING = [name for name, entry in REGISTRY.items() if SNAPSHOT_PERSIST_EVERY in entry.options]
# Every strategy that takes it; the default one by default, the others under --full.
HOLDING_PARAMS = [pytest.param(s, marks=() if s == RunConfig.strategy else FULL) for s in HOLDING]


def test_the_snapshot_strategies_take_the_memory_first():
    assert {"checkfreq", "sync"} <= set(HOLDING)


@pytest.mark.full  # (the crash matrix's faults below take the same paths by default)
@pytest.mark.parametrize("strategy", HOLDING)
def test_worker_crash_resumes_from_memory_and_engine_crash_from_disk(strategy, example_truth, tmp_path):
    """--persist-every 5. The worker killed at step 7: the restarted worker resumes at step 6,
    which no record holds (the engine held its staging slot). Then the engine dies while writing
    step 10: the new engine holds nothing, so the run resumes from the newest write (step 5).
    Only multiples of 5 and the final step reach the disk, and the run ends bit-exact."""
    proc = resume_run(tmp_path, strategy, tmp_path / "ckpts", "--persist-every", "5", "--max-restarts", "2",
                      fault="kill:step=7;kill-engine:step=10:phase=write")
    attempts = run_events(tmp_path / "metrics")
    assert [(e["restart_count"], e["resume_step"]) for e in attempts] == [(0, 0), (1, 6), (2, 5)]
    assert "resumed step 6 from the checkpoint engine's memory (no disk read)" in proc.stderr
    steps = [m.step for m in Store(tmp_path / "ckpts").manifests()]
    assert set(steps) <= {5, 10, STEPS} and steps[-1] == STEPS, steps
    assert_training_state(load(tmp_path / "final.pt"), example_truth(STEPS))
    assert_clean_and_final(tmp_path / "ckpts", example_truth(STEPS))


@pytest.mark.parametrize("strategy", HOLDING_PARAMS)
def test_each_crash_matrix_fault_resumes_exactly(strategy, example_truth, tmp_path):
    """The crash matrix's faults in turn, --persist-every 4: a worker killed mid-step 9 resumes
    from memory at 8; one killed while step 10 is written (a step held only is written then, for
    the fault to fire) from memory at 10; the engine killed while it writes 11, from the disk
    at 10."""
    proc = resume_run(tmp_path, strategy, tmp_path / "ckpts", "--persist-every", "4", "--max-restarts", len(FAULTS),
                      fault=";".join(FAULTS.values()))
    attempts = run_events(tmp_path / "metrics")
    resumed = [e["resume_step"] for e in attempts[1:]]
    assert resumed == [8, 10, 10], resumed
    assert proc.stderr.count("from the checkpoint engine's memory (no disk read)") == 2, proc.stderr
    assert_training_state(load(tmp_path / "final.pt"), example_truth(STEPS))
    assert_clean_and_final(tmp_path / "ckpts", example_truth(STEPS))


def test_ddp_two_ranks_resume_from_memory_exactly(tmp_path):
    """Rank 1 killed at step 5 of a DDP run on one shared --dir: both engines hold step 4 (each
    rank's whole state, replicated tensors too), both ranks resume from memory there and end as
    an uninterrupted run does; nothing but the final step was written."""
    assert_ddp_ranks_resume_from_memory(tmp_path, ["--strategy", "checkfreq", "--persist-every", "1000"])
    assert [m.step for m in Store(tmp_path / "killed" / "ckpts").manifests()] == [STEPS]


@pytest.mark.parametrize(("extra", "says"), [
    (["--every", "4", "--persist-every", "3"], "--persist-every 3 with --every 4"),
    (["--persist-every", "2", "--max-inflight", "1"], "--persist-every with --max-inflight 1"),
    (["--strategy", "pccheck", "--persist-every", "2"], "--persist-every is an option of --strategy"),
])
def test_what_cannot_work_is_refused_at_start(extra, says, tmp_path):
    proc = ckptrun(tmp_path, "--dir", "ckpts", *extra, EXAMPLE, *TINY)
    line = error_line(proc)
    assert proc.returncode == 2 and says in line, line
    assert not list(tmp_path.glob("ckpts/full-*"))


def _spec(step: int) -> RecordSpec:
    return RecordSpec(record=f"full-{step:08d}", kind="full", step=step, skeleton={}, tensors={}, meta={})


def test_a_late_older_snapshot_never_replaces_a_newer_one():
    """Writer threads finish out of order: the held slot is always the newest step's, and every
    other slot is given back exactly once."""
    held = HeldSnapshot()
    assert held.hold(3, _spec(7), 100) == (True, [])
    assert held.hold(4, _spec(9), 100) == (True, [3])  # newer: the old slot goes back
    assert held.hold(5, _spec(8), 100) == (False, [5])  # older, late: given back at once
    assert held.held() == [(9, 100)] and held.holds(4) and not held.holds(3)
    assert held.fetch(None, lambda slot: f"slot-{slot}")["path"] == "slot-4"
    held.drop()
    assert held.held() == [] and not held.holds(4)


def test_a_slot_being_written_goes_back_only_once_written():
    """The step written every P steps is held as it arrives (the slot held before goes back at
    once: the next capture never waits for the write); replaced while its write runs, its slot
    goes back when the write is done, not before."""
    held = HeldSnapshot()
    assert held.hold(1, _spec(9), 100) == (True, [])
    assert held.hold(2, _spec(10), 100, writing=True) == (True, [1])
    assert held.hold(3, _spec(11), 100) == (True, [])  # slot 2 is still being written
    assert held.written(2) == [2] and held.held() == [(11, 100)]
    assert held.hold(4, _spec(12), 100, writing=True) == (True, [3])
    assert held.written(4) == [] and held.holds(4)  # written and still the newest: kept
    assert held.hold(5, _spec(8), 100, writing=True) == (False, [])  # late and older, being written
    assert held.written(5) == [5]


def test_with_replicas_the_step_before_stays_held_and_a_pinned_slot_waits_for_its_reader():
    """--replicas (keep 2): the two newest steps are held, either can be fetched; a slot a
    partner's copy is cut from goes back only once the copy is cut, and once only."""
    held = HeldSnapshot()
    held.keep = 2
    assert held.hold(1, _spec(4), 100) == (True, [])
    assert held.hold(2, _spec(5), 100) == (True, [])
    assert held.held() == [(5, 100), (4, 100)]
    assert held.fetch(4, lambda slot: f"slot-{slot}")["path"] == "slot-1"
    assert held.pin(4)[0] == 1 and held.pin(3) is None
    assert held.hold(3, _spec(6), 100) == (True, [])  # slot 1 is being read
    assert held.unpin(1) == [1] and held.held() == [(6, 100), (5, 100)]
    assert held.pin(6)[0] == 3 and held.pin(6)[0] == 3  # two readers
    assert held.hold(4, _spec(7), 100) == (True, [2])
    assert held.hold(5, _spec(8), 100) == (True, [])
    assert held.unpin(3) == [] and held.unpin(3) == [3]
