"""lowdiff+ in `ckptrun tune`: an in-memory checkpoint every step, the replica persisted every P
steps (`model.py`), instead of one interval."""

from __future__ import annotations

from dataclasses import replace

from ...tuning.model import Inputs, Prediction, StrategyPlan, TuningModel
from ...tuning.profile import StrategyCosts
from .model import HW_SHARE, persist_every, waste


class LowDiffPlusTuning(TuningModel):
    def settle(self, sp: StrategyPlan, sc: StrategyCosts, inputs: Inputs, answer: None) -> StrategyPlan:
        costs, mtbf_s = inputs.costs, inputs.mtbf_s
        every, why = persist_every(sc.persist_s, costs.step_s, mtbf_s)
        lost, wasted = waste(sc.delta_s, sc.persist_s, costs.step_s, every, mtbf_s, costs.load_s)
        return replace(sp, settings={"persist_every": every},
                       rule=f"in memory every step; persisted every {every} steps: {why} (assumed share of machine "
                            f"losses {HW_SHARE:.0%}: set --hw-failure-share at run time)",
                       prediction=Prediction(every * costs.step_s, sc.delta_s / costs.step_s, lost, wasted))


MODEL = LowDiffPlusTuning()
