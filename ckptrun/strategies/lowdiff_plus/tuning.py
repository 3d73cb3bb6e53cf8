"""lowdiff+ in `ckptrun tune`: an in-memory checkpoint every step, the replica persisted every P
steps (`model.py`), instead of one interval; two tiers in the multi-level model."""

from __future__ import annotations

from dataclasses import replace

from ...tuning.levels import Level
from ...tuning.model import Inputs, Prediction, StrategyPlan, TuningModel
from ...tuning.profile import Costs, StrategyCosts
from ..memory_first.model import persist_every, waste


class LowDiffPlusTuning(TuningModel):
    def settle(self, sp: StrategyPlan, sc: StrategyCosts, inputs: Inputs, answer: None) -> StrategyPlan:
        costs, mtbf_s, rates = inputs.costs, inputs.mtbf_s, inputs.rates
        hw_share = inputs.layout.memory_lost_share(rates)
        every, why = persist_every(sc.persist_s, costs.step_s, mtbf_s, hw_share)
        lost, wasted = waste(sc.delta_s, sc.persist_s, costs.step_s, every, mtbf_s, costs.load_s, hw_share)
        return replace(sp, settings={"persist_every": every},
                       rule=f"in memory every step; persisted every {every} steps: {why} (the failure rates' "
                            f"share; the run's --hw-failure-share auto takes it from the same flags)",
                       prediction=Prediction(every * costs.step_s, sc.delta_s / costs.step_s, lost, wasted))

    def levels(self, sp: StrategyPlan, sc: StrategyCosts, costs: Costs) -> list[Level]:
        """Every step in the engine's memory (the replica; a process failure resumes from it),
        the replica written to --dir every P steps beside training."""
        every = sp.settings["persist_every"]
        return [Level("memory", "every step", sc.delta_s, 0.0, every=1),
                Level("disk", f"--persist-every {every}", sc.persist_s, sc.persist_s, costs.load_s, every=every)]


MODEL = LowDiffPlusTuning()
