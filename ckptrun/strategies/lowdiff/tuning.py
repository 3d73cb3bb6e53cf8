"""lowdiff in `ckptrun tune`: LowDiff's (F*, B*) (eq. (10)) decide its settings, not an interval."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...tuning.plan import ModelPlans, StrategyPlan
    from ...tuning.profile import Costs, StrategyCosts


def settle(sp: StrategyPlan, sc: StrategyCosts, costs: Costs, models: ModelPlans) -> StrategyPlan:
    """Eq. (8) assumes the per-step diff capture is hidden; the measured stall of it is added."""
    per_step = sc.delta_s / costs.step_s
    pred = models.lowdiff.prediction
    return replace(sp, settings={"full_every": models.lowdiff.full_every, "batch": models.lowdiff.batch},
                   rule="LowDiff eq. (10), plus its measured per-step diff stall",
                   prediction=replace(pred, overhead=pred.overhead + per_step, waste=pred.waste + per_step))
