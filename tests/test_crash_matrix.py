"""The crash matrix (DESIGN §8): for each strategy, any committed step restores bit-exact, a worker
or engine killed at step k resumes to the same final state as an uninterrupted run, and torn or
corrupt records are skipped in favour of the previous committed step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import (
    DDP_STEPS,
    EXAMPLE,
    FULL,
    STEPS,
    STRATEGIES,
    TINY,
    assert_training_state,
    ckptrun,
    cli,
    copy_dir,
    error_line,
    flip_tensor_byte,
    load,
    ok,
    restore,
    run_events,
    tear,
    verify,
)

from ckptrun.restore.recovery import load_state, newest_good
from ckptrun.storage.store import Store
from ckptrun.strategies import REGISTRY

K = 7  # the step the restore and damage tests look at

# One run per strategy starts past a torn newest record (step K + 1), then goes through each fault in
# turn, one per attempt (faults.py): the worker killed mid-step, the worker killed while a checkpoint
# is written, the engine killed mid-write.
FAULTS = {9: "kill:step=9", 10: "kill:step=10:phase=write", 11: "kill-engine:step=11:phase=write"}


def resume_run(cwd: Path, strategy: str, ckpt_dir: Path, *extra: str, fault: str | None = None):
    """Run (or resume) the example to the end; the script saves its own final state."""
    return ok(ckptrun(cwd, "--strategy", strategy, *REGISTRY[strategy].short_run_flags, "--dir", ckpt_dir,
                      "--metrics-dir", cwd / "metrics", *extra,
                      EXAMPLE, *TINY, "--save-at", STEPS, "--save-path", cwd / "final.pt", fault=fault))


def assert_clean_and_final(ckpt_dir: Path, truth: dict, damaged: str | None = None) -> None:
    """The run left only committed, verifying records (but the one a test `damaged`, if the run
    did not need to replace it: still reported), the newest being the final step's state."""
    store = Store(ckpt_dir)
    assert store.incomplete() == []
    assert [p for m in store.manifests() if m.name != damaged for p in store.verify_record(m)] == []
    m = newest_good(store)
    assert m is not None and m.step == STEPS
    state = load_state(store, m, 0)
    assert_training_state({"model": state["models"]["model"], "optimizer": state["optimizers"]["optimizer"]},
                          truth)


def newest_and_fallback(ckpt: Path) -> tuple[str, int]:
    """The newest committed record, and the newest step restorable without it (nor anything
    depending on it): what restore and resume must fall back to once it is damaged."""
    manifests = Store(ckpt).manifests()
    target = manifests[-1].name
    bad = {target}
    for m in manifests:
        if bad & set(m.depends_on):
            bad.add(m.name)
    return target, max(m.step for m in manifests if m.name not in bad)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_restore_any_step_equals_script_save(strategy, example_run, example_truth, tmp_path):
    ckpt = example_run(strategy)
    covered = {s for m in Store(ckpt).manifests() for s in range(m.first_step, m.step + 1)}
    assert covered >= set(range(1, STEPS + 1)), "a step of an every-step run has no committed record"
    for step in (K, STEPS):
        state, _ = restore(tmp_path, ckpt, step)
        assert state["step"] == step
        assert_training_state(state, example_truth(step))


HOWS = ["no-manifest", "truncated", "bad-manifest"]
# The damage each strategy's killed run starts past, the kinds taken in turn along the registry so
# that each is resumed from by several layouts; --full also resumes (without faults) after the others.
TORN = {s: HOWS[i % len(HOWS)] for i, s in enumerate(STRATEGIES)}


def torn_copy(example_run, strategy: str, how: str, dst: Path) -> tuple[Path, str, int]:
    """A copy of the strategy's run up to step K + 1 whose newest record is damaged `how`; that
    record's name, and the step restore and resume must fall back to."""
    ckpt = copy_dir(example_run(strategy), dst, up_to=K + 1)
    target, fallback = newest_and_fallback(ckpt)
    tear(ckpt, target, how)
    return ckpt, target, fallback


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_killed_run_finishes_exactly(strategy, example_run, example_truth, tmp_path):
    ckpt, target, fallback = torn_copy(example_run, strategy, TORN[strategy], tmp_path / "ckpts")
    proc = resume_run(tmp_path, strategy, ckpt, "--max-restarts", len(FAULTS), fault=";".join(FAULTS.values()))
    attempts = run_events(tmp_path / "metrics")
    assert [e["restart_count"] for e in attempts] == list(range(len(FAULTS) + 1)), "a fault did not fire"
    assert attempts[0]["resume_step"] == fallback, f"the first attempt did not resume past the torn {target}"
    resumed = [e["resume_step"] for e in attempts[1:]]
    for at, (step, fault) in zip(resumed, FAULTS.items(), strict=True):
        assert fallback <= at <= step, f"after {fault} the run resumed at step {at}"
    assert resumed == sorted(resumed), f"a resume went back past a committed step: {resumed}"
    assert "checkpoint engine of local rank 0 died" in proc.stderr
    assert_training_state(load(tmp_path / "final.pt"), example_truth(STEPS))
    assert_clean_and_final(ckpt, example_truth(STEPS), damaged=target)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_torn_newest_record_is_ignored(strategy, how, example_run, example_truth, tmp_path):
    ckpt, _, fallback = torn_copy(example_run, strategy, how, tmp_path / "ckpts")
    state, _ = restore(tmp_path, ckpt, "latest")
    assert state["step"] == fallback
    assert_training_state(state, example_truth(fallback))


@pytest.mark.parametrize("strategy, how", [pytest.param(s, how, marks=FULL) for s in STRATEGIES for how in HOWS
                                            if how != TORN[s]])
def test_run_resumes_past_a_torn_record(strategy, how, example_run, example_truth, tmp_path):
    ckpt, target, fallback = torn_copy(example_run, strategy, how, tmp_path / "ckpts")
    resume_run(tmp_path, strategy, ckpt)
    assert run_events(tmp_path / "metrics")[0]["resume_step"] == fallback
    assert_training_state(load(tmp_path / "final.pt"), example_truth(STEPS))
    assert_clean_and_final(ckpt, example_truth(STEPS), damaged=target)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_flipped_byte_is_reported_and_skipped(strategy, example_run, example_truth, tmp_path):
    ckpt = copy_dir(example_run(strategy), tmp_path / "ckpts", up_to=K + 1)
    target, fallback = newest_and_fallback(ckpt)
    key = flip_tensor_byte(ckpt, target)

    proc = verify(tmp_path, ckpt)
    assert proc.returncode == 1
    bad = [line for line in proc.stdout.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1 and target in bad[0] and key in bad[0], proc.stdout

    state, stderr = restore(tmp_path, ckpt, "latest")
    assert state["step"] == fallback
    assert_training_state(state, example_truth(fallback))
    if fallback < K + 1:  # (else another record holds that step too: lowdiff's diff beside a full)
        assert f"step {K + 1} is damaged" in stderr
        out = tmp_path / "bad.pt"
        line = error_line(cli(tmp_path, "restore", "--dir", ckpt, "--step", K + 1, "--out", out))
        assert f"step {K + 1}" in line and "checksum mismatch" in line
        assert re.search(rf"good step\D*\b{fallback}\b", line), line
        assert not out.exists()


# Under DDP: the 2-rank run of dp_mlp.py whose rank 1 is killed mid-step 5 (shared with
# tests/test_writeonce.py), against the same script under plain torchrun.
def test_ddp_rank1_killed_resumes_exactly(ddp_killed_run, ddp_truth, tmp_path):
    run = ddp_killed_run("checkfreq", 2)
    m = Store(run / "ckpts").manifests()[-1]
    assert (m.step, m.world_size) == (DDP_STEPS, 2)
    for rank in range(2):
        attempts = run_events(run / "metrics", rank)
        assert [e["restart_count"] for e in attempts] == [0, 1], f"rank {rank} was not restarted"
        truth = load(ddp_truth(2) / f"own-{rank}-{DDP_STEPS}.pt")
        own = load(run / f"own-{rank}-{DDP_STEPS}.pt")
        assert_training_state(own, truth)
        state, _ = restore(tmp_path, run / "ckpts", DDP_STEPS, rank=rank)
        assert_training_state(state, {"model": own["model"], "optimizer": own["optimizer"]})
