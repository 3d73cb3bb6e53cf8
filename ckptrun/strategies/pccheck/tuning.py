"""pccheck in `ckptrun tune`: its (N*, f*) for the overhead budget (pccheck.txt §3.4, `model.py`)
on the write times measured with N checkpoints in flight. Reported beside the table; its row
keeps the interval plan (its run options take f* and N* online, from its own measurements)."""

from __future__ import annotations

from dataclasses import dataclass

from ...tuning.durations import format_duration
from ...tuning.model import Inputs, Prediction, TuningModel, predict
from .model import configure


@dataclass(frozen=True)
class PCcheckPlan:
    concurrency: int  # N*
    interval_steps: int  # f*
    write_s: float  # T_w(N*)
    measured_n: list[int]  # the N for which a write time was measured
    delta_from: str  # whose measured blocking cost the prediction uses
    prediction: Prediction


class PCcheckTuning(TuningModel):
    def evaluate(self, inputs: Inputs) -> PCcheckPlan | str:
        """(N*, f*) and its prediction, with the measured δ of pccheck (else checkfreq's, else the
        least one measured); or why there is no setting."""
        costs, measured = inputs.costs, inputs.measured
        source = next((n for n in ("pccheck", "checkfreq") if n in measured), None) \
            or min(measured, key=lambda n: measured[n].delta_s)
        try:
            cfg = configure(costs.write_s_by_inflight, step_s=costs.step_s, ckpt_bytes=costs.ckpt_bytes,
                            storage_bytes=costs.free_bytes, max_slowdown=1 + inputs.budget)
        except ValueError as e:
            return str(e)
        pred = predict(cfg.interval_steps * costs.step_s, measured[source].delta_s, cfg.write_s, inputs.mtbf_s,
                       costs.load_s)
        return PCcheckPlan(cfg.concurrency, cfg.interval_steps, cfg.write_s, sorted(costs.write_s_by_inflight),
                           source, pred)

    def report(self, answer: PCcheckPlan | str) -> str:
        if isinstance(answer, str):
            return f"PCcheck §3.4: no setting ({answer})"
        pred = answer.prediction
        return (f"PCcheck §3.4: N* {answer.concurrency} in flight, f* every {answer.interval_steps} steps "
                f"(T_w {format_duration(answer.write_s)}, measured for N = {', '.join(map(str, answer.measured_n))}); "
                f"overhead {pred.overhead:.2%} with {answer.delta_from}'s δ, lost "
                f"{format_duration(pred.lost_work_s)}/failure, waste {pred.waste:.2%}")


MODEL = PCcheckTuning()
