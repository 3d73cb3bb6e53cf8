"""One step's time, as an engine sees the steps' snapshots arrive: how long a step may wait for
the copy of the step before it to leave for the partners (--replicas), so that the copies keep
up with training without ever holding it up by more than a step."""

from __future__ import annotations


class StepClock:
    """The snapshot times of the steps an engine holds, since its worker's Hello (`reset`)."""

    def __init__(self) -> None:
        self.last = 0.0  # the newest snapshot time seen (0: none since the reset)

    def reset(self) -> None:
        self.last = 0.0

    def since(self, now: float) -> float:
        """Seconds from the newest step before to this one, whose snapshot time is `now`; 0.0
        for the first since the reset, or a step without a time."""
        last, self.last = self.last, max(self.last, now)
        return now - last if last and now else 0.0
