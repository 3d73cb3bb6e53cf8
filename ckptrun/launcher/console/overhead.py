"""--max-overhead as the console shows it: the worst rank's measured overhead against its budget."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from .rank_stats import RankStats


@dataclass(frozen=True)
class Budgeted:
    """What checkpointing costs the loop against --max-overhead (fractions)."""

    overhead: float
    budget: float
    over: bool  # a rank said its strategy cannot keep within it
    skipped: int = 0  # due snapshots skipped while the disk was behind (the most of any rank)


def budgeted(ranks: Collection[RankStats]) -> Budgeted | None:
    """The worst rank's latest overhead against its budget; None before one was measured."""
    measured = [rs for rs in ranks if rs.overhead is not None and rs.budget]
    if not measured:
        return None
    worst = max(measured, key=lambda rs: rs.overhead)
    return Budgeted(worst.overhead, worst.budget, any(rs.over_budget for rs in ranks),
                    max(rs.skipped for rs in ranks))
