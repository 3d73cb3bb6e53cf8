"""Recommendations for `ckptrun tune`: measured costs in, settings and predictions out.

The interval math lives in `intervals`, each strategy's own model in its folder; this module
decides which answers which question:

- every profiled strategy: Young's and Daly's intervals for its measured blocking cost δ, the
  CheckFreq bound (never checkpoint faster than its persist path drains) and the overhead budget
  (δ / interval ≤ budget). Its `--every` is the largest of Daly's interval, the bound and the
  budget's minimum, and the reason names the one that decided.
- every registered strategy whose entry names a tuning model (`model.TuningModel`, e.g. a
  paper's optimum of its own settings): the model is evaluated on the shared measurements
  whether or not that strategy was profiled (its answer is reported), and a profiled one's
  settings come from it. Any other strategy gets the interval rows without change.

A strategy's cost δ is the larger of its measured stall and its slowdown against no
checkpointing when that is above the noise (`profile.Slowdown`): never negative, and a
slowdown within the noise never lowers it.

The recommended strategy's tiers (`tier_plan`): its own (its model's `levels`: one, its
durable points in --dir, unless it has more), the remote tier with `--upload-mbps` (an upload
of a full checkpoint at that bandwidth, beside training), each tier's interval and waste per
hour from the failure rates per kind (`levels.plan_levels`): the intervals the strategy's
settings fix are kept, the remote tier's is the model's unless `--durable-every N` is given.

Predictions at each setting, per unit of run time (fractions) and per failure (seconds):
overhead = δ / interval; work lost per failure = interval/2 + the time a checkpoint takes to
become durable (a failure during it loses the previous interval too); wasted-time fraction =
`intervals.expected_waste` with restart cost = load time R_F + that durability lag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ..errors import UsageError
from ..strategies import REGISTRY
from .durations import format_duration
from .intervals import checkfreq_min_interval_steps, daly_interval, young_interval
from .levels import FailureRates, Layout, Level, LevelsPlan, plan_levels
from .model import Inputs, StrategyPlan, TuningModel, predict, settings_flags
from .profile import Costs, Profile, StrategyCosts

__all__ = ["Plan", "make_plan", "parse_percent", "tier_plan"]


@dataclass(frozen=True)
class Plan:
    mtbf_s: float  # of all failures
    mtbf_source: str
    rates: FailureRates  # per kind of failure, per second
    max_overhead: float
    strategies: list[StrategyPlan]
    models: dict[str, Any]  # strategy -> its tuning model's answer (TuningModel.evaluate)
    notes: list[str]  # the models' lines for the report, in registry order
    recommended: str  # its row (StrategyPlan.row)
    reason: str

    def best(self) -> StrategyPlan:
        """The recommended row."""
        return next(s for s in self.strategies if s.row == self.recommended)


def parse_percent(text: str) -> float:
    """`5`, `5%`, `2.5` → a fraction (0.05); UsageError unless 0 < value < 100."""
    try:
        value = float(str(text).strip().removesuffix("%"))
    except ValueError:
        raise UsageError(f"--max-overhead must be a percentage such as 5 or 2.5% (got {text!r})") from None
    if not 0 < value < 100:
        raise UsageError(f"--max-overhead must be above 0 and below 100 percent (got {text!r})")
    return value / 100


def _steps(seconds: float, step_s: float) -> int:
    return max(1, round(seconds / step_s))


def _interval_plan(sc: StrategyCosts, costs: Costs, mtbf_s: float, budget: float) -> StrategyPlan:
    t, delta = costs.step_s, sc.delta_s
    young, daly = young_interval(delta, mtbf_s), daly_interval(delta, mtbf_s)
    daly_steps = _steps(daly, t)
    bound = checkfreq_min_interval_steps(sc.persist_s, t)
    budget_steps = max(1, math.ceil(delta / (budget * t) - 1e-9))
    every = max(daly_steps, bound, budget_steps)
    if every == daly_steps:
        rule = f"Daly's interval {format_duration(daly)} for δ {format_duration(delta)}"
    elif every == bound:
        rule = f"CheckFreq bound: persisting takes {format_duration(sc.persist_s)}, so at least {bound} steps"
    else:
        rule = f"overhead budget: δ {format_duration(delta)} needs at least {budget_steps} steps"
    return StrategyPlan(sc.name, delta, sc.persist_s, young, _steps(young, t), daly, daly_steps, bound,
                        budget_steps, {"every": every}, rule,
                        predict(every * t, delta, sc.persist_s, mtbf_s, costs.load_s))


def _reason(best: StrategyPlan, others: list[StrategyPlan], budget: float, mtbf_s: float, fits: bool,
            measured: StrategyCosts | None = None) -> str:
    p = best.prediction
    runner_up = min(others, key=lambda s: s.prediction.waste, default=None)
    vs = f" (next: {runner_up.row} {runner_up.prediction.waste:.2%})" if runner_up else ""
    tail = "" if fits else "; no strategy meets the overhead budget, so this is the least wasteful one"
    if measured is not None and not measured.slowdown.resolved:
        tail += (f"; its slowdown against no checkpointing is within noise ({measured.slowdown.text()}), so its "
                 "cost is its measured stall")
    return (f"{best.name} {settings_flags(best.settings)}: lowest predicted waste {p.waste:.2%} of run time{vs}; "
            f"set by {best.rule}; overhead {p.overhead:.2%} (budget {budget:.2%}), about "
            f"{format_duration(p.lost_work_s)} of work lost per failure at MTBF {format_duration(mtbf_s)}{tail}")


def make_plan(profile: Profile, rates: FailureRates, budget: float, layout: Layout = Layout()) -> Plan:
    """Settings and predictions for every profiled strategy against all failures (1 /
    rates.total), and the recommended one; `layout` says which failures a memory tier survives."""
    costs = profile.costs
    measured = {sc.name: sc for sc in profile.strategies}
    mtbf_s = 1.0 / rates.total
    inputs = Inputs(costs, measured, mtbf_s, budget, rates, layout)
    models: dict[str, TuningModel] = {name: entry.load_tuning() for name, entry in REGISTRY.items() if entry.tuning}
    answers = {name: model.evaluate(inputs) for name, model in models.items()}
    notes = [line for name, model in models.items() if (line := model.report(answers[name]))]
    plans = []
    for sc in profile.strategies:
        interval = _interval_plan(sc, costs, mtbf_s, budget)
        # the strategy's own model decides its settings
        plans.append(models[sc.name].settle(interval, sc, inputs, answers[sc.name]) if sc.name in models else interval)
        for suffix, model in REGISTRY[sc.name].load_tuning_variants().items():
            plans.append(model.settle(replace(interval, variant=suffix), sc, inputs, None))
    fitting = [p for p in plans if p.prediction.overhead <= budget]
    best = min(fitting or plans, key=lambda p: p.prediction.waste)
    reason = _reason(best, [p for p in plans if p is not best], budget, mtbf_s, bool(fitting), measured.get(best.name))
    return Plan(mtbf_s, rates.source, rates, budget, plans, answers, notes, best.row, reason)


def tier_plan(profile: Profile, plan: Plan, layout: Layout, upload_Bps: float, durable_every: int | None) -> LevelsPlan:
    """The recommended strategy's tiers (module docstring); the remote one only with `upload_Bps`."""
    costs = profile.costs
    best = plan.best()
    entry = REGISTRY[best.name]
    if best.variant:
        model = entry.load_tuning_variants()[best.variant]
    else:
        model = entry.load_tuning() if entry.tuning else TuningModel()
    levels = model.levels(best, next(s for s in profile.strategies if s.name == best.name), costs)
    if upload_Bps:
        up = max(costs.ckpt_bytes / upload_Bps, 1e-3)  # the download back is taken as long
        levels.append(Level("remote", "--durable-every", up, up, costs.load_s + up, every=durable_every))
    return plan_levels(levels, plan.rates, layout, costs.step_s)
