"""Optimizers as real training code uses them (issue 11): `step(closure)` (Lightning, LBFGS), a
wrapper that delegates to the real optimizer (accelerate), several optimizers (GANs). Every
registered strategy either restores them bit-exact, also after a kill and restart, or refuses
at start with one clear line; never a crash mid-run or a silently wrong restore. The refusals are
checked for every strategy; the killed-and-restored runs of each case for one representative
(DEFAULT_RESTORES) by default, for every registered strategy under --full."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import (
    FULL,
    REPRESENTATIVES,
    SCRIPTS,
    STEPS,
    assert_training_state,
    ckptrun,
    error_line,
    load,
    ok,
    restore,
    run_events,
    run_in_process,
)

from ckptrun.storage.store import Store
from ckptrun.strategies import REGISTRY, checkpoints_every_optimizer, names_where

CASES = {  # id -> (script, script args, what a single-optimizer (replaying) strategy says)
    "closure": ("closure_loop.py", [], None),
    "lbfgs": ("closure_loop.py", ["--lbfgs"], "LBFGS"),
    "wrapper": ("wrapped_optimizer.py", [], None),
    "two-optimizers": ("two_optimizers.py", [], "creates a second one"),
}


def replays(strategy: str) -> bool:
    return REGISTRY[strategy].load().single_optimizer


def comparable(state: dict) -> dict:
    """A restored file with further models/optimizers lifted out of "extra", as the scripts save them."""
    return {**state, **state.get("extra", {})}


# The killed-and-restored run of each case by default: every family of conftest.REPRESENTATIVES
# restores some case. A closure (Lightning's optimizer step) and a wrapper (accelerate's
# AcceleratedOptimizer) under checkfreq and lightcheck also run by default in tests/frameworks.
DEFAULT_RESTORES = {"closure": "lowdiff", "wrapper": "lowdiff", "lbfgs": "lightcheck", "two-optimizers": "checkfreq"}
assert set(DEFAULT_RESTORES.values()) == set(REPRESENTATIVES)


# The refusal of each refused case by default under one replaying strategy: the refusal is one
# check every strategy shares (worker/runtime.py, on `Strategy.single_optimizer`, which
# `replays` reads), so the other replaying strategies repeat it under --full.
DEFAULT_REFUSALS = {"lbfgs": "gockpt", "two-optimizers": "lowdiff+"}
assert all(replays(s) and CASES[case][2] for case, s in DEFAULT_REFUSALS.items())


def _strategy_cases() -> list:
    """(strategy, case) for every registered strategy and case; opt-in (--full) outside
    DEFAULT_RESTORES and DEFAULT_REFUSALS."""
    return [pytest.param(s, case, id=f"{s}-{case}",
                         marks=() if s in (DEFAULT_RESTORES[case], DEFAULT_REFUSALS.get(case)) else FULL)
            for s in REGISTRY for case in CASES]


@pytest.fixture(scope="module")
def truths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted plain-python save of each case, by case: the same for every strategy,
    run once (in process, before the first ckptrun run that needs it)."""
    return {case: tmp_path_factory.mktemp(f"truth-{case}") / "truth.pt" for case in CASES}


@pytest.mark.parametrize(("strategy", "case"), _strategy_cases())
def test_optimizer_shapes_restore_exactly_or_are_refused(strategy, case, truths, tmp_path):
    script, extra, refusal = CASES[case]
    args = [SCRIPTS / script, *extra, "--steps", STEPS, "--save-at", STEPS, "--save-path"]
    if refusal and replays(strategy):
        proc = ckptrun(tmp_path, "--strategy", strategy, "--dir", "ckpts", *args, "resumed.pt")
        line = error_line(proc)
        assert refusal in line and f"--strategy {names_where(checkpoints_every_optimizer)}" in line, line
        assert Store(tmp_path / "ckpts").manifests() == []
        return
    if not truths[case].exists():
        run_in_process(truths[case].parent, *args, truths[case])
    ok(ckptrun(tmp_path, "--strategy", strategy, "--dir", "ckpts", "--keep", "0", "--max-restarts", "1",
               "--metrics-dir", "metrics", *args, "resumed.pt", fault="kill:step=7"))
    assert [e["restart_count"] for e in run_events(tmp_path / "metrics")] == [0, 1], "the fault did not fire"
    truth = load(truths[case])
    assert_training_state(load(tmp_path / "resumed.pt"), truth)
    restored, _ = restore(tmp_path, tmp_path / "ckpts", STEPS)
    assert_training_state(comparable(restored), truth)
    assert "optimizer_1" not in restored["extra"] or case == "two-optimizers"


@pytest.mark.parametrize("policy", ["resume", "fresh", "fail"])
def test_a_script_that_does_not_resume_itself_is_handled_by_policy(policy, tmp_path):
    args = [SCRIPTS / "no_resume.py", "--steps", STEPS, "--save-at", STEPS, "--save-path"]
    if policy == "fresh":  # the one policy compared with the uninterrupted run
        run_in_process(tmp_path, *args, tmp_path / "truth.pt")
    proc = ckptrun(tmp_path, "--on-restart", policy, "--dir", "ckpts", "--keep", "0", "--max-restarts", "1",
                   *args, "final.pt", fault="kill:step=7")
    warning = "does not call ckptrun.resume_step()"
    newest = Store(tmp_path / "ckpts").manifests()[-1].step
    if policy == "fail":
        line = error_line(proc)
        assert proc.returncode == 2 and warning in line and "--on-restart fresh" in line
        assert newest == 6
    elif policy == "fresh":  # from scratch: the uninterrupted run's result, committed steps kept
        ok(proc)
        assert warning not in proc.stderr
        assert_training_state(load(tmp_path / "final.pt"), load(tmp_path / "truth.pt"))
        assert newest == STEPS
    else:  # resumed at 6, the loop runs all its iterations again: 6 extra steps, said once
        ok(proc)
        assert proc.stderr.count(warning) == 1 and "6 more optimizer steps" in proc.stderr
        assert newest == STEPS + 6
