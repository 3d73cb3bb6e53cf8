"""What `ckptrun tune` shows and writes: the table, the JSON document and the recipe."""

from __future__ import annotations

import shlex
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from .durations import format_duration
from .intervals import durable_every
from .plan import settings_flags
from .profile import Costs, StrategyCosts
from .tune import TuneResult

__all__ = ["durable_line", "print_report", "to_json", "write_recipe"]

WIDE = 140


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def _measured_line(result: TuneResult) -> str:
    c = result.profile.costs
    return (f"measured: step t {format_duration(c.step_s)} · full checkpoint S {_mb(c.ckpt_bytes)} · diff D "
            f"{_mb(c.diff_bytes)}/step · write W {c.write_Bps / 1e6:.1f} MB/s · load R_F {format_duration(c.load_s)}"
            f" · replay r {format_duration(c.replay_s)}/step + R_D {format_duration(c.record_s)}/record"
            f" · free {c.free_bytes / 1e9:.1f} GB")


def _slowdown(sc: StrategyCosts | None) -> str:
    """Its slowdown against no checkpointing with its spread over rounds, or `noise` (counted as 0)."""
    if sc is None:
        return "-"
    sd = sc.slowdown
    spread = f"[{sd.low_s * 1e3:.1f}, {sd.high_s * 1e3:.1f}]" if sd.rounds > 1 else f"±{sd.noise_s * 1e3:.1f}"
    if not sd.resolved:
        return f"noise ({sd.median_s * 1e3:.1f} ms {spread})"
    return f"{sd.median_s * 1e3:.1f} ms {spread}"


def durable_line(costs: Costs, mtbf_s: float, upload_Bps: float) -> str:
    """The remote tier's level: `--durable-every auto`'s interval for a full checkpoint uploaded
    at `upload_Bps` (tune measures no upload; the user gives the bandwidth)."""
    upload_s = max(costs.ckpt_bytes / upload_Bps, 1e-3)
    every, why = durable_every(upload_s, costs.step_s, mtbf_s)
    return (f"remote tier (--durable) at {upload_Bps / 1e6:.1f} MB/s: an upload takes {format_duration(upload_s)}; "
            f"--durable-every {every} ({why})")


def print_report(console: Console, result: TuneResult, upload_Bps: float = 0.0) -> None:
    """The per-strategy table, the model answers, the remote tier's level (given `upload_Bps`)
    and the one-line recommendation."""
    prof, plan = result.profile, result.plan
    if not console.is_terminal and console.width < WIDE:  # a log or a pipe: do not squeeze the table
        console = Console(file=console.file, width=WIDE, highlight=False)

    def say(text: str) -> None:
        console.print(text, soft_wrap=True, markup=False)

    say(f"ckptrun tune: {shlex.join([prof.script, *prof.args])} ({prof.steps} steps measured per run)")
    say(_measured_line(result))
    say(f"MTBF {format_duration(plan.mtbf_s)} ({plan.mtbf_source}); overhead budget {plan.max_overhead:.2%}")
    table = Table("strategy", "δ/ckpt", "slowdown", "persist", "Young", "Daly", "CheckFreq ≥", "setting",
                  "overhead", "lost/failure", "waste", title="per strategy (intervals: time = steps)")
    measured = {sc.name: sc for sc in prof.strategies}
    for sp in plan.strategies:
        p = sp.prediction
        mark = "→ " if sp.name == plan.recommended else ""
        table.add_row(mark + sp.name, format_duration(sp.delta_s), _slowdown(measured.get(sp.name)),
                      format_duration(sp.persist_s),
                      f"{format_duration(sp.young_s)} = {sp.young_steps}",
                      f"{format_duration(sp.daly_s)} = {sp.daly_steps}",
                      str(sp.checkfreq_min_steps), settings_flags(sp.settings), f"{p.overhead:.2%}",
                      format_duration(p.lost_work_s), f"{p.waste:.2%}",
                      style="bold" if mark else None)
    console.print(table)
    for line in plan.notes:  # each registered strategy's tuning model
        say(line)
    if upload_Bps:
        say(durable_line(prof.costs, plan.mtbf_s, upload_Bps))
    say(f"recommendation: {plan.reason}")


def to_json(result: TuneResult) -> dict[str, Any]:
    """Every measurement, setting and prediction (seconds, bytes, fractions)."""
    plan = asdict(result.plan)
    best = next(s for s in result.plan.strategies if s.name == result.plan.recommended)
    return {"profile": asdict(result.profile), "plan": plan,
            "recommendation": {"strategy": best.name, "settings": best.settings, "reason": result.plan.reason}}


def write_recipe(path: Path, result: TuneResult) -> None:
    """A recipe that `ckptrun --recipe PATH SCRIPT` runs as is, its provenance in comments."""
    prof, plan = result.profile, result.plan
    best = next(s for s in plan.strategies if s.name == plan.recommended)
    command = shlex.join([prof.script, *prof.args])
    header = [
        f"# Written by `ckptrun tune` on {time.strftime('%Y-%m-%d %H:%M')} for: {command}",
        f"# Why: {plan.reason}",
        f"# {_measured_line(result)}",
        f"# MTBF {format_duration(plan.mtbf_s)} ({plan.mtbf_source}).",
        f"# Run: ckptrun --recipe {path} {command}   (flags given on the command line override these)",
        "# Tune again when the model, batch size, machine or storage change.",
    ]
    body = {"strategy": best.name, **best.settings, "mtbf": format_duration(plan.mtbf_s), "dir": prof.dir}
    path.write_text("\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False))
