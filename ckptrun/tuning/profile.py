"""Profiling for `ckptrun tune`: run the script under the real launcher for a short window and
measure every input of the models (DESIGN §6: nothing is assumed but the MTBF).

Each run is `python -m ckptrun run ... --max-steps WARMUP_STEPS+N` with its checkpoints in a
scratch folder under --dir (so the writes hit --dir's filesystem) and its metrics kept; the
first WARMUP_STEPS steps (imports, allocation) are not measured.

- one run per strategy with `--every` unset (a checkpoint every step). Its blocking cost δ of
  one checkpoint is the stall the trainer measured per step (snapshot copy, synchronous write),
  back-pressure excluded: that only says the interval is shorter than the persist path needs,
  which the CheckFreq bound rules out. Its writes give the time to persist one checkpoint. The
  slowdown of its steps against the baseline is reported too, not used: across runs on a shared
  machine it is mostly noise.
- the `sync` run is the baseline (it is profiled even when not asked for, and then not planned):
  nothing runs beside its training, so step time − stall is the step time t without
  checkpointing, measured in the same process. It also gives the optimizer's own update time and
  the bytes of the optimized parameters (one step's dense gradient, the diff size D); its newest
  checkpoint gives the full checkpoint size S, and loading it back as `ckptrun restore` does
  (find + verify + read) gives R_F.
- write bandwidth W: bytes / write time over writes that ran alone (engine queue depth 1);
  PCcheck's T_w(N): S over the bandwidth of writes that finished with N in flight.
- r (replay of one recorded step) = reading D at the load bandwidth S/R_F + one optimizer
  update. An approximation: the optimizer update measured around `optimizer.step()` stands in
  for applying one recorded gradient (a resumed lowdiff worker measures its real replay).
- R_D (the per-record part of a diff record's replay) = opening that newest checkpoint's
  record again: manifest, index and every check before its data is read.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from ..errors import CkptrunError, UsageError
from ..launcher.console.metrics_feed import MetricsTailer
from .durations import format_duration

WARMUP_STEPS = 3
MIN_MEASURED = 2  # steps, after the warm-up, that a run must reach
BASELINE_STRATEGY = "sync"
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b:?")

__all__ = ["WARMUP_STEPS", "Costs", "Profile", "StrategyCosts", "profile"]


@dataclass(frozen=True)
class Costs:
    """Strategy-independent measurements (seconds, bytes, bytes per second)."""

    step_s: float  # t: one training step without checkpointing
    optim_s: float  # the optimizer's own update within it
    ckpt_bytes: int  # S: one full checkpoint of this rank
    diff_bytes: int  # D: one step's dense gradient = bytes of the optimized parameters
    write_Bps: float  # W: write bandwidth of --dir's filesystem
    load_s: float  # R_F: find, verify and read the newest full checkpoint
    replay_s: float  # r: read and apply one step's diff
    record_s: float  # R_D: open one record (manifest, index, checks), whatever its length
    free_bytes: int  # free space on --dir's filesystem (PCcheck's storage budget)
    write_s_by_inflight: dict[int, float]  # T_w(N): a full checkpoint's write time with N in flight


@dataclass(frozen=True)
class StrategyCosts:
    """What one strategy's run measured (medians over its window)."""

    name: str
    step_s: float  # a step with a checkpoint every step
    delta_s: float  # blocking cost of one checkpoint: the stall per step, back-pressure excluded
    slowdown_s: float  # step time − back-pressure − baseline step time (information; noisy)
    backpressure_s: float
    persist_s: float  # time to write one of its checkpoints
    checkpoints: int  # full checkpoints captured in the window (a diff strategy takes diffs between them)


@dataclass(frozen=True)
class Profile:
    script: str
    args: list[str]
    dir: str
    steps: int  # steps measured per run
    costs: Costs
    strategies: list[StrategyCosts]


@dataclass
class _Run:
    steps: list[dict[str, Any]]
    writes: list[dict[str, Any]]
    events: list[dict[str, Any]]
    ckpt_dir: Path


def _failure_line(output: str) -> str:
    """The line of a failed run's output that says what went wrong (an exception, if any)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line) and "ChildFailedError" not in line:
            return line
    for line in reversed(lines):
        if line.startswith("ckptrun: error:"):
            return line.removeprefix("ckptrun: error:").strip()
    return lines[-1] if lines else "no output"


def _launch(strategy: str, max_steps: int, script: str, args: list[str], scratch: Path) -> _Run:
    """One profiling run (a checkpoint every step) through the real launcher; CkptrunError with the
    script's error if it fails."""
    base = scratch / strategy
    ckpt_dir, metrics_dir = base / "ckpts", base / "metrics"
    base.mkdir(parents=True)
    # --every left unset: each strategy's own cadence (every step; lowdiff+'s persist interval and
    # gockpt's spread auto), which an explicit --every 1 would pin to every step.
    flags = ["--strategy", strategy, "--max-steps", str(max_steps)]
    cmd = [sys.executable, "-m", "ckptrun", "run", *flags, "--no-resume", "--dir", str(ckpt_dir),
           "--metrics-dir", str(metrics_dir), script, *args]
    with open(base / "output.log", "wb") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if rc != 0:
        line = _failure_line((base / "output.log").read_text(errors="replace"))
        raise CkptrunError(f"profiling run {strategy!r} failed (exit code {rc}): {line}; to see its whole output "
                           f"run: ckptrun {shlex.join([*flags, script, *args])}")
    events = MetricsTailer(metrics_dir).poll()
    return _Run([e for e in events if e.get("type") == "step" and e.get("rank", 0) == 0],
                [e for e in events if e.get("type") == "write" and e.get("rank", 0) == 0], events, ckpt_dir)


def _window(run: _Run, strategy: str) -> list[dict[str, Any]]:
    measured = [e for e in run.steps if e["step"] > WARMUP_STEPS]
    if len(measured) < MIN_MEASURED:
        raise CkptrunError(
            f"profiling run {strategy!r}: the script took only {len(run.steps)} optimizer step(s); tune measures "
            f"{WARMUP_STEPS} warm-up steps plus at least {MIN_MEASURED}; let the script run longer (its own "
            "arguments) or lower --profile-steps")
    return measured


def _load_time(ckpt_dir: Path) -> tuple[float, int, float]:
    """(seconds to find, verify and read the newest committed step as a restart does, its bytes per
    rank, seconds to open its record again without reading the data: median of 3)."""
    import os

    from ..restore.recovery import find, load_state
    from ..storage.store import Store

    store = Store(ckpt_dir)
    t0 = time.perf_counter()
    plan = find(store, "latest")
    load_state(store, plan, 0)
    load_s = time.perf_counter() - t0
    opens = []
    for _ in range(3):
        t0 = time.perf_counter()
        fresh = Store(ckpt_dir)
        os.close(fresh.open_rank(fresh.manifest(plan.base.name), 0)[1])
        opens.append(time.perf_counter() - t0)
    return load_s, plan.base.bytes // plan.base.world_size, median(opens)


def _bandwidth(writes: list[dict[str, Any]]) -> float | None:
    seconds = sum(w["write_s"] for w in writes)
    return sum(w["bytes"] for w in writes) / seconds if seconds > 0 else None


def _strategy_costs(name: str, run: _Run, window: list[dict[str, Any]], step_s: float) -> StrategyCosts:
    bp = [e["stall_s"].get("backpressure", 0.0) for e in window]
    stall = [sum(v for c, v in e["stall_s"].items() if c != "backpressure") for e in window]
    slowdown = median(e["step_s"] - b for e, b in zip(window, bp, strict=True)) - step_s
    ckpts = sum(1 for e in window if e.get("last_snapshot_step") == e["step"])
    writes = [w["write_s"] for w in run.writes if w["step"] > WARMUP_STEPS]
    if not writes:
        raise CkptrunError(f"profiling run {name!r} wrote no checkpoint; cannot measure its persist time")
    return StrategyCosts(name=name, step_s=median(e["step_s"] for e in window),
                         delta_s=max(median(stall), 1e-9), slowdown_s=slowdown,
                         backpressure_s=median(bp), persist_s=median(writes), checkpoints=ckpts)


def profile(script: str, args: list[str], strategies: list[str], steps: int, ckpt_dir: str, mtbf_s: float,
            progress: Callable[[str], None]) -> Profile:
    """Measure `script` (run with `args`) for `steps` steps per run; see the module docstring.

    The MTBF is checked against the measured step time right after the baseline (fail early)."""
    root = Path(ckpt_dir)
    created = not root.exists()
    try:
        root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".ckptrun-tune-", dir=root))
    except OSError as e:
        raise UsageError(f"cannot write into --dir {ckpt_dir} ({e.strerror}); pass --dir with a writable path "
                         "on the storage you will checkpoint to") from None
    total = WARMUP_STEPS + steps
    try:
        measured, all_writes = [], []
        for name in [BASELINE_STRATEGY, *(s for s in strategies if s != BASELINE_STRATEGY)]:
            progress(f"{name}: a checkpoint every step, {total} steps")
            run = _launch(name, total, script, args, scratch)
            window = _window(run, name)
            if name == BASELINE_STRATEGY:
                step_s = median(e["step_s"] - sum(e["stall_s"].values()) for e in window)
                if mtbf_s <= step_s:
                    raise UsageError(f"the MTBF ({format_duration(mtbf_s)}) is shorter than one training step "
                                     f"({format_duration(step_s)}): no step would ever finish; check --mtbf or "
                                     "--failure-log")
                optim_s = median(e["optim_s"] for e in window)
                load_s, ckpt_bytes, record_s = _load_time(run.ckpt_dir)
                diff_bytes = sum(e["param_bytes"] for e in run.events
                                 if e.get("type") == "optimizer" and e.get("rank", 0) == 0)
                progress(f"{name}: step without checkpointing {step_s * 1e3:.1f} ms (optimizer update "
                         f"{optim_s * 1e3:.2f} ms), checkpoint {ckpt_bytes / 1e6:.2f} MB, load {load_s * 1e3:.1f} ms")
            sc = _strategy_costs(name, run, window, step_s)
            progress(f"{name}: blocking {sc.delta_s * 1e3:.2f} ms per checkpoint, persist {sc.persist_s * 1e3:.1f} ms "
                     f"(step {sc.step_s * 1e3:.1f} ms, slowdown {sc.slowdown_s * 1e3:.1f} ms)")
            if name in strategies:
                measured.append(sc)
            all_writes += run.writes
        by_depth: dict[int, list[dict[str, Any]]] = {}
        for w in all_writes:
            by_depth.setdefault(max(1, int(w.get("queue_depth") or 1)), []).append(w)
        bw = {n: b for n, ws in sorted(by_depth.items()) if (b := _bandwidth(ws))}
        write_bps = bw.get(1) or _bandwidth(all_writes)
        costs = Costs(step_s=step_s, optim_s=optim_s, ckpt_bytes=ckpt_bytes, diff_bytes=diff_bytes,
                      write_Bps=write_bps, load_s=load_s, replay_s=load_s * diff_bytes / ckpt_bytes + optim_s,
                      record_s=record_s,
                      free_bytes=shutil.disk_usage(root).free,
                      write_s_by_inflight={n: ckpt_bytes / b for n, b in bw.items()})
        return Profile(script=script, args=list(args), dir=str(root), steps=steps, costs=costs, strategies=measured)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if created and not any(root.iterdir()):
            root.rmdir()
