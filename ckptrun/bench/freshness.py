"""How fresh what a run saves is: at the end of each timed step s, the distance in steps from s
to the newest step held in host memory and to the newest step on disk.

- in memory: the newest step complete in the engine's host memory, from the worker's step
  records: `last_snapshot_done` (a snapshot finished in host memory) or `last_memory_step`
  (held there, a replica); a run none of whose timed records names either has no memory tier
  (None). A worker that has none yet counts from step 0.
- on disk: the newest durable (committed) step, the record's `last_durable_step`; for the
  references, the newest save on disk by the end of the step (its `save` event's `done_t`
  against the step's `t`). None yet: step 0 (a restart begins again).

Several ranks: a step is held only when every rank holds it, so the distance is the largest over
ranks. A restarted worker redoes steps; the first record of each (rank, step) is the one timed.
The means are the waste model's inputs (bench/waste.py): the steps a failure at the end of a
step loses when it resumes from memory or disk (a process failure) or from disk alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import fmean, median
from typing import Any


@dataclass(frozen=True)
class Freshness:
    memory_median: float | None = None
    memory_max: int | None = None
    disk_median: float | None = None
    disk_max: int | None = None
    restorable_mean: float | None = None  # to the newest step in memory or on disk
    disk_mean: float | None = None
    nothing_on_disk: bool = False

    @classmethod
    def of(cls, memory: list[int] | None, disk: list[int], restorable: list[int], last: int) -> Freshness:
        """From per-step distances (`memory` None: no memory tier); `last`: the last timed step."""
        if not disk:
            return cls()
        return cls(median(memory) if memory else None, max(memory) if memory else None, median(disk), max(disk),
                   fmean(restorable), fmean(disk), disk[-1] >= last)


def worker_freshness(records: list[dict[str, Any]], first: int, last: int) -> Freshness:
    """The freshness of steps first..last from a ckptrun run's worker metrics events (others ignored)."""
    held: dict[tuple[int, int], tuple[int | None, int]] = {}
    for e in records:
        if e.get("type") != "step" or not first <= e["step"] <= last:
            continue
        key = (e.get("rank", 0), e["step"])
        if key not in held:
            marks = [e[k] for k in ("last_snapshot_done", "last_memory_step") if e.get(k) is not None]
            held[key] = (max(marks) if marks else None, e.get("last_durable_step") or 0)
    steps = sorted({s for _, s in held})
    has_memory = any(m is not None for m, _ in held.values())
    memory, disk, restorable = [], [], []
    for s in steps:
        ranks = [v for (_, step), v in held.items() if step == s]
        disk.append(max(s - d for _, d in ranks))
        restorable.append(max(s - max(m or 0, d) for m, d in ranks))
        memory.append(max(s - (m or 0) for m, _ in ranks))
    return Freshness.of(memory if has_memory else None, [max(0, d) for d in disk], [max(0, r) for r in restorable],
                        steps[-1] if steps else 0)


def saves_freshness(steps: list[dict[str, Any]], saves: list[dict[str, Any]]) -> Freshness:
    """The freshness on disk of a script's own saves: its timed `step` events (step, t) against
    its `save` events (step, done_t); no memory tier."""
    done = sorted((s["done_t"], s["step"]) for s in saves if s.get("done_t") is not None)
    disk = []
    for e in steps:
        newest = max((step for t, step in done if t <= e["t"]), default=0)
        disk.append(max(0, e["step"] - newest))
    return Freshness.of(None, disk, disk, steps[-1]["step"] if steps else 0)
