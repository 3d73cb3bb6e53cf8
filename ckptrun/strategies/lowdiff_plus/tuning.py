"""lowdiff+ in `ckptrun tune`: an in-memory checkpoint every step, the replica persisted every P
steps (`model.py`), instead of one interval; two tiers in the multi-level model."""

from __future__ import annotations

from dataclasses import replace

from ...tuning.levels import Level
from ...tuning.model import Inputs, Prediction, StrategyPlan, TuningModel
from ...tuning.profile import Costs, StrategyCosts
from .model import persist_every, waste

MIN_SHARE = 1e-6  # rates with no machine loss at all: persisted as rarely as one in a million failures asks


class LowDiffPlusTuning(TuningModel):
    def settle(self, sp: StrategyPlan, sc: StrategyCosts, inputs: Inputs, answer: None) -> StrategyPlan:
        costs, mtbf_s, rates = inputs.costs, inputs.mtbf_s, inputs.rates
        hw_share = max(MIN_SHARE, (rates.node + rates.job) / rates.total)  # the failures that lose the machine
        every, why = persist_every(sc.persist_s, costs.step_s, mtbf_s, hw_share)
        lost, wasted = waste(sc.delta_s, sc.persist_s, costs.step_s, every, mtbf_s, costs.load_s, hw_share)
        return replace(sp, settings={"persist_every": every},
                       rule=f"in memory every step; persisted every {every} steps: {why} (from the failure "
                            f"rates; --hw-failure-share {hw_share:.2g} at run time)",
                       prediction=Prediction(every * costs.step_s, sc.delta_s / costs.step_s, lost, wasted))

    def levels(self, sp: StrategyPlan, sc: StrategyCosts, costs: Costs) -> list[Level]:
        """Every step in the engine's memory (the replica; a process failure resumes from it),
        the replica written to --dir every P steps beside training."""
        every = sp.settings["persist_every"]
        return [Level("memory", "every step", sc.delta_s, 0.0, every=1),
                Level("disk", f"--persist-every {every}", sc.persist_s, sc.persist_s, costs.load_s, every=every)]


MODEL = LowDiffPlusTuning()
