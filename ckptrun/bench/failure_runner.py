"""One run of `ckptrun bench --failures`: train for a wall-clock budget while the bench kills it
on a schedule, then read its timeline (`goodput.Timeline`).

Two failure modes (`--failures`):
- `worker`: a software failure. The training processes (ckptrun's workers) are SIGKILLed; the
  launcher restarts them and they resume, the engines (and what they hold) survive.
- `node`: a machine failure. The whole process tree (launcher, engines, workers) is SIGKILLed and
  the bench starts the same command again, as a job scheduler would on a replacement node (at
  once: the replacement's own delay is not the strategy's); it resumes from the directory.
A script without ckptrun (`none`, the references) has nothing that survives it: in both modes
it is killed whole and started again (the references from their newest save, `none` from step 0).

At the end of the budget a ckptrun run gets SIGTERM (it stops at the next step and hands over),
a script is killed; steps finished after the end are not counted either way.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import psutil

from ..launcher.console.metrics_feed import MetricsTailer
from ..restore.recovery import restorable
from ..storage.store import Store
from .failures import Schedule
from .goodput import Timeline
from .plan import Configuration, Workload, failure_launch
from .runner import LOG_TAIL_LINES, RunFailed, kill_tree

MODES = ("worker", "node")
WORKER_MODULE = "ckptrun.worker.bootstrap"
STEPS_CAP = 10_000_000  # the script's --steps: more than any budget reaches; the bench ends the run
STOP_GRACE_S = 30.0
POLL_S = 0.05


class _Run:
    """The launched process tree of one configuration, started again after a node failure."""

    def __init__(self, cfg: Configuration, work: Workload, run_dir: Path) -> None:
        self.cfg, self.work, self.run_dir = cfg, work, run_dir
        self.launches = 0
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        spec = failure_launch(self.cfg, self.work, self.run_dir, STEPS_CAP, again=self.launches > 0)
        self.launches += 1
        with (self.run_dir / f"log-{self.launches}.txt").open("w") as out:
            self.proc = subprocess.Popen(spec.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.run_dir, env=spec.env)

    def check_alive(self) -> None:
        """A run that ends by itself before the budget does has failed."""
        if self.proc is not None and self.proc.poll() is not None:
            log = self.run_dir / f"log-{self.launches}.txt"
            tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            raise RunFailed(f"{self.cfg.name} exited with code {self.proc.returncode} before the end of its "
                            f"budget; log {log}:\n" + "\n".join(tail))

    def workers(self) -> list[psutil.Process]:
        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []
        out = []
        for p in tree:
            try:
                if WORKER_MODULE in p.cmdline():
                    out.append(p)
            except psutil.Error:
                continue
        return out

    def kill(self, mode: str, until: float) -> float | None:
        """Fail the run now; the time of the kill (None: the budget ended first)."""
        if mode == "worker" and self.cfg.kind == "ckptrun":
            while time.time() < until:  # between a worker's death and its restart there is none to kill
                self.check_alive()
                procs = self.workers()
                if procs:
                    for p in procs:
                        try:
                            p.kill()
                        except psutil.Error:
                            continue
                    return time.time()
                time.sleep(POLL_S)
            return None
        kill_tree(self.proc)
        killed = time.time()
        self.start()
        return killed

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        if self.cfg.kind != "ckptrun":
            kill_tree(self.proc)
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)


def run_under_failures(cfg: Configuration, work: Workload, run_dir: Path, schedule: Schedule, mode: str) -> Timeline:
    """Launch `cfg`, kill it at the schedule's offsets (`mode`), end it after the schedule's
    duration; its timeline. Raises RunFailed (with the log's tail) when the run dies by itself."""
    run_dir.mkdir(parents=True)
    run = _Run(cfg, work, run_dir)
    launched = time.time()
    end = launched + schedule.duration_s
    kills: list[float] = []
    try:
        run.start()
        for offset in schedule.offsets:
            _wait_until(launched + offset, run)
            killed = run.kill(mode, end)
            if killed is not None:
                kills.append(killed)
        _wait_until(end, run)
    except BaseException:
        if run.proc is not None:
            kill_tree(run.proc)
        raise
    run.stop()
    timeline = Timeline(launched, end, kills, resumable=_resumable(cfg, run_dir / "ckpt")).read_timing(
        run_dir / "timing.jsonl")
    if cfg.kind == "ckptrun":
        timeline.restores += [float(e.get("restore_s") or 0.0) for e in MetricsTailer(run_dir / "metrics").poll()
                              if e.get("type") == "restart" and e.get("resume_step")]
    return timeline


def _resumable(cfg: Configuration, ckpt: Path) -> int:
    """The newest step a restart of `cfg` would resume from: ckptrun's newest committed step, a
    reference's newest save (its files are named by step), 0 for a run without checkpoints."""
    if cfg.kind == "ckptrun":
        return max(restorable(Store(ckpt)), default=0) if ckpt.is_dir() else 0
    names = [p.name.split(".")[0].removeprefix("step-") for p in ckpt.glob("step-*")] if ckpt.is_dir() else []
    return max((int(n) for n in names if n.isdigit()), default=0)


def _wait_until(t: float, run: _Run) -> None:
    while (left := t - time.time()) > 0:
        run.check_alive()
        time.sleep(min(POLL_S, left))
