"""gockpt in `ckptrun tune`: the spread k from the corrected stall model (gockpt.txt §4.2.3,
`model.py`) on the measured checkpoint and gradient sizes; the interval stays the one its
measured stall per checkpoint gives (§3.1's N* is Young's interval)."""

from __future__ import annotations

from dataclasses import replace

from ...tuning.model import Inputs, StrategyPlan, TuningModel
from ...tuning.profile import StrategyCosts
from . import MAX_AUTO_SPREAD
from .model import continuous_optimal_k, ratio_k


class GoCkptTuning(TuningModel):
    def settle(self, sp: StrategyPlan, sc: StrategyCosts, inputs: Inputs, answer: None) -> StrategyPlan:
        # The recipe gives --every: each spread ends at a multiple of it, so k is at most that.
        costs = inputs.costs
        k = min(MAX_AUTO_SPREAD, ratio_k(costs.ckpt_bytes, costs.diff_bytes),
                sp.settings.get("every", MAX_AUTO_SPREAD))
        k_c = continuous_optimal_k(costs.ckpt_bytes, costs.diff_bytes)
        return replace(sp, settings={**sp.settings, "spread": k},
                       rule=f"{sp.rule}; each checkpoint spread over {k} steps (k* = 1/r + 1/2 = {k_c:.1f}, r = "
                            f"gradient bytes / checkpoint bytes = {costs.diff_bytes / costs.ckpt_bytes:.2f}; at most "
                            f"{MAX_AUTO_SPREAD} and --every)")


MODEL = GoCkptTuning()
