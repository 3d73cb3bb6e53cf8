"""Classic checkpoint-interval formulas (Young, Daly, CheckFreq's drain bound) and the waste model.

These are the strategy-independent answers to "how often should I checkpoint?" that
`ckptrun tune` and `--every auto` print next to each strategy's own model (DESIGN §6).
All times are in one unit (seconds everywhere in ckptrun); the formulas themselves only need the
unit to be consistent.

Symbols: delta = blocking cost of one checkpoint (what the trainer loses per checkpoint),
mtbf = mean time between failures M, interval = compute time between two checkpoints.
"""

from __future__ import annotations

import math

# The MTBF every auto interval assumes without --mtbf (the run's re-tuner, the engine's drain to
# --durable, tune): here, below the worker and the engine both (docs/tuning.md).
DEFAULT_MTBF_S = 3600.0

__all__ = [
    "DEFAULT_MTBF_S",
    "check_positive",
    "young_interval",
    "daly_interval",
    "checkfreq_min_interval_steps",
    "tier_interval_steps",
    "expected_lost_work_s",
    "expected_waste",
]


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    """`value` as a float if it is a finite number > 0 (>= 0 with allow_zero); else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if v < 0 or (v == 0 and not allow_zero):
        need = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{name} must be {need}, got {value!r}")
    return v


def young_interval(delta: float, mtbf: float) -> float:
    """Young's optimal interval sqrt(2·delta·M): minimises delta/tau + tau/(2M) to first order."""
    d = check_positive("delta (checkpoint cost)", delta)
    m = check_positive("mtbf", mtbf)
    return math.sqrt(2.0 * d * m)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order interval; better than Young when delta is not small against M.

    tau = sqrt(2δM)·[1 + (1/3)·sqrt(δ/(2M)) + (1/9)·(δ/(2M))] − δ  for δ < 2M, else tau = M.
    """
    d = check_positive("delta (checkpoint cost)", delta)
    m = check_positive("mtbf", mtbf)
    if d >= 2.0 * m:
        return m
    x = d / (2.0 * m)
    return math.sqrt(2.0 * d * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - d


def checkfreq_min_interval_steps(persist_s: float, step_s: float) -> int:
    """Fewest steps between checkpoints so the persist path drains before the next one (>= 1).

    CheckFreq's bound: a checkpoint every k steps is sustainable only if persisting one takes no
    longer than k steps of training, so k >= ceil(persist / step).
    """
    p = check_positive("persist_s", persist_s)
    t = check_positive("step_s", step_s)
    # The tiny slack keeps 0.3/0.1 = 2.9999999999999996 -> 3 and 0.6/0.2 from becoming 4.
    return max(1, math.ceil(p / t - 1e-9))


def tier_interval_steps(cost_s: float, copy_s: float, step_s: float, mtbf_s: float) -> tuple[int, str]:
    """(steps, why) between copies to one tier: Daly's interval for a copy costing the run
    `cost_s` against the failures that resume from that tier (mean time between them `mtbf_s`),
    never more often than its copies of `copy_s` drain (CheckFreq's bound). A copy written beside
    training costs at most its duration: there cost_s = copy_s."""
    t = check_positive("step_s", step_s)
    cost = check_positive("cost_s", cost_s, allow_zero=True)
    daly = max(1, round(daly_interval(cost, mtbf_s) / t)) if cost else 1
    bound = checkfreq_min_interval_steps(copy_s, t) if check_positive("copy_s", copy_s, allow_zero=True) else 1
    if bound >= daly:
        return bound, f"as often as the copies drain: one takes {copy_s:.3f} s, a step {t:.3f} s"
    return daly, f"Daly's interval for a {cost:.3f} s copy and a {mtbf_s:.0f} s MTBF of its failures"


def expected_lost_work_s(interval_s: float) -> float:
    """Expected compute redone per failure: half an interval (failures uniform within it)."""
    return check_positive("interval_s", interval_s) / 2.0


def expected_waste(interval_s: float, delta: float, mtbf: float, restart_s: float = 0.0) -> float:
    """First-order fraction of time wasted: delta/interval + (interval/2 + restart)/mtbf.

    The first term is checkpoint overhead, the second the expected lost work plus restart cost
    per failure times the failure rate. Young's interval minimises it.
    """
    tau = check_positive("interval_s", interval_s)
    d = check_positive("delta (checkpoint cost)", delta)
    m = check_positive("mtbf", mtbf)
    r = check_positive("restart_s", restart_s, allow_zero=True)
    return d / tau + (expected_lost_work_s(tau) + r) / m
