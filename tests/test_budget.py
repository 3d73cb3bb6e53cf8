"""The overhead budget (`--max-overhead`, ckptrun/worker/budget.py): the controller on simulated
cost sequences (deterministic: no timing), the verdicts said once, the baseline kept across
restarts, and end to end: the default run thins its checkpoints, an explicit --every is kept, and
a fresh run's probe of the no-checkpoint step resumes bit-exact."""

from __future__ import annotations

import json
import random
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import EXAMPLE, STEPS, TINY, assert_training_state, ckptrun, load, ok, resumed_beside_plain

from ckptrun.cli import parse_budget
from ckptrun.errors import UsageError
from ckptrun.launcher.console.fmt import summary_rows
from ckptrun.launcher.console.metrics_state import MetricsState
from ckptrun.storage.store import Store
from ckptrun.strategies.save_policy import Measured
from ckptrun.worker.budget import PROBE_STEPS, Baseline, Watch
from ckptrun.worker.decisions import DalyInterval, EveryStep, FixedInterval, PersistBound, Retuner, WithinBudget
from ckptrun.worker.hooks import StepHooks
from ckptrun.worker.kept import Kept

BUDGET = 0.05
HOOKS_S = 2e-5  # a step's stall with nothing due: the hooks' check (a real run's is never 0)


class Machine:
    """A run on a simulated machine: a step of `base` seconds (times `noise[step % len(noise)]`);
    a checkpoint costs the step after it `cost` seconds of stall; each write takes `persist`
    seconds (reported as durable at once). Every step shows the hooks' own few microseconds of
    stall, as a real one does."""

    def __init__(self, policy, *, base=0.1, cost=0.02, persist=0.05, explicit=None, every_step=False,
                 strategy="checkfreq", kept="", share=None, noise=(1.0,)):
        self.base, self.cost, self.persist, self.noise = base, cost, persist, noise
        self.said: list[tuple[str, bool]] = []
        self.events: list[dict] = []
        self.watch = Watch(BUDGET, Baseline(Kept(kept)), strategy=strategy, instead="checkfreq", every_step=every_step,
                           explicit_every=explicit, say=lambda line, warn: self.said.append((line, warn)),
                           emit=lambda **e: self.events.append(e))
        self.retuner = Retuner(3600.0, watch=self.watch, share=share)
        self.policy = self.retuner.add(policy)
        self.watch.start_probe(0)
        self.step, self.owed = 0, 0.0

    def run(self, steps: int) -> Machine:
        for _ in range(steps):
            self.step += 1
            s = self.step
            probing = s <= self.watch.probe_until
            ckpt = not probing and (self.watch.every_step or self.policy.due(s))
            stall, self.owed = self.owed, (self.cost if ckpt else 0.0)
            if self.watch.every_step:
                stall, self.owed = (0.0 if probing else self.cost), 0.0
            if ckpt:
                self.retuner.observe_write(10**8, self.persist)
            self.retuner.after_step(s, {"step_s": self.base * self.noise[s % len(self.noise)] + stall,
                                        "stall_s": {"snapshot": stall or HOOKS_S},
                                        "last_snapshot_step": s if ckpt else None, "inflight": int(ckpt)})
        return self

    def overheads(self) -> list[float]:
        return [e["overhead"] for e in self.events if e["type"] == "overhead"]


def test_the_interval_is_the_finest_that_keeps_within_the_budget():
    """A 20 ms checkpoint against a 100 ms step is 20% every step: every 4 steps is 5%."""
    m = Machine(WithinBudget(PersistBound(EveryStep()))).run(PROBE_STEPS + 80)
    assert m.watch.baseline.step_s == pytest.approx(0.1)
    assert m.policy.every == 4
    assert m.overheads()[0] > BUDGET and BUDGET / 2 < m.retuner.measured().overhead <= BUDGET * 1.1
    assert m.said == []


def _late_first_checkpoint(solo: bool, setup: float = 0.0) -> Retuner:
    """Steps of 0.1 s; the first checkpoint after the probe comes late (4 steps after it: the
    slots' set-up, a skip), so the first evaluation (3 steps after the probe) sees none; its write
    ends a step later and slows that step and the next by 0.2 s each. `setup`: the slots' set-up
    thread slows the 3 steps before the checkpoint by that much, and the checkpoint waits 3 times
    that for it (stall "setup")."""
    watch = Watch(BUDGET, Baseline(), strategy="checkfreq", instead="checkfreq")
    retuner = Retuner(3600.0, watch=watch, share=None if solo else (lambda step, decisions: decisions))
    retuner.add(WithinBudget(PersistBound(EveryStep())))
    watch.start_probe(0)
    ckpt = PROBE_STEPS + 4
    for step in range(1, ckpt + 3):
        if step == ckpt + 1:
            retuner.observe_write(10**8, 0.1)
        slow = 0.2 if step > ckpt else setup if ckpt - 3 <= step < ckpt else 3 * setup if step == ckpt else 0.0
        retuner.after_step(step, {"step_s": 0.1 + slow, "stall_s": {"setup": 3 * setup} if step == ckpt else {},
                                  "last_snapshot_step": ckpt if step == ckpt else None})
    return retuner


def test_the_slots_set_up_once_a_run_is_not_a_checkpoints_cost():
    """A set-up that slowed the steps before the first checkpoint and made it wait (the wide
    model's 37 s once chose every 260 steps from it) leaves the interval the checkpoint's own
    cost calls for."""
    plain = _late_first_checkpoint(solo=True).policies[0].every
    assert _late_first_checkpoint(solo=True, setup=2.0).policies[0].every == plain


def test_one_rank_decides_as_soon_as_a_written_checkpoint_shows_its_cost():
    """Not 25 steps later: from the first evaluation on, one rank evaluates at every step until
    a written checkpoint's cost is in its window. Ranks of a run of several evaluate at the same
    steps (they agree on each decision), so they wait for the regular ones."""
    solo = _late_first_checkpoint(solo=True)
    assert solo.watch.measured and solo.policies[0].every >= 40, solo.policies[0].every
    several = _late_first_checkpoint(solo=False)
    assert not several.watch.measured and several.policies[0].every == 1


def test_an_evaluation_with_nothing_measured_since_a_change_keeps_the_interval():
    """Right after a change the window is empty: one rank's next evaluation (it evaluates every
    step until measured) once fell back to every step (185 -> 1 on the wide model)."""
    retuner = _late_first_checkpoint(solo=True)
    assert not [s for s in retuner._steps if s[2]], "the window holds a checkpoint since the change"
    assert retuner.policies[0].propose(retuner.measured(), 11) is None


def test_the_tail_of_a_write_in_flight_at_a_change_is_not_charged_to_the_next_checkpoint():
    """The interval changes at step 7 while step 7's write is in flight; it slows steps 8 and 9
    (the old setting's cost) and ends: the new window starts after it, and holds no cost yet."""
    watch = Watch(BUDGET, Baseline(), strategy="checkfreq", instead="checkfreq")
    retuner = Retuner(3600.0, watch=watch)
    policy = retuner.add(WithinBudget(PersistBound(EveryStep())))
    watch.start_probe(0)
    for step in range(1, 20):
        if step in (6, 10):
            retuner.observe_write(10**8, 0.2)
        ckpt = step in (5, 7)
        slow = 0.2 if step in (6, 7) else 2.9 if step in (8, 9) else 0.0
        retuner.after_step(step, {"step_s": 0.1 + slow, "stall_s": {}, "inflight": int(5 <= step <= 9),
                                  "last_snapshot_step": step if ckpt else None})
    assert policy.every > 1
    m = retuner.measured()
    assert m.cost_s is None and m.overhead == pytest.approx(0.0), m


def test_a_disk_that_slows_mid_run_makes_the_interval_coarser():
    m = Machine(WithinBudget(PersistBound(EveryStep())), cost=0.002).run(PROBE_STEPS + 40)
    assert m.policy.every == 1  # 2% of the step: every step fits
    m.persist = 1.2  # the disk slows: one write spans 12 steps
    m.run(100)
    assert m.policy.every >= 12, "never checkpoint faster than the disk drains"
    m.persist, m.cost = 0.05, 0.02
    m.run(150)
    assert 4 <= m.policy.every < 12 and m.retuner.measured().overhead <= BUDGET


def test_a_step_that_speeds_up_is_measured_again_and_the_interval_follows():
    m = Machine(WithinBudget(PersistBound(EveryStep()))).run(PROBE_STEPS + 80)
    assert m.policy.every == 4
    m.base = 0.05  # quiet steps show it; the same checkpoint is now a larger share of the step
    m.run(200)
    assert m.watch.baseline.step_s == pytest.approx(0.05)
    assert m.policy.every == 8


def test_a_noisy_step_is_measured_by_its_mean_not_its_fastest():
    """Steps that vary by +-20% around 0.1 s (the wide model's vary by a factor of two; seeded,
    the same every run) and a checkpoint costing 60 ms (every 12 steps keeps 5%): the baseline
    follows the quiet steps' mean, and the interval stays about the one the checkpoint's own cost
    calls for. On the old code the probe's fastest step was the baseline for good (the hooks' few
    microseconds of stall made no step quiet): each step's noise above it was charged to the
    checkpoint, and the interval ran away with itself (96 to 403 steps; 4 s read as 40 s on the
    wide model), while the run said it was over budget (12%)."""
    rng = random.Random(0)
    noise = tuple(rng.uniform(0.8, 1.2) for _ in range(997))
    m = Machine(WithinBudget(PersistBound(EveryStep())), noise=noise, cost=0.06).run(PROBE_STEPS + 100)
    intervals = [m.run(10).policy.every for _ in range(40)]
    assert m.watch.baseline.step_s == pytest.approx(0.1 * sum(noise) / len(noise), rel=0.05)
    assert 8 <= sorted(intervals)[len(intervals) // 2] <= 18 and max(intervals) <= 36, intervals
    m.watch.report(m.step)
    assert 0 < m.overheads()[-1] <= BUDGET * 1.2


def test_a_step_that_changes_to_two_speeds_keeps_a_baseline():
    """The newest quiet steps alternate between two speeds far from the baseline and from their
    median (0.1, 0.3 after 0.05): those kept after the change are never none (a division by zero
    in a first version of this rule crashed the getting-started tour's run)."""
    baseline = Baseline()
    for i in range(PROBE_STEPS):
        baseline.probed(0.05, last=i == PROBE_STEPS - 1)
    for s in (0.1, 0.1, 0.1, 0.3, 0.3, 0.3, 0.1, 0.3):
        baseline.quiet(s)
    assert 0.1 <= baseline.step_s <= 0.3


def test_within_budget_does_not_see_saw_at_an_interval_that_keeps_it():
    """A sparse interval measures a cheaper checkpoint (no writes overlap): at an overhead within
    budget, and above half of it, the bound keeps the interval it has."""
    policy = WithinBudget(PersistBound(EveryStep()))
    policy.every = 10
    m = Measured(3600.0, True, step_s=0.1, budget=BUDGET, base_step_s=0.1, cost_s=0.03, overhead=0.04)
    assert policy.propose(m, 50) is None
    low = Measured(3600.0, True, step_s=0.1, budget=BUDGET, base_step_s=0.1, cost_s=0.01, overhead=0.01)
    assert policy.propose(low, 50).settings == {"every": 5}, "lowered by half at most"
    policy.every = 5
    assert policy.propose(low, 75).settings == {"every": 2}
    noise = Measured(3600.0, True, step_s=0.1, budget=BUDGET, base_step_s=0.1, cost_s=0.0, overhead=-0.011)
    assert policy.propose(noise, 100) is None, "a window faster than the no-checkpoint step is no reading"
    daly = WithinBudget(PersistBound(DalyInterval()))  # --every auto: Daly's own target is not held back
    daly.every = 100
    shorter = Measured(60.0, True, step_s=0.1, delta_s=0.1, budget=BUDGET, base_step_s=0.1, cost_s=0.1,
                       overhead=0.0001)  # (a shorter MTBF: Daly's interval drops below half)
    wanted = DalyInterval().target(shorter)[0]
    assert 20 < wanted < 50 and daly.propose(shorter, 125).settings == {"every": wanted}


def test_an_interval_is_not_lowered_before_a_checkpoint_at_it_was_measured():
    policy = WithinBudget(PersistBound(EveryStep()))
    policy.every = 74
    m = Measured(3600.0, True, step_s=1.0, persist_s=4.0, budget=BUDGET, base_step_s=1.0, overhead=0.0)
    assert policy.propose(m, 25) is None


def test_an_explicit_every_is_kept_and_its_cost_said_once_with_the_interval_that_fits():
    m = Machine(FixedInterval(1), explicit=1).run(PROBE_STEPS + 80)
    assert m.policy.every == 1
    assert len(m.said) == 1
    line, warn = m.said[0]
    assert warn and "--every 1 costs" in line and "--every 4 would keep within it" in line
    assert [e["verdict"] for e in m.events if e["type"] == "budget"] == ["explicit"]


def test_a_strategy_working_every_step_says_once_that_it_is_over_budget_naming_one_that_keeps_within():
    m = Machine(FixedInterval(1), every_step=True, strategy="lowdiff").run(PROBE_STEPS + 80)
    assert len(m.said) == 1
    line, warn = m.said[0]
    assert warn and "--strategy lowdiff costs 20.0%" in line and "--strategy checkfreq keeps within it" in line
    assert [e["verdict"] for e in m.events if e["type"] == "budget"] == ["over"]


def test_a_verdict_said_before_a_worker_restart_is_not_said_again(tmp_path):
    kept = str(tmp_path / "baseline-0.json")
    first = Machine(FixedInterval(1), every_step=True, strategy="lowdiff", kept=kept).run(PROBE_STEPS + 80)
    assert len(first.said) == 1
    again = Machine(FixedInterval(1), every_step=True, strategy="lowdiff", kept=kept).run(80)
    assert again.said == [] and again.watch.said == {"over"}


def test_a_cheap_strategy_working_every_step_says_nothing():
    m = Machine(FixedInterval(1), every_step=True, strategy="lowdiff", cost=0.003).run(PROBE_STEPS + 80)
    assert m.said == [] and m.overheads()[-1] == pytest.approx(0.03)


def test_the_baseline_is_kept_for_a_restarted_worker_and_a_damaged_one_ignored(tmp_path):
    kept = tmp_path / "baseline-0.json"
    first = Baseline(Kept(str(kept)))
    for i, s in enumerate([0.5, 0.12, 0.1, 0.11, 0.3]):
        first.probed(s, last=i == 4)
    assert Baseline(Kept(str(kept))).step_s == pytest.approx(0.115)  # the first left out, then the extremes
    assert not Watch(BUDGET, Baseline(Kept(str(kept))), strategy="x", instead="y").start_probe(0), "probed again"
    for bad in ("{", '{"step_s": -1}', '{"step_s": "1"}', "[1]", '{"step_s": NaN}', '{"step_s": true}'):
        kept.write_text(bad)
        assert Baseline(Kept(str(kept))).step_s is None, bad


def test_a_restarted_worker_starts_at_the_interval_decided_before_it(tmp_path):
    """One rank: the interval the budget chose (every 4) is where a restarted worker starts, not
    every step again; an explicit --every, several ranks and a damaged file start as given."""
    kept = str(tmp_path / "baseline-0.json")
    first = Machine(WithinBudget(PersistBound(EveryStep())), kept=kept).run(PROBE_STEPS + 80)
    assert first.policy.every == 4
    again = Machine(WithinBudget(PersistBound(EveryStep())), kept=kept)
    assert again.policy.every == 4 and not again.watch.probe_until, "started over"
    assert again.run(40).policy.every == 4
    assert Machine(FixedInterval(1), kept=kept).policy.every == 1
    several = Machine(WithinBudget(PersistBound(EveryStep())), kept=kept, share=lambda step, ds: ds)
    assert several.policy.every == 1
    for bad in ('{"settings --every (unset: within --max-overhead)": {"every": 0}}',
                '{"settings --every (unset: within --max-overhead)": {"every": "4"}}',
                '{"settings --every (unset: within --max-overhead)": {"steps": 4}}'):
        Path(kept).write_text(bad)
        assert Machine(WithinBudget(PersistBound(EveryStep())), kept=kept).policy.every == 1, bad


def test_the_run_reports_its_overhead_since_the_probe_every_10_steps_and_at_the_end():
    m = Machine(WithinBudget(PersistBound(EveryStep()))).run(PROBE_STEPS + 31)
    reports = [e for e in m.events if e["type"] == "overhead"]
    assert [e["step"] for e in reports] == [PROBE_STEPS + 11, PROBE_STEPS + 21, PROBE_STEPS + 31]
    m.watch.report(m.step)
    total = m.retuner.measured()  # (the window's, for comparison: the run's counts the dense start too)
    assert m.overheads()[-1] > total.overhead > 0


def test_the_summary_shows_the_overhead_against_the_budget():
    state = MetricsState()
    state.apply({"type": "overhead", "rank": 0, "t": 1.0, "step": 7, "overhead": 0.028, "budget": 0.05})
    assert ("overhead", "2.8% of 5%") in summary_rows(state.summary())
    state.apply({"type": "budget", "rank": 0, "t": 2.0, "verdict": "over", "overhead": 0.09, "budget": 0.05})
    state.apply({"type": "overhead", "rank": 0, "t": 3.0, "step": 25, "overhead": 0.09, "budget": 0.05})
    assert ("overhead", "9.0% of 5% (over: see the warning)") in summary_rows(state.summary())
    state.apply({"type": "skipped", "rank": 0, "t": 4.0, "step": 30})
    assert ("overhead", "9.0% of 5%, 1 skipped: disk behind (over: see the warning)") in summary_rows(state.summary())


@pytest.mark.parametrize("text, fraction", [("5", 0.05), ("2.5%", 0.025), ("off", 0.0), ("0", 0.0)])
def test_max_overhead_values(text, fraction):
    assert parse_budget(text) == pytest.approx(fraction)


def test_a_bad_max_overhead_is_refused_in_one_line(tmp_path):
    with pytest.raises(UsageError, match="--max-overhead must be"):
        parse_budget("lots")
    proc = ckptrun(tmp_path, "--max-overhead", "150", EXAMPLE, *TINY)
    assert proc.returncode == 2 and "--max-overhead must be above 0 and below 100" in proc.stderr
    assert not (tmp_path / "ckpts").exists()


# ---- end to end ----------------------------------------------------------------------------


def _events(metrics: Path, kind: str) -> list[dict]:
    lines = (metrics / "worker-0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("type") == kind]


def test_by_default_a_run_thins_checkpoints_that_cost_more_than_the_budget(tmp_path):
    """The tiny example's checkpoint costs most of its 3 ms step: the run probes the step without
    checkpointing, raises the interval and says why; the summary shows the overhead."""
    proc = ok(ckptrun(tmp_path, "--max-overhead", "5", "--keep", "0", "--no-dashboard", "--metrics-dir", "metrics",
                      EXAMPLE, *TINY, "--steps", 30))
    # (the budget's bound, or CheckFreq's drain bound where persisting is the larger cost: a loaded
    # machine's disk; the choice between them is tested on simulated costs above)
    said = re.search(r"raised to .*(by --max-overhead 5\.0%|the CheckFreq bound)", proc.stderr)
    assert said, proc.stderr[-2000:]
    assert "overhead" in proc.stderr.split("summary:")[-1]
    steps = [m.step for m in Store(tmp_path / "ckpts").manifests()]
    assert steps[-1] == 30 and len(steps) < (30 - PROBE_STEPS) / 2, steps
    assert min(steps) > PROBE_STEPS, "a probe step was checkpointed"
    assert _events(tmp_path / "metrics", "overhead")


def test_an_explicit_every_1_checkpoints_every_step_and_says_what_it_costs(tmp_path):
    proc = ok(ckptrun(tmp_path, "--max-overhead", "5", "--every", "1", "--keep", "0", "--no-dashboard",
                      EXAMPLE, *TINY))
    assert [m.step for m in Store(tmp_path / "ckpts").manifests()] == list(range(1, STEPS + 1))
    assert "--every 1 costs" in proc.stderr and "of the step against --max-overhead 5.0%" in proc.stderr
    assert "stall only: no step ran without checkpointing" in proc.stderr


@pytest.mark.parametrize("strategy", ["checkfreq", "lowdiff"])
def test_a_run_that_probed_its_first_steps_resumes_bit_exact(strategy, tmp_path):
    """The strategy starts after the probe, as if the run began there (lowdiff: its chain's full
    checkpoint at the probe's last step); a worker killed 5 steps after it resumes to the same state."""
    steps = PROBE_STEPS + 8
    tiny = [str(steps) if TINY[i - 1] == "--steps" else a for i, a in enumerate(TINY)]
    args = [*tiny, "--save-at", steps, "--save-path"]
    flags = ["--strategy", strategy, "--max-overhead", "5", "--keep", "0", "--dir", "ckpts"]
    plain, managed = resumed_beside_plain(tmp_path, EXAMPLE, args, flags, f"kill:step={PROBE_STEPS + 5}")
    assert_training_state(load(managed / "resumed.pt"), load(plain / "truth.pt"))
    assert min(m.step for m in Store(managed / "ckpts").manifests()) >= PROBE_STEPS


def test_the_env_sets_the_default_budget_and_a_recipe_or_the_flag_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTRUN_MAX_OVERHEAD", "off")
    assert parse_budget("") == 0.0 and parse_budget("3") == pytest.approx(0.03)
    monkeypatch.delenv("CKPTRUN_MAX_OVERHEAD")
    assert parse_budget("") == pytest.approx(0.05)


def _hooks(*, free: list[int], auto: bool = True, world_size: int = 1, measured: bool = True) -> SimpleNamespace:
    """The little of a worker's StepHooks that `_disk_behind` reads: a run at step 8 with two slots."""
    pool = SimpleNamespace(cond=threading.Condition(), buffers={0: None, 1: None}, free=free, inflight=2 - len(free))
    events: list[dict] = []
    return SimpleNamespace(cfg=SimpleNamespace(max_overhead=BUDGET, interval_auto=auto), staging=SimpleNamespace(
        pool=pool), world_size=world_size, step=8, _skipped_at=None, events=events,
        metrics=SimpleNamespace(emit=lambda **e: events.append(e)),
        retuner=SimpleNamespace(watch=SimpleNamespace(measured=measured)))


def test_a_due_snapshot_that_finds_every_slot_still_being_written_is_skipped_not_waited_for():
    behind = _hooks(free=[])
    assert StepHooks._disk_behind(behind, 8) and StepHooks._disk_behind(behind, 8)
    assert [e["type"] for e in behind.events] == ["skipped"], "said once per step"
    assert not StepHooks._disk_behind(behind, 9), "a look-ahead (gockpt's) is never skipped"
    assert not StepHooks._disk_behind(_hooks(free=[1]), 8)
    assert StepHooks._disk_behind(_hooks(free=[1], measured=False), 8), "one at a time until a cost is measured"
    assert not StepHooks._disk_behind(_hooks(free=[0, 1], measured=False), 8)
    assert not StepHooks._disk_behind(_hooks(free=[], auto=False), 8), "an explicit --every is honoured"
    assert not StepHooks._disk_behind(_hooks(free=[], world_size=2), 8), "ranks must checkpoint the same steps"
