"""PCcheck's configuration rule (pccheck.txt §3.4): concurrency N* and interval f*.

Symbols, as the paper defines them (its Table 2), in ckptrun's names:

- t  `step_s`:     time of one training iteration.
- m  `ckpt_bytes`: size of one checkpoint.
- S  `storage_bytes`: storage reserved for checkpoints; N concurrent checkpoints need (N+1)·m
  (one slot always holds the latest complete checkpoint), so N <= S/m − 1.
- N  concurrency: checkpoints allowed in flight (copying or persisting) at once.
- T_w `write_s`:   time to write one checkpoint, from the start of its GPU copy until it is
  persisted, in the worst case, i.e. with all N in flight contending for bandwidth. So T_w
  depends on N and is measured per N (for N = 1 it is about m / storage bandwidth).
- q  `max_slowdown`: the largest acceptable slowdown, runtime with / without checkpointing,
  so q >= 1 (1.05 means 5% slower). It is a ratio, not the overhead fraction 0.05.
- f  interval: iterations between checkpoints (the value tuned).
- A  iterations of the whole job; drops out for long jobs.

Rule: pick N* in [1, S/m − 1] minimising T_w(N)/N (checkpoint drain time per slot), then
f* = ceil(T_w(N*) / (N*·q·t)) (eq. (3); the paper's brackets are a ceiling: f is the smallest
interval that meets the slowdown bound).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ckptrun.tuning.intervals import check_positive

__all__ = [
    "PCcheckConfig",
    "max_concurrency",
    "optimal_concurrency",
    "checkpoint_interval_steps",
    "runtime_model",
    "worst_case_recovery_s",
    "configure",
]


@dataclass(frozen=True)
class PCcheckConfig:
    """The tuned setting: N in flight, a checkpoint every `interval_steps`, at write time `write_s`."""

    concurrency: int
    interval_steps: int
    write_s: float


def _check_count(name: str, v: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    return v


def max_concurrency(ckpt_bytes: float, storage_bytes: float) -> int:
    """Largest N the storage allows: floor(S/m) − 1 (N in flight plus the latest complete one)."""
    m = check_positive("ckpt_bytes", ckpt_bytes)
    s = check_positive("storage_bytes", storage_bytes)
    n = math.floor(s / m) - 1
    if n < 1:
        raise ValueError(
            f"storage for checkpoints ({s:.0f} B) must hold at least two checkpoints of {m:.0f} B "
            "(one in flight plus the latest complete one)"
        )
    return n


def optimal_concurrency(
    write_s: Mapping[int, float] | Callable[[int], float], n_max: int
) -> int:
    """N* = argmin over N in [1, n_max] of T_w(N)/N; ties go to the smaller N (less storage).

    `write_s` gives the measured worst-case write time per N, as a mapping (only measured N are
    considered, as the paper profiles "only a few values of N") or a function of N.
    """
    _check_count("n_max", n_max)
    if callable(write_s):
        ns = range(1, n_max + 1)
        get = write_s
    else:
        ns = sorted(n for n in write_s if 1 <= n <= n_max)
        get = write_s.__getitem__
        if not ns:
            raise ValueError(f"no write time measured for any N in [1, {n_max}]")
    best_n, best = 0, math.inf
    for n in ns:
        per_slot = check_positive(f"write time for N={n}", get(n)) / n
        if per_slot < best:
            best_n, best = n, per_slot
    return best_n


def checkpoint_interval_steps(write_s: float, concurrency: int, max_slowdown: float, step_s: float) -> int:
    """f* = ceil(T_w / (N·q·t)), at least 1 (eq. (3)).

    With N checkpoints in flight, each taking T_w, at most N finish per T_w, so f iterations can
    take no less than T_w/N and runtime ~ A·T_w/(f·N); bounding that by q·A·t gives eq. (2).
    """
    tw = check_positive("write_s", write_s)
    n = _check_count("concurrency", concurrency)
    q = check_positive("max_slowdown", max_slowdown)
    if q < 1:
        raise ValueError(
            f"max_slowdown is the ratio runtime with/without checkpoints and must be >= 1 "
            f"(e.g. 1.05 for 5%), got {max_slowdown!r}"
        )
    t = check_positive("step_s", step_s)
    return max(1, math.ceil(tw / (n * q * t) - 1e-9))


def runtime_model(interval_steps: int, concurrency: int, write_s: float, step_s: float,
                  iterations: float) -> float:
    """Job runtime with a checkpoint every f steps and N in flight (§3.4, runtime_2).

    runtime_2 = f·t + max(T_w, N·f·t)·(A/(f·N) − 1) + T_w: the first interval runs before any
    checkpoint, each later group of N checkpoints takes the longer of writing (T_w) and
    training N·f steps, and the last write is not overlapped. Assumes A >= f·N.
    """
    f = _check_count("interval_steps", interval_steps)
    n = _check_count("concurrency", concurrency)
    tw = check_positive("write_s", write_s)
    t = check_positive("step_s", step_s)
    a = check_positive("iterations", iterations)
    if a < f * n:
        raise ValueError(f"the model needs iterations >= interval_steps·concurrency ({f * n}), got {a}")
    return f * t + max(tw, n * f * t) * (a / (f * n) - 1) + tw


def worst_case_recovery_s(interval_steps: int, concurrency: int, write_s: float, step_s: float,
                          load_s: float) -> float:
    """Upper bound of eq. (4): l + f·t + t·min(N·f, T_w/t) (load plus redone work).

    (The paper's prose after eq. (4) says "If T_w < N"; the condition is T_w < N·f·t.)
    """
    f = _check_count("interval_steps", interval_steps)
    n = _check_count("concurrency", concurrency)
    tw = check_positive("write_s", write_s)
    t = check_positive("step_s", step_s)
    load = check_positive("load_s", load_s, allow_zero=True)
    return load + f * t + t * min(n * f, tw / t)


def configure(
    write_s: Mapping[int, float] | Callable[[int], float],
    *,
    step_s: float,
    ckpt_bytes: float,
    storage_bytes: float,
    max_slowdown: float,
) -> PCcheckConfig:
    """(N*, f*) for measured write times, storage budget and slowdown bound."""
    n_max = max_concurrency(ckpt_bytes, storage_bytes)
    n = optimal_concurrency(write_s, n_max)
    tw = float(write_s(n) if callable(write_s) else write_s[n])
    return PCcheckConfig(n, checkpoint_interval_steps(tw, n, max_slowdown, step_s), tw)
