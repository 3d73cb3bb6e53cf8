"""Fold the repetitions of each configuration into median, min and max per figure, and the
overhead ratio against the `none` baseline of the same invocation.

`overhead_ratio` = a configuration's `median_step_s` / its reference's `median_step_s`: `none`'s,
or for a strategy that changes training `none+VALUE`'s (the same training without checkpointing,
see `plan.matching_baseline`); its min and max use the configuration's min and max step time
over the same denominator. `compute_ratio` is the same for the forward+backward time (`compute_s`)
against the same reference's: how much the checkpointing slowed compute itself. Each row names
its reference (`against`). Figures that a run does not have (no bytes written, nothing to
recover) are left out of the median; a figure no run has is None. The stall by cause is the
median of each cause; a configuration is `over_budget` when any of its runs said its strategy
cannot keep within the budget; `predicted_waste` (per MTBF, bench/waste.py) comes from the medians.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from ..tuning.durations import format_duration
from .figures import FIGURES
from .plan import BASELINE, Configuration
from .runner import Outcome
from .waste import DEFAULT_MTBF_S, predicted_waste

STEP = "median_step_s"
RATIO = "overhead_ratio"
COMPUTE_RATIO = "compute_ratio"
# (ratio key, the figure it divides by the reference's)
RATIOS = ((RATIO, STEP), (COMPUTE_RATIO, "compute_s"))
# Summary keys, in report order.
KEYS = (STEP, RATIO, COMPUTE_RATIO, *(f for f in FIGURES if f != "step_s"))


def _key(figure: str) -> str:
    return STEP if figure == "step_s" else figure


def summarize(configs: list[Configuration], outcomes: dict[str, list[Outcome]],
              mtbf_s: tuple[float, ...] = (DEFAULT_MTBF_S,)) -> list[dict[str, Any]]:
    """One summary per configuration, in `configs` order; its predicted waste at each of `mtbf_s`."""
    rows = []
    for cfg in configs:
        runs = outcomes.get(cfg.name, [])
        ok = [o.figures for o in runs if o.figures is not None]
        mid: dict[str, Any] = {}
        low: dict[str, Any] = {}
        high: dict[str, Any] = {}
        for f in FIGURES:
            values = [v for v in (getattr(x, f) for x in ok) if v is not None]
            k = _key(f)
            mid[k], low[k], high[k] = (median(values), min(values), max(values)) if values else (None, None, None)
        rows.append({"name": cfg.name, "method": cfg.method, "kind": cfg.kind, "every": cfg.every,
                     "against": cfg.reference if cfg.name != BASELINE else None,
                     **{k: mid.get(k) for k in KEYS}, "min": low, "max": high, "repetitions": len(ok),
                     "save_cost_s": cfg.save_cost_s, "save_lag_steps": cfg.save_lag_steps,
                     "stall_by_cause": _causes(ok),
                     "over_budget": any(x.budget_over is not None for x in ok),
                     "nothing_on_disk": any(x.nothing_on_disk for x in ok),
                     "io_engines": sorted({x.io_engine for x in ok if x.io_engine}),
                     "runs": [o.to_json() for o in runs],
                     "errors": [o.error for o in runs if o.error]})
    _add_ratios(rows)
    for r in rows:
        r["predicted_waste"] = {format_duration(m): waste(r, m) for m in mtbf_s}
    return rows


def _causes(runs: list[Any]) -> dict[str, float] | None:
    """The median per cause of the runs' stall by cause (a cause a run lacks counts 0)."""
    have = [x.stall_by_cause for x in runs if x.stall_by_cause is not None]
    causes = dict.fromkeys(c for x in have for c in x)
    return {c: median(x.get(c, 0.0) for x in have) for c in causes} if have else None


def waste(row: dict[str, Any], mtbf_s: float) -> float | None:
    """The row's predicted waste at `mtbf_s` from its medians; None without a ratio or a saved step.
    A reference none of whose saves reached the disk in the run (its interval N exceeds it) would
    lose (N - 1) / 2 steps plus its saves' lag on average (`interval_model`)."""
    if row[RATIO] is None or row["fresh_disk_mean"] is None:
        return None
    disk, restorable = row["fresh_disk_mean"], row["fresh_restorable_mean"]
    if interval_model(row):
        disk = restorable = (row["every"] - 1) / 2 + row["save_lag_steps"]
    return predicted_waste(row[RATIO] - 1.0, row[STEP], restorable, disk, row["recovery_s"], mtbf_s)


def interval_model(row: dict[str, Any]) -> bool:
    """Whether the row's waste comes from its interval rather than its measured freshness."""
    return bool(row["nothing_on_disk"] and row.get("save_lag_steps") is not None and row["every"])


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        ref = by_name.get(r["against"] or BASELINE, {})
        for ratio, figure in RATIOS:
            base = ref.get(figure)
            for where in (r, r["min"], r["max"]):
                where[ratio] = where[figure] / base if base and where[figure] is not None else None
        r["min"] = {k: r["min"][k] for k in KEYS}
        r["max"] = {k: r["max"][k] for k in KEYS}
