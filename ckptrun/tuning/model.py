"""What a strategy's own tuning model sees and gives in `ckptrun tune`.

`plan` computes every profiled strategy's interval plan (Young, Daly, the CheckFreq bound, the
overhead budget); a strategy whose registry entry names a `TuningModel` (`Entry.tuning`) adds
its paper's model through the three calls below, so that the planner, the report and the JSON
learn every strategy, a plug-in's too, from the registry and name none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .intervals import expected_lost_work_s, expected_waste
from .levels import FailureRates, Layout, Level
from .profile import Costs, StrategyCosts

__all__ = ["Inputs", "Prediction", "StrategyPlan", "TuningModel", "predict", "settings_flags"]


def settings_flags(settings: dict[str, Any]) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items())


@dataclass(frozen=True)
class Prediction:
    interval_s: float  # training time between two durable points
    overhead: float  # fraction of training time spent blocked by checkpointing
    lost_work_s: float  # expected work redone per failure
    waste: float  # fraction of run time wasted: checkpoint overhead + failures (lost work + restart)


@dataclass(frozen=True)
class StrategyPlan:
    name: str
    delta_s: float
    persist_s: float
    young_s: float
    young_steps: int
    daly_s: float
    daly_steps: int
    checkfreq_min_steps: int
    budget_min_steps: int
    settings: dict[str, Any]  # run options, as in a recipe
    rule: str  # what decided the settings
    prediction: Prediction
    variant: str = ""  # a row of the strategy with other settings (its entry's `tuning_variants`)

    @property
    def row(self) -> str:
        """The row's name in the report: NAME, or NAME-VARIANT."""
        return f"{self.name}-{self.variant}" if self.variant else self.name


@dataclass(frozen=True)
class Inputs:
    """What tune measured and was given, as every model reads it."""

    costs: Costs
    measured: dict[str, StrategyCosts]  # by strategy: the profiled ones
    mtbf_s: float  # of all failures: 1 / rates.total
    budget: float  # the overhead budget, a fraction
    rates: FailureRates  # per kind of failure (levels.py)
    layout: Layout = Layout()  # where a lost node's state comes back from (--replicas, --node-local-dir)


def predict(interval_s: float, delta_s: float, lag_s: float, mtbf_s: float, load_s: float) -> Prediction:
    """Checkpointing every `interval_s` at a blocking cost `delta_s`, durable `lag_s` after its
    capture: overhead, work lost per failure (half an interval + the lag) and the wasted-time
    fraction (`intervals.expected_waste`, restart = load + lag)."""
    return Prediction(interval_s, delta_s / interval_s, expected_lost_work_s(interval_s) + lag_s,
                      expected_waste(interval_s, delta_s, mtbf_s, restart_s=load_s + lag_s))


class TuningModel:
    """A strategy's own model in `ckptrun tune` (its entry's `tuning`: "module:INSTANCE").

    Call order, once per tune: `evaluate` for every registered strategy that has a model,
    profiled or not (the answer is kept in the JSON's `plan.models` under the strategy's name,
    and `report` gives its line under the table); then `settle` for each profiled one, to turn
    its interval plan into its own settings; then `levels` for the recommended one, its tiers
    in the multi-level model (levels.py). The defaults answer nothing, keep the plan and give
    one tier.
    """

    def evaluate(self, inputs: Inputs) -> Any:
        """The model on the measured costs: a dataclass, a string saying why it has no answer,
        or None (nothing to say)."""
        return None

    def settle(self, sp: StrategyPlan, sc: StrategyCosts, inputs: Inputs, answer: Any) -> StrategyPlan:
        """This strategy's settings and prediction, from its interval plan `sp`, its measured
        costs `sc` and `answer` (what `evaluate` gave)."""
        return sp

    def report(self, answer: Any) -> str | None:
        """The report's line for `answer`, if any."""
        return None

    def levels(self, sp: StrategyPlan, sc: StrategyCosts, costs: Costs) -> list[Level]:
        """This strategy's own tiers at its settings, fastest first. By default one: its durable
        points (every `prediction.interval_s`, each costing the run overhead x interval) in
        --dir, a process failure resuming from there."""
        p = sp.prediction
        return [Level("disk", settings_flags(sp.settings), p.overhead * p.interval_s, sc.persist_s, costs.load_s,
                      every=max(1, round(p.interval_s / costs.step_s)))]
