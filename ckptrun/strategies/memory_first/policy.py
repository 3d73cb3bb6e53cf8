"""The memory tier's persistence interval P: the state the engine holds is written off the training path.
`auto` follows the waste model of `model.py` (hardware failures only lose what is not on disk)
from the re-tuner's measured write and step times, re-decided as they move."""

from __future__ import annotations

from ..save_policy import MIN_CHANGE, Decision, Measured, SavePolicy
from .model import HW_SHARE, persist_every

DEFAULT_P = 10  # until a write and a step are measured


class PersistInterval(SavePolicy):
    label = "--persist-every auto"

    def __init__(self, every: int | None = None, hw_share: float = HW_SHARE) -> None:
        """`every`: a fixed P (--persist-every N), or None for auto."""
        self.adjustable = every is None
        self.every = DEFAULT_P if every is None else every
        self.hw_share = hw_share

    @property
    def settings(self) -> dict[str, int]:
        return {"persist_every": self.every}

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def propose(self, measured: Measured, step: int) -> Decision | None:
        if not (measured.persist_s and measured.step_s):
            return None
        steps, why = persist_every(measured.persist_s, measured.step_s, measured.mtbf_s, self.hw_share)
        if steps == self.every or abs(steps - self.every) < MIN_CHANGE * self.every:
            return None
        return Decision({"persist_every": steps},
                        f"persist the state held in memory every {self.every} -> {steps} steps at step {step}: {why}")

    def adopt(self, decision: Decision) -> None:
        self.every = decision.settings["persist_every"]
