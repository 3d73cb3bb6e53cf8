"""lowdiff+ in `ckptrun tune`: an in-memory checkpoint every step, the replica persisted every P
steps (`model.py`), instead of one interval."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ...tuning.plan import Prediction
from .model import HW_SHARE, persist_every, waste

if TYPE_CHECKING:
    from ...tuning.plan import ModelPlans, StrategyPlan
    from ...tuning.profile import Costs, StrategyCosts


def settle(sp: StrategyPlan, sc: StrategyCosts, costs: Costs, models: ModelPlans) -> StrategyPlan:
    every, why = persist_every(sc.persist_s, costs.step_s, models.mtbf_s)
    lost, wasted = waste(sc.delta_s, sc.persist_s, costs.step_s, every, models.mtbf_s, costs.load_s)
    return replace(sp, settings={"persist_every": every},
                   rule=f"in memory every step; persisted every {every} steps: {why} (assumed share of machine "
                        f"losses {HW_SHARE:.0%}: set --hw-failure-share at run time)",
                   prediction=Prediction(every * costs.step_s, sc.delta_s / costs.step_s, lost, wasted))
