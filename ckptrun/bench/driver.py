"""`ckptrun bench`: every configuration, interleaved (A B C A B C ...), R times; then the report.

Interleaving spreads slow drifts of the machine (other load, page cache, thermal) over all
configurations alike instead of charging them to whichever ran last.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console

from ..storage import iowriter
from . import budget, machine, netns, plan, report, stats
from .failure_driver import run_failure_bench
from .nodes import PORT, run_on_nodes
from .options import BenchOptions
from .progress import RunProgress
from .runner import Outcome, run_configuration


def run_bench(o: BenchOptions, console: Console | None = None, progress: Console | None = None) -> int:
    """Run the bench; returns the exit code (1 when a configuration failed)."""
    console = console or Console(highlight=False)
    progress = progress or Console(stderr=True, highlight=False)
    o.validate()
    if o.failures:
        return run_failure_bench(o, console, progress)
    configs = plan.configurations(o.strategies, o.every, o.io_engine, o.durable, nodes=o.nodes, replicas=o.replicas,
                                  max_overhead=o.max_overhead, host_memory=o.host_memory)
    if o.plot:
        report.require_matplotlib()
    work = plan.Workload(plan.example_script(), o.model, o.device, o.trainer_threads)
    root = Path(o.dir) if o.dir else machine.default_dir()
    root.mkdir(parents=True, exist_ok=True)
    desc = {**machine.describe(root), "io_engine": iowriter.availability()}
    fs = desc["dir_filesystem"]["type"]
    if fs in machine.MEMORY_FILESYSTEMS:
        progress.print(f"ckptrun bench: warning: {root} is in memory ({fs}); the figures leave out disk writes")
    on = f", on {o.nodes} nodes" if o.nodes > 1 else ""
    progress.print(f"ckptrun bench: {len(configs)} configurations x {o.repeat} repetitions, {o.steps} steps "
                   f"each, model {o.model}{on}, in {root}")
    if timed := o.first_checkpoint_timed():
        n = max(timed)
        progress.print(f"ckptrun bench: note: at --every {n} the first checkpoint's one-time costs (staging "
                       f"memory allocated, first touched, page-locked) count in the figures; --warmup {n} "
                       "leaves them out")
    t0 = time.perf_counter()
    configs, calibration = budget.calibrate(configs, work, root, o.warmup, o.budget(), o.run_timeout_s(), progress)
    with netns.node_pair() if o.nodes > 1 else contextlib.nullcontext() as pair:
        outcomes = _interleaved(o, configs, work, root, progress, pair)
    wall = time.perf_counter() - t0
    desc["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    rows = stats.summarize(configs, outcomes, tuple(o.mtbf_s()))
    runs = f"median of {o.repeat}" if o.repeat > 1 else "1 run each (--repeat 3 for medians and ranges)"
    title = (f"ckptrun bench: model {o.model}{on}, {o.steps} steps (first {o.warmup} untimed), {runs}, {o.device}, "
             f"{o.trainer_threads} trainer thread(s), dir on {fs}, writer {o.io_engine} ({desc['io_engine']})")
    width = report.report_width(console, o.wide)
    report.print_tables([*report.tables(rows, title, width),
                         *report.budget_tables(rows, o.budget(), calibration, width)], console)
    params = next((out.params for runs in outcomes.values() for out in runs if out.params), None)
    settings = {**asdict(o), "model_args": plan.MODELS[o.model], "params": params, "dir": str(root),
                "budget": o.budget(), "calibration": calibration.to_json() if calibration else None}
    if o.json:
        report.write_json(report.document(settings, desc, rows, o.command(), wall), Path(o.json))
    if o.plot:
        report.plot(rows, title, Path(o.plot))
    if any(out.error for runs in outcomes.values() for out in runs):
        progress.print(f"ckptrun bench: some runs failed; their logs are kept under {root}")
        return 1
    if not o.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _interleaved(o: BenchOptions, configs: list[plan.Configuration], work: plan.Workload, root: Path,
                 progress: Console, pair: tuple[netns.Node, netns.Node] | None) -> dict[str, list[Outcome]]:
    """Every configuration once per round, `repeat` rounds, on one node or on `pair`; their
    progress shown (RunProgress)."""
    outcomes: dict[str, list[Outcome]] = {c.name: [] for c in configs}
    with RunProgress(progress, len(configs) * o.repeat) as shown:
        for rep in range(o.repeat):
            for i, cfg in enumerate(configs):
                shown.running(f"{cfg.name} ({rep + 1}/{o.repeat})")
                run_dir = root / f"run-{os.getpid()}-r{rep}-{i:02d}-{cfg.name.replace('@', '-every-')}"
                out = (run_configuration(cfg, work, run_dir, o.steps, o.warmup, o.run_timeout_s()) if pair is None
                       else run_on_nodes(cfg, work, run_dir, o.steps, o.warmup, o.run_timeout_s(), pair,
                                         PORT + (rep * len(configs) + i) % 100))
                outcomes[cfg.name].append(out)
                shown.done(f"{cfg.name} (repetition {rep + 1}): {_line(out)}", failed=out.figures is None)
    return outcomes


def _line(out: Outcome) -> str:
    if out.figures is None:
        return f"FAILED: {out.error}"
    f = out.figures
    recovery = "-" if f.recovery_s is None else f"{f.recovery_s:.2f} s"
    return (f"{f.step_s * 1e3:.1f} ms/step, stall {f.stall_ms_per_step:.1f} ms/step, "
            f"{f.bytes_per_step / 1e6:.1f} MB/step, recovery {recovery} ({out.wall_s:.0f} s)")
