"""Run one configuration once and time its recovery (see `plan.launch`): ckptrun runs crash
and restart in one launch; the references run a second time from their newest save. Memory is
sampled while the training run runs.

A run that fails or hangs is reported with the tail of its log, not raised: one broken
configuration must not cost the figures of the others.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from ..errors import CkptrunError
from ..launcher.console.metrics_feed import MetricsTailer
from . import figures
from .figures import RunFigures
from .plan import Configuration, Launch, Workload, launch
from .proccpu import CpuTrace
from .procmem import Memory, PeakMemory

LOG_TAIL_LINES = 15


@dataclass
class Outcome:
    figures: RunFigures | None
    error: str | None
    wall_s: float
    params: int | None = None  # parameters of the model trained
    load_1m: float | None = None  # the machine's 1-minute load average when the run ended

    def to_json(self) -> dict:
        """A run as the JSON lists it: its figures (or its error), its wall time and the load."""
        result = self.figures.to_json() if self.figures else {"error": self.error}
        return {**result, "wall_s": self.wall_s, "load_1m": self.load_1m}


class RunFailed(CkptrunError):
    pass


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill the run we started and every process it started, by pid."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        kids = []
    for p in [*kids, proc]:
        try:
            p.kill()
        except (psutil.Error, ProcessLookupError):
            continue
    proc.wait()


def _execute(spec: Launch, log: Path, cwd: Path, timeout_s: float, *, include_root: bool
             ) -> tuple[Memory, CpuTrace]:
    """Run to completion with the output in `log`; returns its memory peaks and CPU times."""
    with log.open("w") as out:
        proc = subprocess.Popen(spec.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd,
                                env=spec.env)
        sampler = PeakMemory(proc.pid, include_root=include_root).start()
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            rc = None
        except BaseException:  # Ctrl-C: leave no run behind
            kill_tree(proc)
            raise
        finally:
            mem = sampler.stop()
    if rc != 0:
        what = f"timed out after {timeout_s:.0f} s" if rc is None else f"exited with code {rc}"
        raise RunFailed(f"{' '.join(spec.argv[:6])} ... {what}; log {log}:\n{log_tail(log)}")
    return mem, sampler.cpu


def log_tail(log: Path) -> str:
    """The last lines of a run's log."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])


def _ckptrun_run(cfg: Configuration, work: Workload, run_dir: Path, steps: int, warmup: int,
                 timeout_s: float) -> tuple[RunFigures, int]:
    spec = launch(cfg, work, run_dir, steps)
    mem, cpu = _execute(spec, run_dir / "log.txt", run_dir, timeout_s, include_root=False)
    first = figures.attempts(run_dir / "timing.jsonl")[0]
    result = figures.ckptrun_figures(first, run_dir / "metrics", warmup, mem, cpu)
    if spec.crash_step is not None:
        figures.ckptrun_recovery(result, MetricsTailer(run_dir / "metrics").poll(), required=cfg.every is not None)
    return result, first.params


def _script_run(cfg: Configuration, work: Workload, run_dir: Path, steps: int, warmup: int,
                timeout_s: float, recover: bool = True) -> tuple[RunFigures, int]:
    mem, cpu = _execute(launch(cfg, work, run_dir, steps), run_dir / "log.txt", run_dir, timeout_s,
                        include_root=True)
    first = figures.attempts(run_dir / "timing.jsonl")[0]
    result = figures.reference_figures(first, warmup, mem, cpu, saving=cfg.kind == "reference")
    last = max((s["step"] for s in first.saves), default=None)
    if last is not None and recover:
        _execute(launch(cfg, work, run_dir, last + 1, recovery=True), run_dir / "log-recovery.txt", run_dir,
                 timeout_s, include_root=True)
        recovery = figures.attempts(run_dir / "timing.jsonl")[-1].recovery
        if recovery is None:
            raise RunFailed(f"the recovery run in {run_dir} did not restore step {last}")
        result.recovery_s, result.setup_s, result.restore_s = (recovery["recovery_s"], recovery.get("setup_s"),
                                                               recovery.get("restore_s"))
    return result, first.params


def run_configuration(cfg: Configuration, work: Workload, run_dir: Path, steps: int, warmup: int,
                      timeout_s: float, *, recover: bool = True) -> Outcome:
    """Train `steps` steps under `cfg` and time its recovery (a script's: not unless `recover`);
    the run's files are removed afterwards unless it failed (its logs stay for reading)."""
    t0 = time.perf_counter()
    run_dir.mkdir(parents=True)
    try:
        if cfg.kind == "ckptrun":
            result, params = _ckptrun_run(cfg, work, run_dir, steps, warmup, timeout_s)
        else:
            result, params = _script_run(cfg, work, run_dir, steps, warmup, timeout_s, recover)
    except CkptrunError as e:
        return Outcome(None, str(e), time.perf_counter() - t0, load_1m=load_1m())
    shutil.rmtree(run_dir, ignore_errors=True)
    return Outcome(result, None, time.perf_counter() - t0, params, load_1m())


def load_1m() -> float | None:
    """The machine's 1-minute load average (None where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None
