"""lowdiff in `ckptrun tune`: LowDiff's (F*, B*) (eq. (10), checked against a numeric
minimisation of eq. (8)) decide its settings, not an interval."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...tuning.durations import format_duration
from ...tuning.model import Inputs, Prediction, StrategyPlan, TuningModel
from ...tuning.profile import StrategyCosts
from .model import LowDiffCosts, continuous_optimum, diff_writes_keep_up, numeric_optimal_fb, optimal_fb, waste_fraction


@dataclass(frozen=True)
class LowDiffPlan:
    full_every: int  # F* from the closed form (eq. (10), integer neighbourhood)
    batch: int  # B*
    continuous: tuple[float, float]
    numeric: tuple[int, int]  # argmin of eq. (8) by search
    agrees: bool  # numeric and closed form predict the same waste
    diff_writes_keep_up: bool  # eq. (8) assumes one step's diff is written within a step
    recovery_s: float  # load + replay of half the records between full checkpoints (R_D + B·r each)
    prediction: Prediction


class LowDiffTuning(TuningModel):
    def evaluate(self, inputs: Inputs) -> LowDiffPlan:
        costs = inputs.costs
        c = LowDiffCosts(step_time=costs.step_s, full_ckpt_bytes=costs.ckpt_bytes, diff_bytes=costs.diff_bytes,
                         write_bandwidth=costs.write_Bps, full_load_time=costs.load_s,
                         diff_replay_time=costs.record_s, mtbf=inputs.mtbf_s, step_replay_time=costs.replay_s)
        f_c, b_c = continuous_optimum(c)
        f, b = optimal_fb(c)
        numeric = numeric_optimal_fb(c, f_max=4 * max(f, math.ceil(f_c)) + 10, b_max=4 * max(b, math.ceil(b_c)) + 10)
        w, w_num = waste_fraction(c, f, b), waste_fraction(c, *numeric)
        t = costs.step_s
        pred = Prediction(b * t, c.full_write_time / (f * t), b * t / 2, w)
        return LowDiffPlan(f, b, (f_c, b_c), numeric, math.isclose(w, w_num, rel_tol=1e-9), diff_writes_keep_up(c),
                           c.recovery_time(f, b), pred)

    def settle(self, sp: StrategyPlan, sc: StrategyCosts, inputs: Inputs, answer: LowDiffPlan) -> StrategyPlan:
        """Eq. (8) assumes the per-step diff capture is hidden; the measured stall of it is added."""
        per_step = sc.delta_s / inputs.costs.step_s
        pred = answer.prediction
        return replace(sp, settings={"full_every": answer.full_every, "batch": answer.batch},
                       rule="LowDiff eq. (10), plus its measured per-step diff stall",
                       prediction=replace(pred, overhead=pred.overhead + per_step, waste=pred.waste + per_step))

    def report(self, answer: LowDiffPlan) -> str:
        check = "agrees" if answer.agrees else "DISAGREES"
        pred = answer.prediction
        return (f"LowDiff eq. (10): F* {answer.full_every}, B* {answer.batch} (numeric argmin of eq. (8): "
                f"F {answer.numeric[0]}, B {answer.numeric[1]}, {check}); overhead {pred.overhead:.2%}, lost "
                f"{format_duration(pred.lost_work_s)}/failure, recovery {format_duration(answer.recovery_s)}, "
                f"waste {pred.waste:.2%}"
                + ("" if answer.diff_writes_keep_up else "; a step's diff takes longer to write than a step"))


MODEL = LowDiffTuning()
