"""Recommendations for `ckptrun tune`: measured costs in, settings and predictions out.

All the math lives in the formula modules (`intervals`, `lowdiff_model`, `pccheck_model`); this
module decides which formula answers which question and for which strategy:

- every profiled strategy: Young's and Daly's intervals for its measured blocking cost δ, the
  CheckFreq bound (never checkpoint faster than its persist path drains) and the overhead budget
  (δ / interval ≤ budget). Its `--every` is the largest of Daly's interval, the bound and the
  budget's minimum, and the reason names the one that decided.
- LowDiff's (F*, B*) (eq. (10), checked against a numeric minimisation of eq. (8)) and PCcheck's
  (N*, f*) (§3.4) for the overhead budget are computed from the shared measurements whether or
  not those strategies are registered; a registered strategy whose registry entry names a
  `tuning` function (lowdiff) takes its settings from it. Any other strategy gets the interval
  rows without change.

A strategy's cost δ is the larger of its measured stall and its slowdown against no
checkpointing when that is above the noise (`profile.Slowdown`): never negative, and a
slowdown within the noise never lowers it.

Predictions at each setting, per unit of run time (fractions) and per failure (seconds):
overhead = δ / interval; work lost per failure = interval/2 + the time a checkpoint takes to
become durable (a failure during it loses the previous interval too); wasted-time fraction =
`intervals.expected_waste` with restart cost = load time R_F + that durability lag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError
from ..strategies import REGISTRY
from ..strategies.lowdiff.model import (
    LowDiffCosts,
    continuous_optimum,
    diff_writes_keep_up,
    numeric_optimal_fb,
    optimal_fb,
    waste_fraction,
)
from ..strategies.pccheck.model import configure
from .durations import format_duration
from .intervals import (
    checkfreq_min_interval_steps,
    daly_interval,
    expected_lost_work_s,
    expected_waste,
    young_interval,
)
from .profile import Costs, Profile, StrategyCosts

__all__ = ["LowDiffPlan", "ModelPlans", "PCcheckPlan", "Plan", "Prediction", "StrategyPlan", "make_plan",
           "parse_percent", "settings_flags"]


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


@dataclass(frozen=True)
class PCcheckPlan:
    concurrency: int  # N*
    interval_steps: int  # f*
    write_s: float  # T_w(N*)
    measured_n: list[int]  # the N for which a write time was measured
    delta_from: str  # whose measured blocking cost the prediction uses
    prediction: Prediction


@dataclass(frozen=True)
class ModelPlans:
    """The papers' models evaluated on the measured costs, for any strategy's `settle` to use."""

    lowdiff: LowDiffPlan
    pccheck: PCcheckPlan | None
    mtbf_s: float


@dataclass(frozen=True)
class Plan:
    mtbf_s: float
    mtbf_source: str
    max_overhead: float
    strategies: list[StrategyPlan]
    lowdiff: LowDiffPlan
    pccheck: PCcheckPlan | None
    pccheck_note: str  # why there is no PCcheck plan, if there is none
    recommended: str
    reason: str


def parse_percent(text: str) -> float:
    """`5`, `5%`, `2.5` → a fraction (0.05); UsageError unless 0 < value < 100."""
    try:
        value = float(str(text).strip().removesuffix("%"))
    except ValueError:
        raise UsageError(f"--max-overhead must be a percentage such as 5 or 2.5% (got {text!r})") from None
    if not 0 < value < 100:
        raise UsageError(f"--max-overhead must be above 0 and below 100 percent (got {text!r})")
    return value / 100


def settings_flags(settings: dict[str, Any]) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items())


def _steps(seconds: float, step_s: float) -> int:
    return max(1, round(seconds / step_s))


def _predict(interval_s: float, delta_s: float, lag_s: float, mtbf_s: float, load_s: float) -> Prediction:
    return Prediction(interval_s, delta_s / interval_s, expected_lost_work_s(interval_s) + lag_s,
                      expected_waste(interval_s, delta_s, mtbf_s, restart_s=load_s + lag_s))


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
                        _predict(every * t, delta, sc.persist_s, mtbf_s, costs.load_s))


def _lowdiff_plan(costs: Costs, mtbf_s: float) -> LowDiffPlan:
    c = LowDiffCosts(step_time=costs.step_s, full_ckpt_bytes=costs.ckpt_bytes, diff_bytes=costs.diff_bytes,
                     write_bandwidth=costs.write_Bps, full_load_time=costs.load_s,
                     diff_replay_time=costs.record_s, mtbf=mtbf_s, step_replay_time=costs.replay_s)
    f_c, b_c = continuous_optimum(c)
    f, b = optimal_fb(c)
    numeric = numeric_optimal_fb(c, f_max=4 * max(f, math.ceil(f_c)) + 10, b_max=4 * max(b, math.ceil(b_c)) + 10)
    w, w_num = waste_fraction(c, f, b), waste_fraction(c, *numeric)
    t = costs.step_s
    pred = Prediction(b * t, c.full_write_time / (f * t), b * t / 2, w)
    return LowDiffPlan(f, b, (f_c, b_c), numeric, math.isclose(w, w_num, rel_tol=1e-9), diff_writes_keep_up(c),
                       c.recovery_time(f, b), pred)


def _pccheck_plan(costs: Costs, mtbf_s: float, budget: float,
                  measured: dict[str, StrategyCosts]) -> tuple[PCcheckPlan | None, str]:
    source = next((n for n in ("pccheck", "checkfreq") if n in measured), None) \
        or min(measured, key=lambda n: measured[n].delta_s)
    try:
        cfg = configure(costs.write_s_by_inflight, step_s=costs.step_s, ckpt_bytes=costs.ckpt_bytes,
                        storage_bytes=costs.free_bytes, max_slowdown=1 + budget)
    except ValueError as e:
        return None, str(e)
    pred = _predict(cfg.interval_steps * costs.step_s, measured[source].delta_s, cfg.write_s, mtbf_s, costs.load_s)
    return PCcheckPlan(cfg.concurrency, cfg.interval_steps, cfg.write_s, sorted(costs.write_s_by_inflight),
                       source, pred), ""


def _reason(best: StrategyPlan, others: list[StrategyPlan], budget: float, mtbf_s: float, fits: bool,
            measured: StrategyCosts | None = None) -> str:
    p = best.prediction
    runner_up = min(others, key=lambda s: s.prediction.waste, default=None)
    vs = f" (next: {runner_up.name} {runner_up.prediction.waste:.2%})" if runner_up else ""
    tail = "" if fits else "; no strategy meets the overhead budget, so this is the least wasteful one"
    if measured is not None and not measured.slowdown.resolved:
        tail += (f"; its slowdown against no checkpointing is within noise ({measured.slowdown.text()}), so its "
                 "cost is its measured stall")
    return (f"{best.name} {settings_flags(best.settings)}: lowest predicted waste {p.waste:.2%} of run time{vs}; "
            f"set by {best.rule}; overhead {p.overhead:.2%} (budget {budget:.2%}), about "
            f"{format_duration(p.lost_work_s)} of work lost per failure at MTBF {format_duration(mtbf_s)}{tail}")


def make_plan(profile: Profile, mtbf_s: float, mtbf_source: str, budget: float) -> Plan:
    """Settings and predictions for every profiled strategy, and the recommended one."""
    costs = profile.costs
    measured = {sc.name: sc for sc in profile.strategies}
    lowdiff = _lowdiff_plan(costs, mtbf_s)
    pccheck, pc_note = _pccheck_plan(costs, mtbf_s, budget, measured)
    models = ModelPlans(lowdiff, pccheck, mtbf_s)
    plans = []
    for sc in profile.strategies:
        sp = _interval_plan(sc, costs, mtbf_s, budget)
        entry = REGISTRY.get(sc.name)
        if entry is not None and entry.tuning:  # the strategy's own model decides its settings
            sp = entry.load_tuning()(sp, sc, costs, models)
        plans.append(sp)
    fitting = [p for p in plans if p.prediction.overhead <= budget]
    best = min(fitting or plans, key=lambda p: p.prediction.waste)
    reason = _reason(best, [p for p in plans if p is not best], budget, mtbf_s, bool(fitting), measured.get(best.name))
    return Plan(mtbf_s, mtbf_source, budget, plans, lowdiff, pccheck, pc_note, best.name, reason)
