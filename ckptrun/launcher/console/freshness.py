"""How fresh each rank's last checkpoint is: its durable step (the newer of the run's commit and
the rank's own report), how long ago that became durable, and the work one failure would lose."""

from __future__ import annotations

from .commits import CommitLedger
from .rank_stats import RankStats


def durable(commits: CommitLedger, rs: RankStats) -> tuple[int | None, float | None]:
    """Last durable step of the rank `rs` and when it became durable.

    The newer of the global commit and what the rank itself reported.
    """
    candidates = [
        (s, t)
        for s, t in (
            (commits.committed_step, commits.committed_t),
            (rs.reported_durable_step, rs.reported_durable_t),
        )
        if s is not None
    ]
    if not candidates:
        return None, None
    best = max(s for s, _ in candidates)
    return best, min(t for s, t in candidates if s == best and t is not None)


def durable_age(commits: CommitLedger, rs: RankStats, now: float) -> float | None:
    """Seconds since the rank's last durable step became durable."""
    _, t = durable(commits, rs)
    return max(0.0, now - t) if t is not None else None


def at_risk(commits: CommitLedger, rs: RankStats, *, memory: bool = False) -> tuple[int | None, float | None]:
    """Work lost if the rank's machine died now: steps and seconds since its last durable
    step; with `memory`, if only its worker died (the engine's in-memory step is kept)."""
    if rs.step is None:
        return None, None
    step, _ = durable(commits, rs)
    if memory and rs.memory_step is not None and (step is None or rs.memory_step > step):
        step = rs.memory_step
    steps = max(0, rs.step - (step if step is not None else 0))
    if steps == 0:
        return 0, 0.0
    end = rs.last_step_t
    since = rs.step_t.get(step) if step is not None else rs.start_t
    if end is not None and since is not None:
        return steps, max(0.0, end - since)
    mean = rs.mean_step_s
    return steps, (steps * mean if mean is not None else None)
