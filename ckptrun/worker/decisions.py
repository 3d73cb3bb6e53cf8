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
import time
from collections import deque
from collections.abc import Callable
from statistics import median
from typing import Any, Protocol

from ..config import RunConfig
from ..log import log
from ..strategies.save_policy import Decision, IntervalPolicy, Measured, SavePolicy
from ..tuning.durations import format_duration
from ..tuning.intervals import checkfreq_min_interval_steps, daly_interval

DEFAULT_MTBF_S = 3600.0  # --every auto without --mtbf (documented in docs/tuning.md)
FIRST_EVAL = 3  # the first estimate is made this many steps after (re)start
EVAL_EVERY = 25  # later re-evaluations: at steps that are multiples of this
WINDOW_CKPTS = 4  # the estimate covers about this many checkpoints...
MIN_WINDOW = 20  # ...and at least this many steps
WRITES_KEPT = 8
LOG_CHANGES_EVERY_S = 60.0  # a policy's changes reach the log at most this often (all go to the metrics file)
MIN_DELTA_S = 1e-9  # a checkpoint that measured no stall at all still costs something

__all__ = ["DEFAULT_MTBF_S", "DalyInterval", "FixedInterval", "PersistBound", "Retuner", "for_runtime"]


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


class PersistBound(IntervalPolicy):
    """CheckFreq's bound over another interval policy: never checkpoint faster than the persist
    path drains (one checkpoint's persist time / step time)."""

    def __init__(self, inner: IntervalPolicy) -> None:
        super().__init__(inner.every)
        self.inner = inner

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


Share = Callable[[int, list[Decision | None]], list[Decision | None]]


class Retuner:
    """Measures once for every policy of a worker and re-decides them together at fixed steps.
    `share(step, decisions)` makes all ranks agree (every rank must checkpoint the same steps, so
    rank 0 decides); `on_change(step, policy, decision)` reports an adopted change."""

    def __init__(self, mtbf_s: float, *, mtbf_given: bool = True, share: Share | None = None,
                 on_change: Callable[[int, SavePolicy, Decision], None] | None = None) -> None:
        self.mtbf_s, self.mtbf_given = mtbf_s, mtbf_given
        self.policies: list[SavePolicy] = []
        self._share = share or (lambda step, decisions: decisions)
        self._on_change = on_change or (lambda step, policy, decision: None)
        self._steps: deque[tuple[float, float, bool, float]] = deque()  # (step_s, stall_s, checkpointed, optim_s)
        self._writes: deque[tuple[int, float]] = deque(maxlen=WRITES_KEPT)
        self._sizes: dict[str, int] = {}
        self._replay_step_s: float | None = None
        self._start: int | None = None

    def add(self, policy: SavePolicy) -> SavePolicy:
        self.policies.append(policy)
        return policy

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

    def observe_step(self, step_s: float, stall_s: float, checkpointed: bool, optim_s: float = 0.0) -> None:
        self._steps.append((step_s, stall_s, checkpointed, optim_s))
        every = max((p.settings.get("every", 1) for p in self.policies), default=1)
        while len(self._steps) > max(MIN_WINDOW, WINDOW_CKPTS * every):
            self._steps.popleft()

    def measured(self) -> Measured:
        records = list(self._steps)[1:]  # the first record may hold the script's setup
        ckpts = sum(c for _, _, c, _ in list(self._steps)[:-1])
        writes = list(self._writes)  # appended to by the engine-event thread
        return Measured(
            self.mtbf_s, self.mtbf_given,
            step_s=max(MIN_DELTA_S, median(s - st for s, st, _, _ in records)) if records else None,
            iter_s=median(s for s, _, _, _ in records) if records else None,
            optim_s=median(o for *_, o in records) if records and any(o for *_, o in records) else None,
            delta_s=max(MIN_DELTA_S, sum(st for _, st, _, _ in records) / ckpts) if ckpts and records else None,
            persist_s=median(w for _, w in writes) if writes else None,
            write_bw=median(n / w for n, w in writes) if writes else None,
            sizes=dict(self._sizes), replay_step_s=self._replay_step_s)

    # ---- decisions ---------------------------------------------------------------------
    def after_step(self, step: int, record: dict[str, Any]) -> None:
        """Fold in the step's metrics record; at evaluation steps, re-decide (all ranks together)."""
        if self._start is None:
            self._start = step - 1
        stall = sum((record.get("stall_s") or {}).values())
        self.observe_step(record["step_s"], stall, record.get("last_snapshot_step") == step,
                          record.get("optim_s") or 0.0)
        first = self._start + FIRST_EVAL
        if step != first and (step < first or step % EVAL_EVERY):
            return
        live = [p for p in self.policies if p.adjustable]
        if not live:
            return
        m = self.measured()
        decisions = self._share(step, [p.propose(m, step) for p in live])
        for policy, decision in zip(live, decisions, strict=True):
            if decision is not None and decision.settings != policy.settings:
                policy.adopt(decision)
                self._on_change(step, policy, decision)


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

    retuner = Retuner(rt.cfg.mtbf or DEFAULT_MTBF_S, mtbf_given=bool(rt.cfg.mtbf),
                      share=_store_share(rt) if rt.world_size > 1 else None, on_change=on_change)
    interval = PersistBound(DalyInterval()) if rt.cfg.every_auto else FixedInterval(rt.cfg.every)
    retuner.add(interval)
    return retuner, interval
