"""`ckptrun tune`: measure a script's checkpoint costs and recommend a strategy and its settings.

`profile` runs the script briefly under the launcher and measures, `plan` turns the measurements
into settings and predictions with the formula modules, `report` prints the table and writes
the JSON and the recipe. docs/tuning.md explains the output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from .levels import FailureRates, Layout, LevelsPlan
from .plan import Plan, make_plan, tier_plan
from .profile import Profile, profile

__all__ = ["TuneResult", "choose_strategies", "tune"]


@dataclass(frozen=True)
class TuneResult:
    profile: Profile
    plan: Plan
    tiers: LevelsPlan  # the recommended strategy's tiers


def choose_strategies(text: str) -> list[str]:
    """`a,b` → [a, b] (all registered strategies when empty); UsageError naming the valid ones."""
    from ..strategies import REGISTRY

    names = [n.strip() for n in text.split(",") if n.strip()] or list(REGISTRY)
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise UsageError(f"unknown strategy {unknown[0]!r} in --strategies; choose from: {', '.join(REGISTRY)}")
    return list(dict.fromkeys(names))


def tune(script: str, args: list[str], *, strategies: list[str], profile_steps: int, rates: FailureRates,
         max_overhead: float, ckpt_dir: str, progress: Callable[[str], None], repeat_budget_s: float = 0.0,
         layout: Layout = Layout(), upload_Bps: float = 0.0, durable_every: int | None = None) -> TuneResult:
    """Profile `script` under each strategy, then plan (see the package docstring)."""
    if not Path(script).is_file():
        raise UsageError(f"script {script!r} not found; give the path of a Python training script")
    prof = profile(script, args, strategies, profile_steps, ckpt_dir, 1.0 / rates.total, progress, repeat_budget_s)
    plan = make_plan(prof, rates, max_overhead, layout)
    return TuneResult(prof, plan, tier_plan(prof, plan, layout, upload_Bps, durable_every))
