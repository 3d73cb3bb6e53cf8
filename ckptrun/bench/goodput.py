"""Goodput arithmetic of `ckptrun bench --failures`, from a run's event log alone.

The log is what the example script's timing file holds (every process that ran appends a
`start` line with the step it starts from, and a line per finished step, each with its wall
clock `t`) plus the kills the bench made. Definitions (pccheck.txt §5.2.3, lowdiff.txt Exp. 9):

- useful steps: the training progress that stands at the end of the budget: the highest step
  finished by the process running then; if the last kill left no process that got as far as its
  training loop, the step a restart would resume from (`resumable`, read from the checkpoint
  directory by the runner; 0 for `none`). A step redone after a rollback counts once.
- goodput: useful steps per second of the budget (launch to end, restarts included).
- steps lost by a failure: the highest step the killed process had reached (finished, or
  started from) less the step the next process resumed from: the work redone.
- recovery of a failure: the kill to the first step finished after it, when that comes before
  the next kill (a failure that hits a recovering run has no recovery of its own; it is counted
  in `interrupted`).
- effective training time ratio: goodput / the steps per second of `none` without failures.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

from ..errors import CkptrunError


@dataclass
class Timeline:
    """One run under failures: wall-clock times (s since the epoch) of its launch, its end, the
    kills, every process's start (t, step it starts from) and every finished step (t, step)."""

    launched: float
    end: float
    kills: list[float] = field(default_factory=list)
    starts: list[tuple[float, int]] = field(default_factory=list)
    steps: list[tuple[float, int]] = field(default_factory=list)
    restores: list[float] = field(default_factory=list)  # state restore (s) of each resumed process
    resumable: int = 0  # the newest step a restart would resume from, at the end

    def read_timing(self, path: Path) -> Timeline:
        """Add the starts and steps of the example script's timing file (lines cut short by a
        kill are skipped; no file: no process got as far as its training loop)."""
        try:
            lines = path.read_text().splitlines() if path.exists() else []
        except OSError as e:
            raise CkptrunError(f"the run left no readable timing file {path}: {e}") from None
        for line in lines:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == "start" and "t" in e:
                self.starts.append((float(e["t"]), int(e["start_step"])))
            elif e.get("event") == "step" and "t" in e:
                self.steps.append((float(e["t"]), int(e["step"])))
            elif e.get("event") == "recovery" and e.get("restore_s") is not None:  # the references' own
                self.restores.append(float(e["restore_s"]))
        self.starts.sort()
        self.steps.sort()
        return self


@dataclass
class Goodput:
    duration_s: float
    useful_steps: int
    goodput: float  # useful steps per second
    failures: int  # kills made within the budget
    kills_at: list[float]  # their times, s after launch
    lost_steps: list[int]  # per failure whose run resumed before the end
    recovery_s: list[float]  # per failure recovered before the next kill and the end
    interrupted: int  # failures that hit the run again before it finished a step
    restore_s: list[float]  # the state restore of each resumed process (the rest of a recovery is restart)

    @property
    def mean_lost(self) -> float | None:
        return fmean(self.lost_steps) if self.lost_steps else None

    @property
    def mean_recovery_s(self) -> float | None:
        return fmean(self.recovery_s) if self.recovery_s else None

    @property
    def mean_restore_s(self) -> float | None:
        return fmean(self.restore_s) if self.restore_s else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "mean_lost_steps": self.mean_lost, "mean_recovery_s": self.mean_recovery_s,
                "mean_restore_s": self.mean_restore_s}


def goodput(tl: Timeline) -> Goodput:
    """The figures of one run (see the module docstring)."""
    duration = tl.end - tl.launched
    if duration <= 0:
        raise ValueError(f"the run ends ({tl.end}) before it is launched ({tl.launched})")
    done = [(t, s) for t, s in tl.steps if t <= tl.end]
    kills = sorted(k for k in tl.kills if tl.launched <= k <= tl.end)
    lost, recovery, interrupted = [], [], 0
    for i, k in enumerate(kills):
        began, start_step = max(((t, s) for t, s in tl.starts if t <= k), default=(tl.launched, 0))
        reached = max((s for t, s in done if began < t <= k), default=start_step)
        resumed = next((s for t, s in tl.starts if t > k and t <= tl.end), None)
        if resumed is not None:
            lost.append(reached - resumed)
        until = kills[i + 1] if i + 1 < len(kills) else tl.end
        first = next((t for t, _ in done if k < t <= until), None)
        if first is not None:
            recovery.append(first - k)
        elif i + 1 < len(kills):
            interrupted += 1
    last = max(((t, s) for t, s in tl.starts if t <= tl.end), default=None)
    if last is not None and not any(k > last[0] for k in kills):
        useful = max((s for t, s in done if t > last[0]), default=last[1])
    else:
        useful = min(tl.resumable, max((s for _, s in done), default=0))
    return Goodput(duration, useful, useful / duration, len(kills), [k - tl.launched for k in kills], lost, recovery,
                   interrupted, list(tl.restores))

