"""The bench's predicted waste: the expected fraction of training time a configuration loses at
a given MTBF, fed with what its runs measured.

waste = overhead + (lost work per failure + recovery) / MTBF, where overhead is the step time's
excess over `none`'s (the overhead ratio less 1, at least 0), recovery the measured restart of a
killed worker to its first resumed step, and the lost work the tiers' model's (tuning/levels.py):
the failures are split into kinds by its default shares; a process failure resumes from the
newest step in memory or on disk, the others (the share `Layout.memory_lost_share` gives, a job
with its --dir intact among them) from the newest on disk. The steps lost are the measured mean
distance to that step (bench/freshness.py) plus half a step (a failure falls anywhere in a
step), at the configuration's own step time.
"""

from __future__ import annotations

from ..tuning.levels import Layout, failure_rates

DEFAULT_MTBF_S = 3600.0  # the waste column's MTBF unless --mtbf is given


def predicted_waste(overhead: float, step_s: float, restorable_steps: float, disk_steps: float,
                    recovery_s: float | None, mtbf_s: float, layout: Layout | None = None) -> float:
    """The expected fraction of time lost (module docstring)."""
    rates = failure_rates(mtbf_s, {})
    from_disk = (layout or Layout()).memory_lost_share(rates)
    lost_steps = (1.0 - from_disk) * restorable_steps + from_disk * disk_steps + 0.5
    return max(0.0, overhead) + (lost_steps * step_s + (recovery_s or 0.0)) / mtbf_s
