"""Profiling for `ckptrun tune`: run the script under the real launcher for a short window and
measure every input of the models (DESIGN §6: nothing is assumed but the MTBF).

Each run is `python -m ckptrun run ... --max-steps WARMUP_STEPS+N` with its checkpoints in a
scratch folder under --dir (so the writes hit --dir's filesystem) and its metrics kept; the
first WARMUP_STEPS steps (imports, allocation) are not measured.

- one run per strategy with `--every` unset (a checkpoint every step). Its blocking cost δ of
  one checkpoint is the stall the trainer measured per step (snapshot copy, synchronous write),
  back-pressure excluded: that only says the interval is shorter than the persist path needs,
  which the CheckFreq bound rules out. Its writes give the time to persist one checkpoint.
- its slowdown: its step time (back-pressure excluded) minus the no-checkpoint step time of the
  same round, median over rounds [min-max]. Runs are interleaved in rounds (baseline, A, B, ...;
  as `ckptrun bench` does) so that a drift of the machine's load falls on both sides. A
  slowdown not above the noise, the spread (interquartile range) of the no-checkpoint steps
  about their round's median, narrowed by √rounds, is noise: reported as such and counted as 0, never below. While a
  strategy's stall and slowdown are both within the noise (another round could change its
  cost), another round of the baseline and those strategies runs, until --repeat-budget is
  spent. The cost the plan uses is δ = the larger of the stall and a slowdown above the noise
  (a background copy competing for the cores shows in the slowdown, not in the stall).
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
from statistics import median, quantiles
from typing import Any

from ..errors import CkptrunError, UsageError
from ..launcher.console.metrics_feed import MetricsTailer
from ..strategies import BASELINE
from .durations import format_duration

WARMUP_STEPS = 3
MIN_MEASURED = 2  # steps, after the warm-up, that a run must reach
MAX_ROUNDS = 8  # interleaved rounds at most, whatever the budget
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b:?")

__all__ = ["WARMUP_STEPS", "Costs", "Profile", "Slowdown", "StrategyCosts", "needs_repeat", "profile", "slowdown"]


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
class Slowdown:
    """A strategy's step time (back-pressure excluded) minus the no-checkpoint step time of the
    same round, over the rounds it ran in; `noise_s` is the spread of the no-checkpoint steps
    about their round's median (interquartile range) narrowed by √rounds: a slowdown not above
    it is noise."""

    median_s: float
    low_s: float
    high_s: float
    noise_s: float
    rounds: int

    @property
    def resolved(self) -> bool:
        """Above the noise: a cost. Within it, or negative (the load changed between runs): not."""
        return self.median_s > self.noise_s

    @property
    def cost_s(self) -> float:
        """What a plan may use: the slowdown when resolved, else 0 (never a negative cost)."""
        return self.median_s if self.resolved else 0.0

    def text(self) -> str:
        figure = (f"slowdown {self.median_s * 1e3:.1f} ms [{self.low_s * 1e3:.1f}, {self.high_s * 1e3:.1f}] over "
                  f"{self.rounds} round{'s' if self.rounds > 1 else ''}")
        if self.resolved:
            return f"{figure} (noise ±{self.noise_s * 1e3:.1f} ms)"
        why = "within noise" if self.median_s >= -self.noise_s else "negative: the load changed between runs"
        return f"{figure}: {why} (±{self.noise_s * 1e3:.1f} ms), counted as 0"


def slowdown(paired_s: list[float], baseline_spread_s: list[float]) -> Slowdown:
    """`paired_s`: per round, the strategy's median step minus that round's no-checkpoint median;
    `baseline_spread_s`: every no-checkpoint step measured so far minus its round's median (a
    drift between rounds falls on both sides of a pair, so it is no noise of the pairs)."""
    q1, q3 = _quartiles(baseline_spread_s)
    return Slowdown(median(paired_s), min(paired_s), max(paired_s), (q3 - q1) / len(paired_s) ** 0.5,
                    len(paired_s))


def needs_repeat(sd: Slowdown, stall_s: float) -> bool:
    """Another round could change the cost the plan uses (max(stall, resolved slowdown)): the
    slowdown is not resolved and the stall alone is within the noise too."""
    return not sd.resolved and stall_s <= sd.noise_s


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (0.0, 0.0)
    q1, _, q3 = quantiles(values, n=4, method="inclusive")  # (linear between the nearest ranks)
    return q1, q3


@dataclass(frozen=True)
class StrategyCosts:
    """What one strategy's runs measured (medians over their windows, all rounds)."""

    name: str
    step_s: float  # a step with a checkpoint every step
    delta_s: float  # cost of one checkpoint: the larger of the stall and a resolved slowdown (never < 0)
    stall_s: float  # the stall per step, back-pressure excluded
    slowdown: Slowdown  # against the no-checkpoint steps of the same rounds
    backpressure_s: float
    persist_s: float  # time to write one of its checkpoints
    checkpoints: int  # full checkpoints captured in a window (a diff strategy takes diffs between them)

    @property
    def slowdown_s(self) -> float:
        return self.slowdown.median_s


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
    # --every left unset: each strategy's own cadence (every step, its own intervals auto), which an
    # explicit --every 1 would pin to every step (Entry.explicit_every). No overhead budget: the
    # profile measures what a checkpoint every step costs; the plan keeps within --max-overhead.
    flags = ["--strategy", strategy, "--max-overhead", "off", "--max-steps", str(max_steps)]
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


def _stall(e: dict[str, Any]) -> float:
    return sum(v for c, v in e["stall_s"].items() if c != "backpressure")


def _no_checkpoint_steps(window: list[dict[str, Any]]) -> list[float]:
    """The baseline run's steps without their checkpoint stall: steps without checkpointing."""
    return [e["step_s"] - sum(e["stall_s"].values()) for e in window]


Runs = dict[str, list[tuple[_Run, list[dict[str, Any]]]]]  # per strategy: (run, window) of each round it ran in


def _strategy_costs(name: str, runs: Runs, baselines: list[float], rounds: dict[str, list[int]]) -> StrategyCosts:
    """One strategy's costs over every round it ran in so far: its slowdown against the
    no-checkpoint median of the same round (`baselines`), the noise from every no-checkpoint step."""
    mine = runs[name]
    window = [e for _, w in mine for e in w]
    bp = [e["stall_s"].get("backpressure", 0.0) for e in window]
    stall = max(median(_stall(e) for e in window), 1e-9)
    paired = [median(e["step_s"] - e["stall_s"].get("backpressure", 0.0) for e in w) - baselines[r]
              for (_, w), r in zip(mine, rounds[name], strict=True)]
    sd = slowdown(paired, [s - baselines[r] for (_, w), r in zip(runs[BASELINE], rounds[BASELINE],
                                                                 strict=True) for s in _no_checkpoint_steps(w)])
    writes = [w["write_s"] for run, _ in mine for w in run.writes if w["step"] > WARMUP_STEPS]
    if not writes:
        raise CkptrunError(f"profiling run {name!r} wrote no checkpoint; cannot measure its persist time")
    return StrategyCosts(name=name, step_s=median(e["step_s"] for e in window), delta_s=max(stall, sd.cost_s),
                         stall_s=stall, slowdown=sd, backpressure_s=median(bp), persist_s=median(writes),
                         checkpoints=sum(1 for e in mine[0][1] if e.get("last_snapshot_step") == e["step"]))


def profile(script: str, args: list[str], strategies: list[str], steps: int, ckpt_dir: str, mtbf_s: float,
            progress: Callable[[str], None], repeat_budget_s: float = 0.0) -> Profile:
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
    names = [BASELINE, *(s for s in strategies if s != BASELINE)]
    runs: Runs = {n: [] for n in names}
    baselines: list[float] = []  # each round's no-checkpoint median step
    rounds: dict[str, list[int]] = {n: [] for n in names}  # the rounds each strategy ran in
    took: dict[str, float] = {}  # seconds of each strategy's last run
    try:
        deadline = None
        for r in range(MAX_ROUNDS):
            if r == 0:
                todo = names
            else:
                if deadline is None:
                    deadline = time.monotonic() + repeat_budget_s
                todo = [n for n in names[1:]
                        if needs_repeat((sc := _strategy_costs(n, runs, baselines, rounds)).slowdown, sc.stall_s)]
                if not todo:
                    break
                todo = [BASELINE, *todo]
                if time.monotonic() + sum(took[n] for n in todo) >= deadline:
                    progress(f"within noise after {r} round{'s' if r > 1 else ''} ({', '.join(todo[1:])}); "
                             "--repeat-budget spent")
                    break
                progress(f"round {r + 1}: {', '.join(todo[1:])} within noise; measuring again, interleaved "
                         "with the baseline")
            for name in todo:
                if r == 0:
                    progress(f"{name}: a checkpoint every step, {total} steps")
                t0 = time.monotonic()
                run = _launch(name, total, script, args, scratch / f"round-{r + 1}")
                took[name] = time.monotonic() - t0
                window = _window(run, name)
                runs[name].append((run, window))
                rounds[name].append(r)
                if name == BASELINE:
                    baselines.append(median(_no_checkpoint_steps(window)))
                    if r == 0:
                        base = _baseline(run, window, mtbf_s, progress)
                if r == 0 or name != BASELINE:
                    sc = _strategy_costs(name, runs, baselines, rounds)
                    progress(f"{name}: blocking {sc.stall_s * 1e3:.2f} ms per checkpoint, persist "
                             f"{sc.persist_s * 1e3:.1f} ms (step {sc.step_s * 1e3:.1f} ms, {sc.slowdown.text()})")
        step_s = median(baselines)
        measured = [_strategy_costs(n, runs, baselines, rounds) for n in names if n in strategies]
        all_writes = [w for n in names for run, _ in runs[n] for w in run.writes]
        by_depth: dict[int, list[dict[str, Any]]] = {}
        for w in all_writes:
            by_depth.setdefault(max(1, int(w.get("queue_depth") or 1)), []).append(w)
        bw = {n: b for n, ws in sorted(by_depth.items()) if (b := _bandwidth(ws))}
        write_bps = bw.get(1) or _bandwidth(all_writes)
        optim_s, load_s, ckpt_bytes, record_s, diff_bytes = base
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


def _baseline(run: _Run, window: list[dict[str, Any]], mtbf_s: float,
              progress: Callable[[str], None]) -> tuple[float, float, int, float, int]:
    """From the first baseline run: (optimizer update, load time, checkpoint bytes, record open
    time, diff bytes); UsageError when the MTBF is shorter than a step."""
    step_s = median(_no_checkpoint_steps(window))
    if mtbf_s <= step_s:
        raise UsageError(f"the MTBF ({format_duration(mtbf_s)}) is shorter than one training step "
                         f"({format_duration(step_s)}): no step would ever finish; check --mtbf or --failure-log")
    optim_s = median(e["optim_s"] for e in window)
    load_s, ckpt_bytes, record_s = _load_time(run.ckpt_dir)
    diff_bytes = sum(e["param_bytes"] for e in run.events if e.get("type") == "optimizer" and e.get("rank", 0) == 0)
    progress(f"{BASELINE}: step without checkpointing {step_s * 1e3:.1f} ms (optimizer update "
             f"{optim_s * 1e3:.2f} ms), checkpoint {ckpt_bytes / 1e6:.2f} MB, load {load_s * 1e3:.1f} ms")
    return optim_s, load_s, ckpt_bytes, record_s, diff_bytes
