"""The references' interval within the overhead budget (`bench --every default`).

The strategies keep the budget themselves (`ckptrun run --max-overhead`); the references
(torch.save, DCP) are the script's own saves and have no such control, so the bench chooses
their interval: the fewest steps between saves at which one save's measured cost, spread over
them, stays within the budget of `none`'s step. The cost of one save is measured in a short
calibration run of each reference saving every step, against a calibration run of `none`: its
step time less none's, all it costs the loop (its stall and the slowdown of the step around
it). Saving every step, a DCP save also waits for the previous one to be written, so for DCP
this cost is an upper bound and its interval on the safe side. The same run measures how many
steps after its own a save is on disk (its lag): where a reference's interval exceeds the bench's
run, its waste is predicted from the interval and that lag (bench/stats.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console

from ..errors import CkptrunError
from ..tuning.plan import parse_percent
from .plan import BASELINE, Configuration, Workload
from .runner import run_configuration

DEFAULT_BUDGET = 0.05  # `ckptrun run --max-overhead`'s default, 5%
OFF = "off"
CALIBRATION_TIMED_STEPS = 5  # timed steps of each calibration run (after the bench's warm-up)


def parse_budget(text: str) -> float | None:
    """`--max-overhead` as a fraction: "" (not given) the run's default, `off` None (no budget)."""
    if not text:
        return DEFAULT_BUDGET
    return None if text.strip().lower() == OFF else parse_percent(text)


def reference_interval(save_cost_s: float, step_s: float, budget: float) -> int:
    """The fewest steps N such that one save every N steps costs at most `budget` of a step of
    `step_s`: save_cost_s / (N * step_s) <= budget; 1 when a save costs nothing measurable."""
    if step_s <= 0 or budget <= 0:
        raise ValueError(f"step time and budget must be positive (got {step_s}, {budget})")
    return max(1, math.ceil(max(0.0, save_cost_s) / (budget * step_s) - 1e-9))


@dataclass(frozen=True)
class Calibration:
    """What chose the references' intervals: none's step and each reference's cost per save."""

    budget: float
    steps: int  # of each calibration run
    none_step_s: float
    save_cost_s: dict[str, float]
    every: dict[str, int]

    def to_json(self) -> dict:
        return {"budget": self.budget, "steps": self.steps, "none_step_s": self.none_step_s,
                "save_cost_s": self.save_cost_s, "every": self.every}

    def note(self) -> str:
        """One line under the tables saying what was done."""
        each = ", ".join(f"{n} every {self.every[n]} ({1e3 * c:.0f} ms a save)" for n, c in self.save_cost_s.items())
        return (f"references within the {self.budget:.0%} budget: {each}, against none's "
                f"{1e3 * self.none_step_s:.0f} ms step; each save's cost measured saving every step in a "
                f"{self.steps}-step calibration run (for DCP, which then also waits for the previous save, an "
                "upper bound)")


def calibrate(configs: list[Configuration], work: Workload, root: Path, warmup: int, budget: float | None,
              timeout_s: float, progress: Console) -> tuple[list[Configuration], Calibration | None]:
    """`configs` with each reference whose interval is to be chosen (every None) at the interval
    that keeps it within `budget` (None: no budget, every step), and what chose them."""
    todo = [c for c in configs if c.kind == "reference" and c.every is None]
    if not todo:
        return configs, None
    if budget is None:
        return [replace(c, every=1) if c in todo else c for c in configs], None
    steps = warmup + CALIBRATION_TIMED_STEPS
    progress.print(f"ckptrun bench: calibrating {', '.join(c.name for c in todo)} against {BASELINE} "
                   f"({steps} steps each, saving every step) for their interval within the {budget:.0%} budget")
    runs = [Configuration(BASELINE, BASELINE, "baseline", None),
            *(replace(c, name=f"{c.name}@1", every=1) for c in todo)]
    measured = {}
    for i, cfg in enumerate(runs):
        out = run_configuration(cfg, work, root / f"calibrate-{i:02d}-{cfg.method}", steps, warmup, timeout_s,
                                recover=False)
        if out.figures is None:
            raise CkptrunError(f"the calibration run of {cfg.name} failed: {out.error}")
        measured[cfg.method] = out.figures
    none = measured[BASELINE].step_s
    costs = {c.name: max(0.0, measured[c.method].step_s - none) for c in todo}
    every = {n: reference_interval(cost, none, budget) for n, cost in costs.items()}
    chosen = [replace(c, every=every[c.name], save_cost_s=costs[c.name],
                      save_lag_steps=measured[c.method].fresh_disk_mean) if c in todo else c for c in configs]
    return chosen, Calibration(budget, steps, none, costs, every)
