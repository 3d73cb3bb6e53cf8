"""The run's figures as the console shows them: the job-level numbers of a progress line or the
dashboard's header (:class:`Overview`), and the exit summary's totals (:class:`RunSummary`)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from .commits import CommitLedger
from .freshness import durable, durable_age
from .overhead import Budgeted, budgeted
from .rank_stats import RankStats


@dataclass(frozen=True)
class Overview:
    """Job-level numbers for one log line or the dashboard header."""

    step: int | None  # slowest rank's step
    steps_per_s: float | None  # mean over ranks
    stall_mean_s: float | None  # mean over ranks of the mean stall per step
    stall_p99_s: float | None  # worst rank's p99
    durable_step: int | None  # lowest durable step over ranks
    durable_age_s: float | None
    memory_step: int | None  # lowest step held in the engines' memory over ranks (None: no replica)
    bw_mbps: float | None  # sum of each rank's latest write bandwidth (ranks write concurrently)
    restarts: int
    save_errors: int
    overhead: Budgeted | None = None  # --max-overhead: the worst rank's latest measure


@dataclass(frozen=True)
class RunSummary:
    """Totals for the exit summary."""

    steps: int | None  # highest step reached
    steps_executed: int  # step events of the busiest rank, including steps redone after restarts
    wall_s: float | None
    step_time_s: float  # summed over ranks
    stall_s_per_rank: float  # mean over ranks of the total stall
    stall_share: float | None  # total stall / total step time
    stall_by_cause_s: dict[str, float]  # mean over ranks
    checkpoints_committed: int
    bytes_committed: int
    bytes_written: int
    mean_bw_mbps: float | None  # bytes written / time spent writing (per writer)
    commit_lag_mean_s: float | None
    commit_lag_max_s: float | None
    restarts: int
    recovery_s: list[float]  # per restart, slowest rank
    save_errors: int
    last_durable_step: int | None
    last_memory_step: int | None = None  # lowest over ranks of the step their engines hold in memory
    overhead: Budgeted | None = None  # --max-overhead: the worst rank's latest measure


def overview(ranks: dict[int, RankStats], commits: CommitLedger, now: float, *, restarts: int) -> Overview:
    """Job-level numbers (slowest rank for progress, worst rank for tails)."""
    stepping = [r for r, rs in sorted(ranks.items()) if rs.step is not None]
    stats = [ranks[r] for r in stepping]
    rates = [rs.steps_per_s for rs in stats if rs.steps_per_s is not None]
    means = [rs.stall_total.mean for rs in stats if rs.stall_total.mean is not None]
    p99s = [rs.stall_total.p99 for rs in stats if rs.stall_total.p99 is not None]
    bws = [rs.bw_last_mbps for rs in ranks.values() if rs.bw_last_mbps is not None]
    durable_step, durable_age_s = None, None
    memory = [rs.memory_step for rs in stats if rs.memory_step is not None]
    durables = [(durable(commits, ranks[r])[0], r) for r in stepping]
    if durables and all(d is not None for d, _ in durables):
        durable_step, worst = min(durables)
        durable_age_s = durable_age(commits, ranks[worst], now)
    elif not stepping and commits.committed_step is not None and commits.committed_t is not None:
        durable_step, durable_age_s = commits.committed_step, max(0.0, now - commits.committed_t)
    # A step's metrics line can reach the feed after its commit: a step committed (or in the engine's
    # memory) on every rank has been reached, whatever the step lines say so far.
    memory_step = min(memory) if stepping and len(memory) == len(stepping) else None
    seen = min((rs.step for rs in stats if rs.step is not None), default=None)
    step = None if seen is None else max(s for s in (seen, durable_step, memory_step) if s is not None)
    return Overview(
        step=step,
        steps_per_s=sum(rates) / len(rates) if rates else None,
        stall_mean_s=sum(means) / len(means) if means else None,
        stall_p99_s=max(p99s) if p99s else None,
        durable_step=durable_step,
        durable_age_s=durable_age_s,
        memory_step=memory_step,
        bw_mbps=sum(bws) if bws else None,
        restarts=restarts,
        save_errors=sum(rs.save_errors for rs in ranks.values()),
        overhead=budgeted(ranks.values()),
    )


def summary(ranks: Collection[RankStats], commits: CommitLedger, *, restarts: int, recovery_s: list[float],
            wall_s: float | None, bytes_written: int, write_s: float) -> RunSummary:
    """Totals for the end of the run (`recovery_s`: per restart, the slowest rank's; `write_s`:
    the time all writes took)."""
    stepping = [rs for rs in ranks if rs.steps_seen]
    step_time = sum(rs.step_s_total for rs in stepping)
    stall_total = sum(rs.stall_total.total for rs in stepping)
    causes: dict[str, float] = {}
    for rs in stepping:
        for cause in rs.stall_causes:
            series = rs.stall.get(cause)
            causes[cause] = causes.get(cause, 0.0) + (series.total if series else 0.0)
    n = len(stepping)
    return RunSummary(
        steps=max((rs.max_step for rs in ranks if rs.max_step is not None), default=None),
        steps_executed=max((rs.steps_seen for rs in ranks), default=0),
        wall_s=wall_s,
        step_time_s=step_time,
        stall_s_per_rank=stall_total / n if n else 0.0,
        stall_share=stall_total / step_time if step_time > 0 else None,
        stall_by_cause_s={c: v / n for c, v in causes.items()} if n else {},
        checkpoints_committed=commits.checkpoints_committed,
        bytes_committed=commits.bytes_committed,
        bytes_written=bytes_written,
        mean_bw_mbps=bytes_written / write_s / 1e6 if write_s > 0 else None,
        commit_lag_mean_s=commits.commit_lag.mean,
        commit_lag_max_s=commits.commit_lag.max,
        restarts=restarts,
        recovery_s=recovery_s,
        save_errors=sum(rs.save_errors for rs in ranks),
        last_durable_step=commits.committed_step,
        last_memory_step=min((rs.memory_step for rs in ranks if rs.memory_step is not None), default=None),
        overhead=budgeted(ranks),
    )
