"""pccheck's `--every auto`: the smallest interval f* = ceil(T_w / (N·q·t)) (pccheck.txt §3.4,
eq. (3)) that keeps the slowdown within q, from the measured write time T_w of a checkpoint
(from its first copied byte until durable, with up to N in flight) and step time t; re-tuned
online as §3.4 proposes (its "monitor and adapt" future work)."""

from __future__ import annotations

from ...tuning.durations import format_duration
from ..save_policy import IntervalPolicy, Measured
from .model import checkpoint_interval_steps


class ConcurrentInterval(IntervalPolicy):
    label = "--every auto (PCcheck f*)"

    def __init__(self, concurrency: int, max_slowdown: float) -> None:
        super().__init__(1)
        self.concurrency, self.max_slowdown = concurrency, max_slowdown

    def target(self, m: Measured) -> tuple[int, str, int] | None:
        if m.persist_s is None or m.step_s is None:
            return None
        f = checkpoint_interval_steps(m.persist_s, self.concurrency, self.max_slowdown, m.step_s)
        why = (f"f* = ceil(T_w / (N*q*t)) = {f} (T_w {format_duration(m.persist_s)}, N {self.concurrency}, "
               f"q {self.max_slowdown}, t {format_duration(m.step_s)})")
        return f, why, f
