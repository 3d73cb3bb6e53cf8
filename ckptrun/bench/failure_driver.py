"""`ckptrun bench --failures`: goodput of every configuration under the same kills.

Per repetition and MTBF one kill schedule is drawn (seeded: repetition r uses seed + r) or
replayed (`--failure-log`), and every configuration runs under it for the same budget,
interleaved (A B C A B C ...) as in the plain bench. The baselines (`none`, `none+VALUE`) also
run once per repetition without failures: their steps per second are the denominators of the
effective training time ratio. Figures are medians over repetitions (see `goodput`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from statistics import median
from typing import Any

from rich.console import Console, RenderableType
from rich.text import Text

from ..errors import CkptrunError
from ..tuning.durations import format_duration, parse_duration
from ..widthfit import Col, fit_table, left_out_line
from . import budget, machine, plan, report
from .failure_runner import run_under_failures
from .failures import Schedule
from .goodput import Goodput, goodput
from .options import BenchOptions
from .progress import RunProgress

SCHEMA = "ckptrun-bench-failures/1"
NO_FAILURES = "no failures"


def schedules(o: BenchOptions) -> dict[str, list[Schedule]]:
    """{MTBF label: one schedule per repetition}; one label for a replayed trace."""
    duration = o.duration_s()
    if o.failure_log:
        one = Schedule.replay(Path(o.failure_log), duration)
        return {f"trace {Path(o.failure_log).name}": [one] * o.repeat}
    return {format_duration(m): [Schedule.draw(m, duration, o.seed + r) for r in range(o.repeat)]
            for m in o.mtbf_s()}


def run_failure_bench(o: BenchOptions, console: Console, progress: Console) -> int:
    """Run the goodput bench described by BenchOptions `o`; returns the exit code."""
    configs = plan.configurations(o.strategies, o.every, o.io_engine, o.durable, max_overhead=o.max_overhead,
                                  host_memory=o.host_memory)
    baselines = [c for c in configs if c.kind == "baseline"]
    plans = schedules(o)
    if o.plot:
        report.require_matplotlib()
    work = plan.Workload(plan.example_script(), o.model, o.device, o.trainer_threads)
    root = Path(o.dir) if o.dir else machine.default_dir()
    root.mkdir(parents=True, exist_ok=True)
    configs, _ = budget.calibrate(configs, work, root, o.warmup, o.budget(), o.run_timeout_s(), progress)
    if o.traces:
        _write_traces(plans, Path(o.traces))
    for label, ss in plans.items():
        empty = [r + 1 for r, sched in enumerate(ss) if not sched.offsets]
        if empty:
            progress.print(f"ckptrun bench: warning: {label}: no failure within {format_duration(o.duration_s())} "
                           f"in repetition(s) {', '.join(map(str, empty))}; a --duration of several MTBFs gives "
                           "failures to measure")
    total = o.repeat * (len(baselines) + len(plans) * len(configs))
    progress.print(f"ckptrun bench --failures {o.failures}: {len(configs)} configurations x {len(plans)} failure "
                   f"rate(s) x {o.repeat} repetitions (+ baselines without failures), "
                   f"{format_duration(o.duration_s())} each, ~{format_duration(total * o.duration_s())} in all, "
                   f"model {o.model}, in {root}")
    t0 = time.perf_counter()
    results: dict[tuple[str, str], list[Goodput | str]] = {}
    n = 0
    with RunProgress(progress, total) as shown:
        for rep in range(o.repeat):
            runs = [(NO_FAILURES, c, Schedule((), o.duration_s(), NO_FAILURES)) for c in baselines]
            runs += [(label, c, ss[rep]) for label, ss in plans.items() for c in configs]
            for label, cfg, schedule in runs:
                n += 1
                shown.running(f"{cfg.name}, {label} ({rep + 1}/{o.repeat})")
                run_dir = root / f"fail-{os.getpid()}-r{rep}-{n:03d}-{cfg.name.replace('@', '-every-')}"
                try:
                    result: Goodput | str = goodput(run_under_failures(cfg, work, run_dir, schedule, o.failures))
                    shutil.rmtree(run_dir, ignore_errors=True)
                except CkptrunError as e:
                    result = str(e)
                results.setdefault((label, cfg.name), []).append(result)
                shown.done(f"{cfg.name}, {label} (repetition {rep + 1}): {_line(result)}",
                           failed=isinstance(result, str))
    rows = summarize(configs, plans, results)
    title = (f"ckptrun bench --failures {o.failures}: model {o.model}, {format_duration(o.duration_s())} per run, "
             f"median of {o.repeat}, {o.device}, {o.trainer_threads} trainer thread(s)")
    report.print_tables(table(rows, title, report.report_width(console, o.wide)), console)
    if o.json:
        doc = {"schema": SCHEMA, "command": o.command(), "wall_s": time.perf_counter() - t0,
               "settings": {**asdict(o), "model_args": plan.MODELS[o.model], "dir": str(root)},
               "machine": machine.describe(root),
               "schedules": {label: [{"source": s.source, "offsets": list(s.offsets)} for s in ss]
                             for label, ss in plans.items()},
               "configurations": rows}
        Path(o.json).write_text(json.dumps(doc, indent=2) + "\n")
    if o.plot:
        plot(rows, title, Path(o.plot))
    failed = any(isinstance(r, str) for rs in results.values() for r in rs)
    if failed:
        progress.print(f"ckptrun bench: some runs failed; their logs are kept under {root}")
        return 1
    if not o.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _write_traces(plans: dict[str, list[Schedule]], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for label, ss in plans.items():
        for r, s in enumerate(ss):
            s.write_trace(folder / f"failures-{label.replace(' ', '_').replace('/', '_')}-rep{r + 1}.txt")


def _line(result: Goodput | str) -> str:
    if isinstance(result, str):
        return f"FAILED: {result.splitlines()[0]}"
    lost = "-" if result.mean_lost is None else f"{result.mean_lost:.1f}"
    rec = "-" if result.mean_recovery_s is None else f"{result.mean_recovery_s:.2f} s"
    return (f"{result.useful_steps} useful steps, {result.goodput:.2f} steps/s, {result.failures} failures, "
            f"lost {lost} steps and {rec} each")


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return median(known) if known else None


def summarize(configs: list[plan.Configuration], plans: dict[str, list[Schedule]],
              results: dict[tuple[str, str], list[Goodput | str]]) -> list[dict[str, Any]]:
    """One row per (failure rate, configuration), baselines without failures first; medians over
    repetitions; `ratio` = goodput / the matching baseline's steps per second without failures."""
    reference = {c.name: c.name if c.kind == "baseline" else c.reference for c in configs}
    free = {c.name: _median([r.goodput for r in results.get((NO_FAILURES, c.name), []) if not isinstance(r, str)])
            for c in configs if c.kind == "baseline"}
    rows = []
    for label in [NO_FAILURES, *plans]:
        for c in configs:
            runs = results.get((label, c.name))
            if runs is None:
                continue
            ok = [r for r in runs if not isinstance(r, str)]
            good = _median([r.goodput for r in ok])
            base = free.get(reference[c.name])
            rows.append({"failures": label, "name": c.name, "kind": c.kind, "every": c.every,
                         "against": reference[c.name], "repetitions": len(ok),
                         "goodput": good, "ratio": good / base if good is not None and base else None,
                         "useful_steps": _median([r.useful_steps for r in ok]),
                         "kills": _median([r.failures for r in ok]),
                         "lost_steps_per_failure": _median([r.mean_lost for r in ok]),
                         "recovery_s_per_failure": _median([r.mean_recovery_s for r in ok]),
                         "restore_s_per_failure": _median([r.mean_restore_s for r in ok]),
                         "runs": [r if isinstance(r, str) else r.to_json() for r in runs],
                         "errors": [r for r in runs if isinstance(r, str)]})
    return rows


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: list[dict[str, Any]], title: str, width: int | None) -> list[RenderableType]:
    """The goodput table, fitted to `width` (report.tables), and a line per failed configuration."""
    columns = (Col("failures", key=True, justify="left"), Col("configuration", key=True, justify="left"),
               Col("every", 6), Col("goodput steps/s"), Col("vs no failures"), Col("against", 7, justify="left"),
               Col("useful steps", 3), Col("kills", 4), Col("steps lost/failure", 1), Col("recovery s/failure", 2),
               Col("of it restore s", 5))
    cells, failed = [], []
    for r in rows:
        if not r["repetitions"]:
            failed.append(f"{r['name']} ({r['failures']}) failed: {r['errors'][0].splitlines()[0]}")
            cells.append([r["failures"], r["name"], report.every_cell(r), "failed", *["-"] * 7])
            continue
        cells.append([r["failures"], r["name"], report.every_cell(r), _num(r["goodput"], ".2f"),
                      _num(r["ratio"], ".1%"), r["against"], _num(r["useful_steps"], ".0f"), _num(r["kills"], ".0f"),
                      _num(r["lost_steps_per_failure"], ".1f"), _num(r["recovery_s_per_failure"], ".2f"),
                      _num(r["restore_s_per_failure"], ".2f")])
    t, left_out = fit_table(columns, cells, width, title=title, title_justify="left")
    return [t, *([Text(left_out_line(left_out, report.HINT))] if left_out else []),
            *(Text(line, style="red") for line in failed)]


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    """Goodput against MTBF, a line per configuration; the baselines without failures dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rated = [r for r in rows if r["failures"] != NO_FAILURES and r["goodput"] is not None]
    for name in dict.fromkeys(r["name"] for r in rated):
        pts = sorted((_seconds(r["failures"]), r["goodput"]) for r in rated if r["name"] == name)
        pts = [p for p in pts if p[0] is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    for r in rows:
        if r["failures"] == NO_FAILURES and r["goodput"] is not None:
            ax.axhline(r["goodput"], linestyle="--", linewidth=0.8, color="0.4")
            ax.annotate(f"{r['name']}, no failures", (0.01, r["goodput"]), xycoords=("axes fraction", "data"),
                        fontsize=7, va="bottom")
    ax.set_xscale("log")
    ax.set_xlabel("MTBF (s)")
    ax.set_ylabel("goodput (useful steps/s)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _seconds(label: str) -> float | None:
    try:
        return parse_duration(label)
    except ValueError:
        return None  # a replayed trace has no MTBF to place it at
