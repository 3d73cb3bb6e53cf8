"""The memory tier's waste model (LowDiff+, paper Exp. 3/9): two kinds of failure, two recovery points.

A software failure (the trainer dies, the host and the engine live; the paper's common case) at
rate (1-h)/M resumes from the state the engine holds in memory (lowdiff+'s replica, a snapshot
strategy's newest staging slot), losing about half a step. A hardware failure (the machine, and
the engine's memory with it) at rate h/M resumes from the newest durable write, losing about P/2
steps plus the load. The trainer pays its per-step snapshot cost δ every
step whatever P is; a persist costs it at most c = the write's duration (the engine writes it
beside training, so that is an upper bound on the interference). Minimising
c/(P·t) + h·P·t/(2M) gives Young's interval for the hardware failures alone, sqrt(2·c·M/h);
Daly's refinement and CheckFreq's bound (never faster than the disk drains) are applied on top.
"""

from __future__ import annotations

from ...tuning.intervals import tier_interval_steps

HW_SHARE = 0.5  # share of failures that lose the machine when nothing says otherwise (the rates' default)
MIN_SHARE = 1e-6  # rates with no machine loss at all: persisted as rarely as one in a million failures asks


def persist_every(persist_s: float, step_s: float, mtbf_s: float, hw_share: float = HW_SHARE) -> tuple[int, str]:
    """(P, why): steps between durable writes of the state held in memory (the tiers' interval for a write
    beside training, `intervals.tier_interval_steps`)."""
    m_hw = mtbf_s / max(hw_share, MIN_SHARE)
    every, why = tier_interval_steps(persist_s, persist_s, step_s, m_hw)
    return every, f"{why} ({hw_share:.0%} of failures lose the state in memory; the others resume from it)"


def waste(delta_s: float, persist_s: float, step_s: float, every: int, mtbf_s: float, load_s: float,
          hw_share: float = HW_SHARE) -> tuple[float, float]:
    """(expected work lost per failure in seconds, fraction of run time wasted)."""
    interval = every * step_s
    lost = (1 - hw_share) * step_s / 2 + hw_share * (interval / 2 + load_s)
    return lost, delta_s / step_s + persist_s / interval + lost / mtbf_s
