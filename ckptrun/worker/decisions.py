"""Save decisions: the run's own interval policies, and the one online re-tuner that feeds every
policy of a worker the same measurements (DESIGN §6).

The policy vocabulary (`SavePolicy`, `IntervalPolicy`, `Measured`, `Decision`) lives beside the
strategies (ckptrun/strategies/save_policy.py), which write their own in it. Policies compose:
`PersistBound(DalyInterval(...))` is `--every auto` (Daly's interval, never faster than the
persist path drains); a strategy adds its own (lowdiff's (F, B), pccheck's f*, gockpt's k)
through `StrategyContext.policy`.

Call order, driven by the runtime:
1. `Retuner.add(policy)` once per policy, before the first step;
2. `policy.due(step)` whenever the trainer decides whether `step` is checkpointed;
3. `Retuner.observe_snapshot(kind, nbytes)` for every submitted snapshot, `observe_write(nbytes,
   write_s)` for every durable write (engine-event thread), `after_step(step, record)` after
   every optimizer step with that step's metrics record;
4. at evaluation steps (`FIRST_EVAL` steps after a (re)start, then multiples of `EVAL_EVERY`),
   `after_step` estimates `Measured`, asks each policy to `propose`, makes all ranks agree on
   rank 0's decisions, and each policy `adopt`s its decision; every change is logged with its
   reason and recorded as a metrics event `{"type": "interval", "step", "reason", **settings}`.

Estimates, over the last few checkpoints (at least `MIN_WINDOW` steps):
- step time: median of (step time − checkpoint stall), the first step after start excluded;
- δ: stall summed over the window / checkpoints taken in it, shifted by one step (a checkpoint
  captured at step k is handed over, and for `sync` written, during step k+1);
- persist time and bandwidth: medians of the last few writes.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Callable
from statistics import median
from typing import Any, Protocol

from ..config import RunConfig
from ..log import log
from ..strategies import DEFAULT, REGISTRY
from ..strategies.save_policy import Decision, IntervalPolicy, Measured, SavePolicy
from ..tuning.durations import format_duration
from ..tuning.intervals import DEFAULT_MTBF_S, checkfreq_min_interval_steps, daly_interval
from .budget import Baseline, Watch, interval_within, percent, within
from .kept import Kept

FIRST_EVAL = 3  # the first estimate is made this many steps after (re)start
EVAL_EVERY = 25  # later re-evaluations: at steps that are multiples of this
WINDOW_CKPTS = 4  # the estimate covers about this many checkpoints...
MIN_WINDOW = 20  # ...and at least this many steps
WRITES_KEPT = 8
LOG_CHANGES_EVERY_S = 60.0  # a policy's changes reach the log at most this often (all go to the metrics file)
MIN_DELTA_S = 1e-9  # a checkpoint that measured no stall at all still costs something
RECHECK = 6  # after a change, the next evaluation comes this many steps (or 3 intervals) later

__all__ = ["DEFAULT_MTBF_S", "DalyInterval", "EveryStep", "FixedInterval", "PersistBound", "Retuner", "WithinBudget",
           "for_runtime"]


class FixedInterval(IntervalPolicy):
    """`--every N`: never re-tuned."""

    adjustable = False


class DalyInterval(IntervalPolicy):
    """Daly's optimum for the measured blocking cost δ of one checkpoint and the MTBF."""

    def target(self, m: Measured) -> tuple[int, str, int] | None:
        if m.delta_s is None or m.step_s is None:
            return None
        daly_s = daly_interval(m.delta_s, m.mtbf_s)
        steps = max(1, round(daly_s / m.step_s))
        return steps, (f"Daly interval {format_duration(daly_s)} = {steps} steps (checkpoint cost "
                       f"{format_duration(m.delta_s)}, step {format_duration(m.step_s)}, MTBF {m.mtbf_text})"), 1


class BoundOver(IntervalPolicy):
    """A bound over another interval policy (`inner`): its target, made coarser where the bound
    says; logged under the inner policy's label."""

    def __init__(self, inner: IntervalPolicy) -> None:
        super().__init__(inner.every)
        self.inner = inner
        self.label = inner.label


class PersistBound(BoundOver):
    """CheckFreq's bound over another interval policy: never checkpoint faster than the persist
    path drains (one checkpoint's persist time / step time)."""

    def target(self, m: Measured) -> tuple[int, str, int] | None:
        wanted = self.inner.target(m)
        if wanted is None:
            return None
        steps, why, floor = wanted
        if m.persist_s and m.step_s:
            bound = checkfreq_min_interval_steps(m.persist_s, m.step_s)
            if bound > steps:
                why += (f", raised to the CheckFreq bound of {bound} steps (persisting one checkpoint takes "
                        f"{format_duration(m.persist_s)})")
            steps, floor = max(steps, bound), max(floor, bound)
        return steps, why, floor


class EveryStep(IntervalPolicy):
    """--every left unset with the budget on: every step is the target; `WithinBudget` and
    `PersistBound` make it coarser where the measured costs call for it."""

    label = "--every (unset: within --max-overhead)"

    def target(self, m: Measured) -> tuple[int, str, int] | None:
        return 1, "every step (--every unset)", 1


class WithinBudget(BoundOver):
    """The overhead budget over another interval policy: never checkpoint so often that one
    checkpoint's measured cost (stall but back-pressure, plus the step's slowdown: budget.py)
    exceeds --max-overhead of the steps between two. At an interval already within budget the
    bound never lowers it unless the overhead is under half the budget (a cost measured at a
    sparse interval is lower than at a dense one: no see-saw) and not below 0 (steps faster than
    the no-checkpoint step: noise), and then to half of it at most per evaluation: a window's
    cost is a sum of noisy steps, and one that read low once took every 7 to every step on a
    simulated +-20% step, and one that read -1.1% took the wide model from every 10 to 5 (raising
    is never held back: that is the budget)."""

    def target(self, m: Measured) -> tuple[int, str, int] | None:
        wanted = self.inner.target(m)
        if m.budget is None or m.base_step_s is None:
            return wanted
        steps, why, floor = wanted or (self.every, f"every {self.every} steps", 1)
        if m.cost_s is None or m.overhead is None:  # nothing measured since the last change: nothing
            return max(steps, self.every), why, max(floor, self.every)  # says a finer one fits
        bound = interval_within(m.cost_s, m.base_step_s, m.budget)
        if within(m.overhead, m.budget) and (m.overhead > m.budget / 2 or m.overhead < 0):
            bound = max(bound, self.every)  # (below 0 the window's noise outweighs any cost: no reading)
        if bound > steps:
            why += (f", raised to {bound} steps by --max-overhead {percent(m.budget)}: one checkpoint costs "
                    f"{format_duration(m.cost_s)} of stall and slowdown against a "
                    f"{format_duration(m.base_step_s)} step without checkpointing (overhead now "
                    f"{percent(m.overhead)})")
        budget_sets = bound >= steps  # (the budget's reading sets the interval, not the inner policy's target)
        steps = max(steps, bound)
        if budget_sets and steps < self.every // 2:
            steps = self.every // 2
            why += f", lowered by half at most per evaluation (overhead now {percent(m.overhead)})"
        return steps, why, max(floor, bound)


Share = Callable[[int, list[Decision | None]], list[Decision | None]]


class Retuner:
    """Measures once for every policy of a worker and re-decides them together at fixed steps.
    `share(step, decisions)` makes all ranks agree (every rank must checkpoint the same steps, so
    rank 0 decides); `on_change(step, policy, decision)` reports an adopted change; `watch`, with
    --max-overhead, measures the no-checkpoint step and the overhead and says its verdicts."""

    def __init__(self, mtbf_s: float, *, mtbf_given: bool = True, share: Share | None = None,
                 on_change: Callable[[int, SavePolicy, Decision], None] | None = None,
                 watch: Watch | None = None) -> None:
        self.mtbf_s, self.mtbf_given = mtbf_s, mtbf_given
        self.policies: list[SavePolicy] = []
        self.watch = watch
        self.solo = share is None  # one rank: no other to agree with at an evaluation
        self._share = share or (lambda step, decisions: decisions)
        self._on_change = on_change or (lambda step, policy, decision: None)
        # (step_s, stall_s, checkpointed, optim_s, excluded_s): excluded from a checkpoint's cost,
        # back-pressure (the drain bound's to keep rare) and the staging slots' set-up (once a run)
        self._steps: deque[tuple[float, float, bool, float, float]] = deque()
        self._writes: deque[tuple[int, float]] = deque(maxlen=WRITES_KEPT)
        self._sizes: dict[str, int] = {}
        self._replay_step_s: float | None = None
        self._start: int | None = None
        self._recheck: int | None = None  # an evaluation step sooner than the next multiple of EVAL_EVERY
        self._checkpointed = False  # this worker has taken a checkpoint (the budget's window starts there)
        self._writes_seen = 0  # writes observed so far
        self._settling: int | None = None  # after a change: `_writes_seen` then (`_settled`)

    def add(self, policy: SavePolicy) -> SavePolicy:
        """Take part in the evaluations. With one rank, an adjustable policy starts at the
        settings its predecessor decided before a worker restart (`Kept`): a recovery does not
        start over at every step, paying the first checkpoints' cost again. (Several ranks start
        at their defaults and agree at the first evaluation: each rank's kept file is its own.)"""
        self.policies.append(policy)
        kept = self.watch.baseline.kept.settings(_kept_key(policy)) if self.watch and self.solo else None
        if kept is not None and policy.adjustable and kept.keys() == policy.settings.keys() \
                and kept != policy.settings:
            settings = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in kept.items())
            decision = Decision(kept, f"{settings}, as decided before the worker restarted")
            policy.adopt(decision)
            self._on_change(0, policy, decision)  # (before the worker's first step)
        return policy

    @property
    def probe_until(self) -> int:
        """The last step of a fresh run's probe of the no-checkpoint step (0: none)."""
        return self.watch.probe_until if self.watch else 0

    # ---- measurements ------------------------------------------------------------------
    def observe_snapshot(self, kind: str, nbytes: int) -> None:
        self._sizes[kind] = nbytes

    def observe_replay(self, steps: int, seconds: float) -> None:
        """The resume replayed `steps` recorded steps in `seconds` (reading, checking, applying)."""
        if steps > 0 and seconds > 0:
            self._replay_step_s = seconds / steps

    def observe_write(self, nbytes: int, write_s: float) -> None:
        """A checkpoint (this rank's part) became durable after `write_s` seconds of writing."""
        if write_s > 0:
            self._writes.append((nbytes, write_s))
        self._writes_seen += 1

    def observe_step(self, step_s: float, stall_s: float, checkpointed: bool, optim_s: float = 0.0,
                     excluded_s: float = 0.0) -> None:
        self._steps.append((step_s, stall_s, checkpointed, optim_s, excluded_s))
        every = max((p.settings.get("every", 1) for p in self.policies), default=1)
        while len(self._steps) > max(MIN_WINDOW, WINDOW_CKPTS * every):
            self._steps.popleft()

    def measured(self) -> Measured:
        steps = list(self._steps)
        records = steps[1:]  # the first record may hold the script's setup
        ckpts = sum(r[2] for r in steps[:-1])
        writes = list(self._writes)  # appended to by the engine-event thread
        base = self.watch.base_step_s(records) if self.watch else None
        cost = overhead = None
        if base and records:
            overhead = sum(r[0] for r in records) / len(records) / base - 1
            if ckpts:
                cost = max(0.0, sum(r[0] - base - r[4] for r in records) / ckpts)
        return Measured(
            self.mtbf_s, self.mtbf_given,
            step_s=max(MIN_DELTA_S, median(r[0] - r[1] for r in records)) if records else None,
            iter_s=median(r[0] for r in records) if records else None,
            optim_s=median(r[3] for r in records) if records and any(r[3] for r in records) else None,
            delta_s=max(MIN_DELTA_S, sum(r[1] for r in records) / ckpts) if ckpts and records else None,
            persist_s=median(w for _, w in writes) if writes else None,
            write_bw=median(n / w for n, w in writes) if writes else None,
            sizes=dict(self._sizes), replay_step_s=self._replay_step_s,
            budget=self.watch.budget if self.watch else None, base_step_s=base, cost_s=cost, overhead=overhead)

    # ---- decisions ---------------------------------------------------------------------
    def _cost_due(self, step: int, first: int) -> bool:
        """One rank under the budget, no checkpoint's cost measured yet, one written: evaluate
        at every step from `first` until one is (the first interval within the budget as soon as
        it can be known, not 3 intervals or 25 steps later). Ranks evaluate at the same steps, so
        a run of several waits for the regular ones."""
        return (self.solo and self.watch is not None and not self.watch.measured and step > first
                and bool(self._writes))

    def _settled(self, record: dict[str, Any], checkpointed: bool) -> bool:
        """After a change, the window starts once the checkpoints in flight then have ended (a
        write done, no slot in flight, or the next checkpoint): their slowdown is the old
        setting's, and in the new window it would be charged to the next checkpoint (a 1.7 GB
        write's tail once read as a 69 s checkpoint)."""
        if self._settling is None:
            return True
        if record.get("inflight") and not checkpointed and self._writes_seen == self._settling:
            return False
        self._settling = None
        return True

    def after_step(self, step: int, record: dict[str, Any]) -> None:
        """Fold in the step's metrics record; at evaluation steps, re-decide (all ranks together)."""
        if self._start is None:
            self._start = step - 1
        stalls = record.get("stall_s") or {}
        checkpointed = record.get("last_snapshot_step") == step
        if self.watch is not None and self.watch.observe(step, record, checkpointed):
            if step == self.probe_until:  # the probe is over: measure from here
                self._start = step
            self._steps.clear()  # a probe step, or the step itself changed: the window measured the old one
            if step <= self.probe_until:
                return
        if not self._settled(record, checkpointed):
            return
        if checkpointed and not self._checkpointed and self.watch is not None:
            # Nothing was written before: a slower step then (the slots' set-up thread) is no
            # checkpoint's cost. The window keeps one step before (a window's first is left out).
            self._checkpointed = True
            while len(self._steps) > 1:
                self._steps.popleft()
        self.observe_step(record["step_s"], sum(stalls.values()), checkpointed, record.get("optim_s") or 0.0,
                          (stalls.get("backpressure") or 0.0) + (stalls.get("setup") or 0.0))
        first = self._start + FIRST_EVAL
        if step != first and step != self._recheck and (step < first or step % EVAL_EVERY) \
                and not self._cost_due(step, first):
            return
        live = [p for p in self.policies if p.adjustable]
        if not live and self.watch is None:
            return
        m = self.measured()
        changed = False
        if live:
            decisions = self._share(step, [p.propose(m, step) for p in live])
            for policy, decision in zip(live, decisions, strict=True):
                if decision is not None and decision.settings != policy.settings:
                    policy.adopt(decision)
                    self._on_change(step, policy, decision)
                    if self.watch is not None:
                        self.watch.baseline.kept.set(_kept_key(policy), decision.settings)
                    changed = True
        if changed:  # what was measured at the old settings does not describe the new ones
            every = max((p.settings.get("every", 1) for p in self.policies), default=1)
            self._recheck = step + max(RECHECK, 3 * every)
            self._steps.clear()
            self._settling = self._writes_seen
        if self.watch is not None:
            self.watch.evaluate(step, m, changed)


def _kept_key(policy: SavePolicy) -> str:
    """Where a policy's decided settings are kept for a restarted worker (`Kept`)."""
    return f"settings {policy.label or type(policy).__name__}"


class Worker(Protocol):
    """What `for_runtime` reads of the worker's runtime."""

    cfg: RunConfig
    rank: int
    world_size: int
    restart_count: int
    metrics: Any  # a WorkerMetrics (its `emit`)


def _store_share(rt: Worker) -> Share:
    """Rank 0 publishes each evaluation's outcome; the other ranks wait for it at the same step."""
    from .jobstore import job_store

    kv = job_store(rt.restart_count, "decisions")

    def share(step: int, decisions: list[Decision | None]) -> list[Decision | None]:
        if rt.rank == 0:
            kv.set(str(step), json.dumps([d.to_json() if d else None for d in decisions]))
            return decisions
        return [Decision.from_json(d) if d else None for d in json.loads(kv.get(str(step)))]

    return share


def for_runtime(rt: Worker) -> tuple[Retuner, IntervalPolicy]:
    """A worker's re-tuner and its interval policy (`--every N` or `--every auto`): changes are
    logged on rank 0 and recorded in the metrics of every rank."""

    said: dict[int, float] = {}  # per policy: when its last change was logged

    def on_change(step: int, policy: SavePolicy, decision: Decision) -> None:
        rt.metrics.emit(type="interval", step=step, **decision.settings, reason=decision.reason)
        if rt.rank != 0:
            return
        now = time.monotonic()
        # Every change is in the metrics file; the log (a batch job's window) gets one a minute per policy.
        quiet = now - said.get(id(policy), -LOG_CHANGES_EVERY_S) < LOG_CHANGES_EVERY_S
        if not quiet:
            said[id(policy)] = now
        (log.debug if quiet else log.info)(f"{policy.label}: {decision.reason}" if policy.label else decision.reason)

    cfg = rt.cfg
    watch = _watch(rt) if cfg.max_overhead > 0 else None
    retuner = Retuner(cfg.mtbf or DEFAULT_MTBF_S, mtbf_given=bool(cfg.mtbf),
                      share=_store_share(rt) if rt.world_size > 1 else None, on_change=on_change, watch=watch)
    every_step = REGISTRY[cfg.strategy].load().every_step  # (the run's interval does not thin it)
    if cfg.every_auto:
        interval: IntervalPolicy = PersistBound(DalyInterval())
    elif watch is not None and not cfg.every_given and not every_step:
        interval = PersistBound(EveryStep())
    else:
        interval = FixedInterval(cfg.every)
    retuner.add(within_budget(rt, interval))
    return retuner, retuner.policies[-1]


def within_budget(rt: Worker, policy: IntervalPolicy) -> IntervalPolicy:
    """An adjustable interval policy, kept within --max-overhead when the budget is on."""
    return WithinBudget(policy) if rt.cfg.max_overhead > 0 and policy.adjustable else policy


def _watch(rt: Worker) -> Watch:
    """The budget's watch: rank 0 says its verdicts; every rank records them."""
    cfg = rt.cfg
    kept = os.path.join(cfg.engine_dir, f"baseline-{rt.rank}.json") if cfg.engine_dir else ""
    return Watch(cfg.max_overhead, Baseline(Kept(kept)), strategy=cfg.strategy, instead=DEFAULT,
                 every_step=REGISTRY[cfg.strategy].load().every_step,
                 explicit_every=cfg.every if cfg.every_given else None,
                 say=(lambda line, warn: (log.warning if warn else log.info)(line)) if rt.rank == 0
                 else (lambda line, warn: None),
                 emit=rt.metrics.emit)
