"""LowDiff's wasted-time model (lowdiff.txt §V-C, eq. (8)) and its optimum (F*, B*) (eq. (10)).

LowDiff writes a full checkpoint every F steps and, in between, one differential record (the
gradients of B steps, batched in host memory) every B steps. A failure loses the steps since
the last durable record and costs a full-checkpoint load plus a replay of the records written
since that full checkpoint. Large F: long replays; small F: many expensive full writes.
Large B: more lost steps; small B: more records to open. Eq. (8) prices both trade-offs.

Correction to eq. (8): the paper prices the replay of a batched record of B steps as one R_D,
whatever B. That holds for its merged (summed) diffs; exact replay (DESIGN invariant 1: Adam's
update is not linear in the gradient, so B steps are B optimizer updates) costs R_D + B·r for a
record, with R_D the per-record part (open, index, validate) and r one step's replay (read its
diff + one optimizer update). Ignoring r under-counts replay B-fold and picks F in the
thousands. `step_replay_time` = r; r = 0 is the paper's model, whose closed form eq. (10) stays
(`continuous_optimum`). With r > 0 the stationary point is the root of a quartic (no printed
closed form): found by bisection, checked against `numeric_optimal_fb` in the tests.

Units: every time (step time, load/replay times, MTBF, horizon) is in one unit, seconds in
ckptrun, and the bandwidth is bytes per that unit. F and B are always counted in steps, so the
optimum in steps does not depend on the unit chosen (the paper's version does; see
`paper_eq10`). Human-readable messages (`retune`) print times as seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckptrun.tuning.durations import format_duration
from ckptrun.tuning.intervals import check_positive

__all__ = [
    "LowDiffCosts",
    "wasted_time",
    "waste_fraction",
    "paper_eq10",
    "continuous_optimum",
    "optimal_fb",
    "numeric_optimal_fb",
    "retune",
    "diff_writes_keep_up",
]


@dataclass(frozen=True)
class LowDiffCosts:
    """Measured inputs of eq. (8) (paper symbol in brackets), one time unit throughout.

    step_time         [t]   duration of one training iteration
    full_ckpt_bytes   [S]   size of one full checkpoint (parameters + optimizer state)
    diff_bytes              size of one step's differential (the compressed gradient); eq. (8)
                            ignores it because LowDiff overlaps diff writes with training
                            (§IV-B); see `diff_writes_keep_up`
    write_bandwidth   [W]   bytes per time unit to storage
    full_load_time    [R_F] time to load the latest full checkpoint on recovery
    diff_replay_time  [R_D] the part of a differential record's replay that does not grow with
                            its length (open, index, validate); in the paper the whole replay of
                            a record, however many steps it batches
    mtbf              [M]   mean time between failures
    num_gpus          [N]   GPUs that all lose the same time (scales T_w, not the optimum)
    step_replay_time  [r]   replay of one recorded step: read its diff + one optimizer update
                            (0: the paper's model; see the module docstring)
    """

    step_time: float
    full_ckpt_bytes: float
    diff_bytes: float
    write_bandwidth: float
    full_load_time: float
    diff_replay_time: float
    mtbf: float
    num_gpus: int = 1
    step_replay_time: float = 0.0

    def __post_init__(self) -> None:
        for name in ("step_time", "full_ckpt_bytes", "diff_bytes", "write_bandwidth",
                     "diff_replay_time", "mtbf"):
            check_positive(name, getattr(self, name))
        check_positive("full_load_time", self.full_load_time, allow_zero=True)
        check_positive("step_replay_time", self.step_replay_time, allow_zero=True)
        if isinstance(self.num_gpus, bool) or not isinstance(self.num_gpus, int) or self.num_gpus < 1:
            raise ValueError(f"num_gpus must be an integer >= 1, got {self.num_gpus!r}")

    @property
    def full_write_time(self) -> float:
        """S/W: time one full checkpoint blocks training (the paper's steady-state cost)."""
        return self.full_ckpt_bytes / self.write_bandwidth

    def replay_time(self, f: float, b: float) -> float:
        """Expected replay per failure: (F/B − 1)/2 records of R_D + B·r each."""
        return (self.diff_replay_time + b * self.step_replay_time) / 2 * (f / b - 1)

    def recovery_time(self, f: float, b: float) -> float:
        """Expected state restore per failure: the full checkpoint's load plus `replay_time`."""
        return self.full_load_time + self.replay_time(f, b)


def _check_fb(f: float, b: float) -> tuple[float, float]:
    ff = check_positive("f (full-checkpoint interval, steps)", f)
    bb = check_positive("b (batching size, steps)", b)
    if bb < 1 or ff < 1:
        raise ValueError(f"f and b are counts of steps and must be >= 1, got f={f!r}, b={b!r}")
    if bb > ff:
        raise ValueError(f"the batching size b={b!r} cannot exceed the full-checkpoint interval f={f!r}")
    return ff, bb


def wasted_time(costs: LowDiffCosts, f: float, b: float, horizon_s: float) -> float:
    """GPU time wasted over a run of `horizon_s` (eq. (8)), with f = F and b = B in steps.

    T_w = N·(T/M)·[B·t/2 + R_F + ((R_D + B·r)/2)·(F/B − 1)] + N·(T/(F·t))·(S/W)

    (r, one step's replay, is the correction of the module docstring; r = 0 is eq. (8).)

    Correction to eq. (8): the paper calls f the "full checkpoint frequency" and uses it as an
    interval in iterations (Table I: FCF = 10..100), and b as a batching size in iterations, yet
    eq. (8) counts f·T full checkpoints and adds b/2 to the load time R_F. Both only make sense
    if f is a rate per unit time and b a duration: f = 1/(F·t) and b = B·t. Written in steps,
    F/B batched records lie between full checkpoints, half of them (minus one) are replayed on
    average, B·t/2 of work is lost, and T/(F·t) full checkpoints are written: the formula above.
    """
    F, B = _check_fb(f, b)
    T = check_positive("horizon_s", horizon_s)
    c = costs
    per_failure = B * c.step_time / 2 + c.recovery_time(F, B)
    steady = T / (F * c.step_time) * c.full_write_time
    return c.num_gpus * (T / c.mtbf * per_failure + steady)


def waste_fraction(costs: LowDiffCosts, f: float, b: float) -> float:
    """Wasted time per unit of run time per GPU, T_w/(N·T); independent of the horizon."""
    return wasted_time(costs, f, b, 1.0) / costs.num_gpus


def paper_eq10(costs: LowDiffCosts) -> tuple[float, float]:
    """Eq. (10) exactly as printed: f* = cbrt(R_D·W²/(4·S²·M²)), b* = cbrt(2·S·R_D·M/W).

    These are in the units eq. (8) really uses (f* per time unit, b* a duration), so they change
    with the time unit. Kept for comparison; use `continuous_optimum` / `optimal_fb` for steps.
    """
    c = costs
    S, W, M, RD = c.full_ckpt_bytes, c.write_bandwidth, c.mtbf, c.diff_replay_time
    return (RD * W**2 / (4 * S**2 * M**2)) ** (1 / 3), (2 * S * RD * M / W) ** (1 / 3)


def _best_f_given_b(costs: LowDiffCosts, b: float) -> float:
    # dT_w/dF = N·T·[(R_D/B + r)/(2·M) − (S/W)/(F²·t)] = 0, and T_w is convex in F, so clamp to F >= B.
    c = costs
    per_step = c.diff_replay_time / b + c.step_replay_time
    return max(b, math.sqrt(2 * c.mtbf * c.full_write_time / (per_step * c.step_time)))


def _best_b_given_f(costs: LowDiffCosts, f: float) -> float:
    # dT_w/dB = N·T·[(t − r)/(2·M) − R_D·F/(2·M·B²)] = 0; if a step replays slower than it
    # trains (r >= t), T_w falls with B all the way to B = F (no diffs pay off).
    c = costs
    slack = c.step_time - c.step_replay_time
    return f if slack <= 0 else min(f, max(1.0, math.sqrt(c.diff_replay_time * f / slack)))


def _stationary_b(costs: LowDiffCosts) -> float:
    """B at which both partial derivatives vanish, for t > r. Eliminating F = B²·(t − r)/R_D from
    dT_w/dF = 0 leaves t·(t − r)²·(r·B⁴ + R_D·B³) = 2·M·(S/W)·R_D², whose left side grows with B:
    one positive root, found by bisection (r = 0: B = cbrt(2·(S/W)·R_D·M)/t, eq. (10))."""
    c = costs
    t, r, o = c.step_time, c.step_replay_time, c.diff_replay_time
    rhs = 2 * c.mtbf * c.full_write_time * o * o
    lo, hi = 0.0, (rhs / (t * (t - r) ** 2 * o)) ** (1 / 3)  # the root with r = 0 bounds it from above
    while lo < (mid := (lo + hi) / 2) < hi:
        lo, hi = (mid, hi) if t * (t - r) ** 2 * (r * mid**4 + o * mid**3) < rhs else (lo, mid)
    return hi


def continuous_optimum(costs: LowDiffCosts) -> tuple[float, float]:
    """Real-valued (F*, B*) in steps minimising eq. (8) subject to 1 <= B <= F.

    Unconstrained, setting both partial derivatives (eq. (9)) to zero gives, with r = 0, eq. (10);
    converted to steps with F = 1/(f·t), B = b/t (see `wasted_time` for why):
        F* = cbrt(4·(S/W)²·M²/R_D) / t,     B* = cbrt(2·(S/W)·R_D·M) / t.
    (The paper says "Equation (4) can be reduced" here; it means eq. (9).) With r > 0,
    B* is `_stationary_b` and F* = B*²·(t − r)/R_D. For t > r, T_w is a posynomial plus a
    constant, convex in (log F, log B), so if this point violates 1 <= B <= F the optimum lies on
    the boundary: B = F (no replay; F is then Young's interval sqrt(2·(S/W)·M)/t) or B = 1.
    For r >= t, replaying a step costs more than redoing it: B = F.
    """
    c = costs
    t, delta, M, RD, r = c.step_time, c.full_write_time, c.mtbf, c.diff_replay_time, c.step_replay_time
    young = max(1.0, math.sqrt(2 * delta * M) / t)
    if r >= t:
        return young, young
    if r == 0:
        f_u, b_u = (4 * delta**2 * M**2 / RD) ** (1 / 3) / t, (2 * delta * RD * M) ** (1 / 3) / t
    else:
        b_u = _stationary_b(c)
        f_u = b_u**2 * (t - r) / RD
    if 1 <= b_u <= f_u:
        return f_u, b_u
    on_b1 = (_best_f_given_b(c, 1.0), 1.0)
    return min([(young, young), on_b1], key=lambda fb: waste_fraction(c, *fb))


def optimal_fb(costs: LowDiffCosts) -> tuple[int, int]:
    """Integer (F*, B*) in steps from the closed form, with 1 <= B <= F.

    Rounding each coordinate separately is not enough: the best F depends on B
    (F ∝ sqrt(B) at fixed B), so when B* = 1.4 rounds to 1 the best F moves by ~15%. So: take
    the integers around B* and, for each, the integers around the closed-form best F for that B,
    and keep the pair with the smallest eq. (8).
    """
    _, b_c = continuous_optimum(costs)
    candidates: set[tuple[int, int]] = set()
    for b in range(max(1, math.floor(b_c) - 1), math.ceil(b_c) + 2):
        f_b = _best_f_given_b(costs, float(b))
        for f in (math.floor(f_b), math.ceil(f_b)):
            if f >= b:
                candidates.add((f, b))
    return min(sorted(candidates), key=lambda fb: waste_fraction(costs, *fb))


def optimal_fb_given(costs: LowDiffCosts, *, f: int | None = None, b: int | None = None) -> tuple[int, int]:
    """Integer (F, B) minimising eq. (8) when one of them is fixed by the user (or neither).

    With F fixed, dT_w/dB = 0 gives B = sqrt(R_D·F/(t − r)), clamped to [1, F]
    (`_best_b_given_f`); with B fixed, the best F is `_best_f_given_b`. The integers on either
    side are compared under eq. (8).
    """
    if f is None and b is None:
        return optimal_fb(costs)
    if f is not None:
        b_c = _best_b_given_f(costs, f)
        cands = {(f, min(f, max(1, x))) for x in (math.floor(b_c), math.ceil(b_c))}
    else:
        f_b = _best_f_given_b(costs, float(b))
        cands = {(max(b, x), b) for x in (math.floor(f_b), math.ceil(f_b))}
    return min(sorted(cands), key=lambda fb: waste_fraction(costs, *fb))


def numeric_optimal_fb(costs: LowDiffCosts, f_max: int, b_max: int) -> tuple[int, int]:
    """Integer argmin of eq. (8) over 1 <= B <= min(b_max, F), F <= f_max, by search.

    Every B is tried. For each B, T_w(F) = α·F + β/F + γ with α, β > 0 is convex, so the first F
    whose forward difference is >= 0 (found by bisection) is exact; this keeps the check
    independent of the closed form while staying fast for F in the tens of thousands.
    """
    for name, v in (("f_max", f_max), ("b_max", b_max)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    best: tuple[float, int, int] | None = None
    for b in range(1, min(b_max, f_max) + 1):
        lo, hi = b, f_max
        while lo < hi:
            mid = (lo + hi) // 2
            if waste_fraction(costs, mid + 1, b) >= waste_fraction(costs, mid, b):
                hi = mid
            else:
                lo = mid + 1
        w = waste_fraction(costs, lo, b)
        if best is None or w < best[0]:
            best = (w, lo, b)
    assert best is not None
    return best[1], best[2]


def diff_writes_keep_up(costs: LowDiffCosts) -> bool:
    """Whether one step's diff can be written within one step (eq. (8) assumes it is hidden)."""
    return costs.diff_bytes / costs.write_bandwidth <= costs.step_time


def retune(
    prev: tuple[int, int], costs: LowDiffCosts, *, min_gain: float = 0.01, fixed_f: int | None = None,
    fixed_b: int | None = None,
) -> tuple[tuple[int, int], str | None]:
    """New (F, B) and a one-line reason if the current inputs moved the optimum enough.

    §VII-A re-tunes F and B stepwise from runtime metrics (failure rate, bandwidth). To avoid
    flapping on measurement noise, the setting changes only when the new optimum predicts at
    least `min_gain` (relative) less waste than `prev` under the same, current inputs.
    Returns (prev, None) otherwise.
    """
    f0, b0 = int(prev[0]), int(prev[1])
    check_positive("min_gain", min_gain, allow_zero=True)
    new = optimal_fb_given(costs, f=fixed_f, b=fixed_b)
    if new == (f0, b0):
        return (f0, b0), None
    w_old, w_new = waste_fraction(costs, f0, b0), waste_fraction(costs, *new)
    if w_old - w_new < min_gain * w_old:
        return (f0, b0), None
    c = costs
    reason = (
        f"LowDiff re-tune: full checkpoint every {f0}->{new[0]} steps, batch {b0}->{new[1]} diffs; "
        f"predicted waste {w_old:.2%}->{w_new:.2%} (MTBF {format_duration(c.mtbf)}, "
        f"full write {format_duration(c.full_write_time)}, replay {format_duration(c.diff_replay_time)}"
        f"/record + {format_duration(c.step_replay_time)}/step, step {format_duration(c.step_time)})"
    )
    return new, reason
