"""GoCkpt's models (gockpt.txt): the stall of a checkpoint spread over k steps (§4.2.3), and the
checkpoint interval that balances stall against lost work (§3.1).

Spreading: copying the state (parameters + optimizer state, `state_bytes`) to the host takes
X = state_bytes / bandwidth. GoCkpt hides it behind training by sending one part per step,
as much as one step can hide (`overlap_s` of copy time, the whole step by default), for k
steps, and sends whatever is left blocking after step k. The parts are then at different
versions, so before each of steps 2..k it must also send, blocking, the gradients of every part
already sent; those are r = grad_bytes / state_bytes of the parts' size. Hence, with c the copy
time hidden per step and k <= ceil(X/c):

    stall(k) = max(0, X − k·c) + r·c·(1 + 2 + ... + (k−1)) = max(0, X − k·c) + r·c·k·(k−1)/2

k = 1 is "Async-O" (overlap one step, block for the rest). Each extra step hides c more of the
state but adds r·c·k of gradients, so spreading pays while k < 1/r: the continuous optimum is
k* = 1/r + 1/2 (capped at ceil(X/c): no point spreading past the end of the transfer).
"""

from __future__ import annotations

import math

from ckptrun.tuning.intervals import check_positive

__all__ = [
    "stall_time",
    "optimal_k",
    "ratio_k",
    "continuous_optimal_k",
    "paper_delta_t",
    "interval_steps",
    "waste_fraction",
]


def _transfer(state_bytes: float, grad_bytes: float, bandwidth: float, step_s: float,
              overlap_s: float | None) -> tuple[float, float, float, int]:
    s = check_positive("state_bytes", state_bytes)
    g = check_positive("grad_bytes", grad_bytes)
    bw = check_positive("bandwidth", bandwidth)
    t = check_positive("step_s", step_s)
    c = t if overlap_s is None else check_positive("overlap_s", overlap_s)
    if c > t:
        raise ValueError(f"overlap_s ({overlap_s!r}) cannot exceed the step time ({step_s!r})")
    x = s / bw
    k_max = max(1, math.ceil(x / c - 1e-9))
    return g / s, x, c, k_max


def stall_time(k: int, state_bytes: float, grad_bytes: float, bandwidth: float, step_s: float,
               overlap_s: float | None = None) -> float:
    """Training stall (time units of step_s) of one checkpoint spread over k steps (model above).

    Correction to §4.2.3: the paper defines ΔT = T_GoCkpt − T_Async-O but prints
    (−N² + 15N − 14)/14·T_step, which is T_Async-O − T_GoCkpt (the saving). With
    T_GoCkpt = N(N−1)/14·T_step and T_Async-O = (N−1)·T_step, ΔT = (N−1)(N−14)/14·T_step,
    negative for 1 < N < 14. Its best saving, at N = 7 or 8, is 3·T_step, not the 4·T_step
    stated. The 1/7 there is r for its mixed-precision setting (the text also says "one-sixth";
    r depends on the recipe, so ckptrun measures it as grad_bytes/state_bytes). Spreading over
    k > ceil(X/c) steps is counted as ceil(X/c): the transfer is finished by then.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (steps to spread over) must be an integer >= 1, got {k!r}")
    r, x, c, k_max = _transfer(state_bytes, grad_bytes, bandwidth, step_s, overlap_s)
    k = min(k, k_max)
    return max(0.0, x - k * c) + r * c * k * (k - 1) / 2


def continuous_optimal_k(state_bytes: float, grad_bytes: float) -> float:
    """k* = 1/r + 1/2 with r = grad_bytes/state_bytes: where d stall/dk = c·(r·(2k−1)/2 − 1) = 0."""
    r = check_positive("grad_bytes", grad_bytes) / check_positive("state_bytes", state_bytes)
    return 1 / r + 0.5


def optimal_k(state_bytes: float, grad_bytes: float, bandwidth: float, step_s: float,
              overlap_s: float | None = None) -> int:
    """Integer spread factor minimising `stall_time`: 1/r + 1/2 rounded, capped at ceil(X/c).

    stall(k) is convex in integer k (its increments r·c·k − c grow; the last, partial part only
    makes the final increment larger), so the best integer is next to the continuous optimum or
    at the cap; when the last part would be tiny, stopping one step early can win, so the two
    integers below the cap are candidates too. Ties go to the smaller k (fewer versions).
    """
    _, _, _, k_max = _transfer(state_bytes, grad_bytes, bandwidth, step_s, overlap_s)
    k_c = continuous_optimal_k(state_bytes, grad_bytes)
    candidates = {math.floor(k_c), math.ceil(k_c), k_max - 1, k_max}
    ks = sorted({min(max(1, k), k_max) for k in candidates})
    return min(ks, key=lambda k: stall_time(k, state_bytes, grad_bytes, bandwidth, step_s, overlap_s))


def ratio_k(state_bytes: float, grad_bytes: float) -> int:
    """The integer k minimising `stall_time` while the transfer outlasts the spread (no cap): the
    floor or ceiling of k* = 1/r + 1/2, ties to the smaller. What k is before anything is timed."""
    r = check_positive("grad_bytes", grad_bytes) / check_positive("state_bytes", state_bytes)
    k_c = continuous_optimal_k(state_bytes, grad_bytes)
    return min(sorted({max(1, math.floor(k_c)), max(1, math.ceil(k_c))}), key=lambda k: r * k * (k - 1) / 2 - k)


def paper_delta_t(n: float, r: float = 1 / 7) -> float:
    """ΔT/T_step = (T_GoCkpt − T_Async-O)/T_step for a transfer of n steps, sign corrected.

    = r·n·(n−1)/2 − (n−1); with the paper's r = 1/7 this is (n−1)(n−14)/14 (see `stall_time`).
    """
    check_positive("r", r)
    return r * n * (n - 1) / 2 - (n - 1)


def interval_steps(stall_s: float, step_s: float, mtbf_s: float) -> float:
    """§3.1's optimal interval N* = sqrt(2·T_ckpt/(p·T_step²)) in steps, p = 1/MTBF.

    This is Young's interval sqrt(2·T_ckpt·M) divided by the step time; for GoCkpt T_ckpt is the
    stall of one spread checkpoint (`stall_time`), not the full copy time. A zero stall gives 0:
    checkpoint every step.
    """
    d = check_positive("stall_s", stall_s, allow_zero=True)
    t = check_positive("step_s", step_s)
    m = check_positive("mtbf_s", mtbf_s)
    return math.sqrt(2 * d * m) / t


def waste_fraction(n_steps: float, stall_s: float, step_s: float, mtbf_s: float,
                   load_s: float = 0.0) -> float:
    """§3.1's P = T_ckpt/(N·T_step) + p·N·T_step/2 + p·T_load: waste per unit of training time."""
    n = check_positive("n_steps", n_steps)
    d = check_positive("stall_s", stall_s, allow_zero=True)
    t = check_positive("step_s", step_s)
    p = 1 / check_positive("mtbf_s", mtbf_s)
    load = check_positive("load_s", load_s, allow_zero=True)
    return d / (n * t) + p * n * t / 2 + p * load
