"""`--every auto`: the checkpoint interval chosen online from measured costs (DESIGN §6).

The runtime asks `due(step)` and, after every step, reports what it measured there: the step's
time, its checkpoint stall, whether a checkpoint was captured; and each durable write's time.
The policy checkpoints every step until it has a first estimate (a few steps), then at fixed
steps re-evaluates Daly's interval for the measured blocking cost δ of one checkpoint and the
MTBF, floored by CheckFreq's bound (never checkpoint faster than the persist path drains). It
changes the interval only when the new one differs by more than `MIN_CHANGE` (measurement
noise must not make it flap), and logs every change with its reason: to stderr and as a
metrics event `{"type": "interval", "step", "every", "reason"}`.

Estimates, over the last few checkpoints (at least `MIN_WINDOW` steps):
- step time t: median of (step time − checkpoint stall), the first step after start excluded;
- δ: stall summed over the window / checkpoints taken in it, shifted by one step (a checkpoint
  captured at step k is handed over, and for `sync` written, during step k+1);
- persist time: median of the last few writes' durations.

Every rank must checkpoint the same steps (a record commits only when every rank wrote it), so
in a multi-rank run rank 0 decides and the others read its decision from the job's store at the
same step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median
from typing import TYPE_CHECKING, Any

from ..log import log
from ..tuning.durations import format_duration
from ..tuning.intervals import checkfreq_min_interval_steps, daly_interval

if TYPE_CHECKING:
    from .runtime import Runtime

DEFAULT_MTBF_S = 3600.0  # --every auto without --mtbf (documented in docs/tuning.md)
FIRST_EVAL = 3  # the first estimate is made this many steps after (re)start
EVAL_EVERY = 25  # later re-evaluations: at steps that are multiples of this
MIN_CHANGE = 0.2  # relative change of the interval below which it is kept
WINDOW_CKPTS = 4  # the estimate covers about this many checkpoints...
MIN_WINDOW = 20  # ...and at least this many steps
WRITES_KEPT = 8
MIN_DELTA_S = 1e-9  # a checkpoint that measured no stall at all still costs something

__all__ = ["DEFAULT_MTBF_S", "Decision", "Estimate", "IntervalPolicy", "for_runtime"]


@dataclass(frozen=True)
class Estimate:
    step_s: float  # compute time of one step, checkpoint stall excluded
    delta_s: float  # blocking cost of one checkpoint
    persist_s: float | None  # time to persist one checkpoint; None before the first write


@dataclass(frozen=True)
class Decision:
    every: int
    reason: str


class IntervalPolicy:
    """The online interval. `share(step, decision) -> decision` makes all ranks agree (rank 0's)."""

    def __init__(self, mtbf_s: float, *, mtbf_given: bool = True,
                 share: Callable[[int, Decision | None], Decision | None] | None = None,
                 on_change: Callable[[int, Decision], None] | None = None) -> None:
        self.mtbf_s, self.mtbf_given = mtbf_s, mtbf_given
        self.every = 1
        self._share = share or (lambda step, decision: decision)
        self._on_change = on_change or (lambda step, decision: None)
        self._steps: deque[tuple[float, float, bool]] = deque()  # (step_s, stall_s, checkpointed)
        self._writes: deque[float] = deque(maxlen=WRITES_KEPT)
        self._start: int | None = None

    def due(self, step: int) -> bool:
        return step % self.every == 0

    # ---- measurements ------------------------------------------------------------------
    def observe_write(self, write_s: float) -> None:
        """A checkpoint (this rank's part) became durable after `write_s` seconds of writing."""
        self._writes.append(write_s)

    def observe_step(self, step_s: float, stall_s: float, checkpointed: bool) -> None:
        self._steps.append((step_s, stall_s, checkpointed))
        while len(self._steps) > max(MIN_WINDOW, WINDOW_CKPTS * self.every):
            self._steps.popleft()

    def estimate(self) -> Estimate | None:
        """Current estimate, or None while the window holds no handed-over checkpoint."""
        records = list(self._steps)
        ckpts = sum(c for _, _, c in records[:-1])
        compute = [s - st for s, st, _ in records[1:]]  # the first record may hold the script's setup
        if not ckpts or not compute:
            return None
        delta = max(MIN_DELTA_S, sum(st for _, st, _ in records[1:]) / ckpts)
        writes = list(self._writes)  # appended to by the engine-event thread
        return Estimate(max(MIN_DELTA_S, median(compute)), delta, median(writes) if writes else None)

    # ---- decisions ---------------------------------------------------------------------
    def propose(self, step: int) -> Decision | None:
        """The interval the model wants now, if it should replace the current one."""
        est = self.estimate()
        if est is None:
            return None
        daly_s = daly_interval(est.delta_s, self.mtbf_s)
        daly_steps = max(1, round(daly_s / est.step_s))
        bound = checkfreq_min_interval_steps(est.persist_s, est.step_s) if est.persist_s else 1
        target = max(daly_steps, bound)
        if target == self.every:
            return None
        if self.every >= bound and abs(target - self.every) < MIN_CHANGE * self.every:
            return None
        mtbf = format_duration(self.mtbf_s) + ("" if self.mtbf_given else " (default; set --mtbf)")
        reason = (f"every {self.every} -> {target} steps at step {step}: Daly interval "
                  f"{format_duration(daly_s)} = {daly_steps} steps (checkpoint cost {format_duration(est.delta_s)}, "
                  f"step {format_duration(est.step_s)}, MTBF {mtbf})")
        if bound > daly_steps:
            reason += (f", raised to the CheckFreq bound of {bound} steps (persisting one checkpoint takes "
                       f"{format_duration(est.persist_s)})")
        return Decision(target, reason)

    def after_step(self, step: int, record: dict[str, Any]) -> None:
        """Fold in the step's metrics record; at evaluation steps, re-decide (all ranks together)."""
        if self._start is None:
            self._start = step - 1
        stall = sum((record.get("stall_s") or {}).values())
        self.observe_step(record["step_s"], stall, record.get("last_snapshot_step") == step)
        first = self._start + FIRST_EVAL
        if step != first and (step < first or step % EVAL_EVERY):
            return
        decision = self._share(step, self.propose(step))
        if decision is not None and decision.every != self.every:
            self.every = decision.every
            self._on_change(step, decision)


def _store_share(rt: Runtime) -> Callable[[int, Decision | None], Decision | None]:
    """Rank 0 publishes each evaluation's outcome; the other ranks wait for it at the same step."""
    from .jobstore import job_store

    kv = job_store(rt.restart_count, "every-auto")

    def share(step: int, decision: Decision | None) -> Decision | None:
        if rt.rank == 0:
            kv.set(str(step), f"{decision.every}\n{decision.reason}" if decision else "")
            return decision
        every, _, reason = kv.get(str(step)).decode().partition("\n")
        return Decision(int(every), reason) if every else None

    return share


def for_runtime(rt: Runtime) -> IntervalPolicy:
    """The policy of one worker: logs on rank 0, records every change in the metrics."""

    def on_change(step: int, decision: Decision) -> None:
        rt.metrics.emit(type="interval", step=step, every=decision.every, reason=decision.reason)
        if rt.rank == 0:
            log.info(f"--every auto: {decision.reason}")

    mtbf = rt.cfg.mtbf or DEFAULT_MTBF_S
    return IntervalPolicy(mtbf, mtbf_given=bool(rt.cfg.mtbf),
                          share=_store_share(rt) if rt.world_size > 1 else None, on_change=on_change)
