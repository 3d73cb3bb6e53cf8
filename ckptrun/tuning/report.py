"""What `ckptrun tune` shows and writes: the table, the JSON document and the recipe."""

from __future__ import annotations

import math
import shlex
import textwrap
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.text import Text

from ..widthfit import Col, fit_table, left_out_line
from .durations import format_duration
from .levels import HOUR, KINDS, FailureRates, LevelsPlan, failure_rates
from .model import settings_flags
from .profile import StrategyCosts
from .tune import TuneResult

__all__ = ["print_report", "tier_lines", "to_json", "write_recipe"]

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


def _per_h(rate: float) -> str:
    return f"{rate:.3g}/h"


def tier_lines(tiers: LevelsPlan, strategy: str, width: int = 80) -> list[str]:
    """The tiers block: per tier its interval, the failures that resume from it and its waste
    per hour (copies + failures), then the total and the failures no tier survives; `width`
    columns at most."""
    r, layout = tiers.rates, tiers.layout
    node_from = (f"partners' memory (--replicas {layout.replicas})" if layout.replicas > 1 else
                 "--durable (--node-local-dir: --dir is lost with its node)" if layout.node_local_dir else
                 "--dir (taken as outliving its node: --node-local-dir says otherwise)")
    lines = textwrap.wrap(f"tiers of {strategy}: failures per hour: process {r.process * HOUR:.3g}, node "
                          f"{r.node * HOUR:.3g}, job {r.job * HOUR:.3g} ({r.source}); a lost node resumes "
                          f"from {node_from}", width)
    for lp in tiers.levels:
        lv = lp.level
        if lp.every is None:
            when = "at the end of the run only"
        else:
            setting = f"{lv.flag} {lp.every}" if lv.flag.startswith("--durable") else lv.flag
            when = f"{setting} ({lp.every} steps, {format_duration(lp.every * tiers.step_s)})"
        kinds = ", ".join(lp.kinds) or "no failure"
        text = (f"{when}: resumes {kinds} ({_per_h(lp.rate_per_h)}); waste {lp.waste_s_per_h:.3g} s/h = copies "
                f"{lp.copies_s_per_h:.3g} + failures {lp.failures_s_per_h:.3g}"
                + ("" if lp.why == "given" else f"; {lp.why}"))
        lines += textwrap.wrap(text, width, initial_indent=f"  {lv.tier:<8}", subsequent_indent=" " * 10)
    total = tiers.waste_s_per_h
    lines += textwrap.wrap(f"total waste {total:.3g} s/h ({total / HOUR:.2%} of the run)", width,
                           initial_indent="  ", subsequent_indent="  ")
    if tiers.uncovered:
        lines += textwrap.wrap(f"no tier survives {', '.join(tiers.uncovered)} failures "
                               f"({_per_h(tiers.uncovered_per_h)}): each starts the run over; --durable covers "
                               "them (tune --upload-mbps B plans it)", width, initial_indent="  ",
                               subsequent_indent="  ")
    return lines


# The per-strategy table's columns: the strategy identifies a row; at a narrow terminal the
# model's intermediate intervals go first, the setting and the predicted waste last.
COLUMNS = (Col("strategy", key=True, justify="left"), Col("δ/ckpt", 3), Col("slowdown", 4), Col("persist", 6),
           Col("Young", 8), Col("Daly", 7), Col("CheckFreq ≥", 5), Col("setting", justify="left"),
           Col("overhead", 1), Col("lost/failure", 2), Col("waste"))


def print_report(console: Console, result: TuneResult) -> None:
    """The per-strategy table, the model answers, the one-line recommendation and the
    recommended strategy's tiers (80 columns)."""
    prof, plan = result.profile, result.plan
    if not console.is_terminal and console.width < WIDE:  # a log or a pipe: do not squeeze the table
        console = Console(file=console.file, width=WIDE, highlight=False)

    def say(text: str) -> None:  # at a terminal, wrapped between words; in a log, one line each
        console.print(text, soft_wrap=not console.is_terminal, markup=False)

    say(f"ckptrun tune: {shlex.join([prof.script, *prof.args])} ({prof.steps} steps measured per run)")
    say(_measured_line(result))
    say(f"MTBF {format_duration(plan.mtbf_s)} of all failures (below: per kind); overhead budget "
        f"{plan.max_overhead:.2%}")
    measured = {sc.name: sc for sc in prof.strategies}
    rows = []
    for sp in plan.strategies:
        p = sp.prediction
        name = Text(f"→ {sp.row}", style="bold") if sp.row == plan.recommended else sp.row
        rows.append((name, format_duration(sp.delta_s), _slowdown(measured.get(sp.name)),
                     format_duration(sp.persist_s), f"{format_duration(sp.young_s)} = {sp.young_steps}",
                     f"{format_duration(sp.daly_s)} = {sp.daly_steps}", str(sp.checkfreq_min_steps),
                     settings_flags(sp.settings), f"{p.overhead:.2%}", format_duration(p.lost_work_s),
                     f"{p.waste:.2%}"))
    table, left_out = fit_table(COLUMNS, rows, console.width, title="per strategy (intervals: time = steps)")
    console.print(table)
    if left_out:
        say(left_out_line(left_out, "a wider terminal or --json shows them"))
    for line in plan.notes:  # each registered strategy's tuning model
        say(line)
    say(f"recommendation: {plan.reason}")
    for line in tier_lines(result.tiers, plan.recommended):
        say(line)


def to_json(result: TuneResult) -> dict[str, Any]:
    """Every measurement, setting and prediction (seconds, bytes, fractions)."""
    plan = asdict(result.plan)
    best = result.plan.best()
    return {"profile": asdict(result.profile), "plan": plan, "tiers": asdict(result.tiers),
            "recommendation": {"strategy": best.name, "settings": best.settings, "reason": result.plan.reason}}


def _rate_options(rates: FailureRates, mtbf_s: float) -> dict[str, str]:
    """The --mtbf-KIND options that make the run's rates these (none where --mtbf's default split
    does); a kind that never fails gets what --mtbf leaves, about nothing."""
    split = failure_rates(mtbf_s, {})
    if all(math.isclose(rates.of(k), split.of(k), rel_tol=1e-9) for k in KINDS):
        return {}
    return {f"mtbf_{k}": format_duration(1.0 / rates.of(k)) for k in KINDS if rates.of(k) > 0}


def write_recipe(path: Path, result: TuneResult) -> None:
    """A recipe that `ckptrun --recipe PATH SCRIPT` runs as is, its provenance in comments."""
    prof, plan = result.profile, result.plan
    best = plan.best()
    command = shlex.join([prof.script, *prof.args])
    header = [
        f"# Written by `ckptrun tune` on {time.strftime('%Y-%m-%d %H:%M')} for: {command}",
        f"# Why: {plan.reason}",
        f"# {_measured_line(result)}",
        f"# MTBF {format_duration(plan.mtbf_s)} ({plan.mtbf_source}).",
        f"# Run: ckptrun --recipe {path} {command}   (flags given on the command line override these)",
        "# Tune again when the model, batch size, machine or storage change.",
    ]
    if result.tiers.layout.replicas > 1:
        header.append(f"# Tiers planned with --replicas {result.tiers.layout.replicas}: give the run the same.")
    if result.tiers.layout.node_local_dir:
        header.append("# Tiers planned with --node-local-dir: give the run the same.")
    body = {"strategy": best.name, **best.settings, "max_overhead": f"{plan.max_overhead * 100:g}",
            "mtbf": format_duration(plan.mtbf_s),
            **_rate_options(plan.rates, plan.mtbf_s), "dir": prof.dir}
    path.write_text("\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False))
