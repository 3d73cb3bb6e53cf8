"""lowdiff+'s persistence interval P: the replica is written by the engine, off the training path,
so a write costs the trainer (almost) nothing and P only trades disk bandwidth against the work a
machine loss costs (P/2 steps on average). `auto` writes as often as the disk drains one
replica (CheckFreq's bound): the smallest P whose writes never queue (paper Exp. 4, LowDiff+(P))."""

from __future__ import annotations

from ...errors import UsageError
from ...tuning.intervals import checkfreq_min_interval_steps
from ...worker.decisions import MIN_CHANGE, Decision, Measured, SavePolicy

DEFAULT_P = 10  # until a write and a step are measured


class PersistInterval(SavePolicy):
    label = "--persist-every auto"

    def __init__(self, value: str | int = "auto") -> None:
        self.adjustable = value == "auto"
        self.every = DEFAULT_P if self.adjustable else int(value)
        if self.every < 1:
            raise UsageError("--persist-every must be at least 1 (or auto)")

    @property
    def settings(self) -> dict[str, int]:
        return {"persist_every": self.every}

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def propose(self, measured: Measured, step: int) -> Decision | None:
        if not (measured.persist_s and measured.step_s):
            return None
        steps = checkfreq_min_interval_steps(measured.persist_s, measured.step_s)
        if steps == self.every or (steps < self.every and self.every - steps < MIN_CHANGE * self.every):
            return None
        return Decision({"persist_every": steps},
                        f"persist the replica every {self.every} -> {steps} steps at step {step}: writing it takes "
                        f"{measured.persist_s:.3f} s, a step {measured.step_s:.3f} s (as often as the disk drains)")

    def adopt(self, decision: Decision) -> None:
        self.every = decision.settings["persist_every"]
