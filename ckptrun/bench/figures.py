"""The figures of one run, from the files it leaves behind: the example script's timing file
(`--timing-json`, every configuration) and, for ckptrun runs, the workers' and engines' metrics.

Step time and stall are averaged over the timed steps: all but the first `warmup` steps of the
run (one-time costs such as the allocation, first touch and page-locking of staging memory at
the first checkpoint are left out of every configuration alike, where the warm-up covers the
first checkpoint: at --every N, N steps or more). Bytes and write bandwidth count the
checkpoints of those same steps, and so does the CPU time per process role (`proccpu`): the
trainer's, the engine's, the launcher's, from the first timed step's start to the last one's end.
The freshness of the timed steps is bench/freshness.py's; a ckptrun run's own word on its
overhead budget is its worker's `budget` events (verdict `over`: its strategy cannot keep within
the budget) and its last `overhead` event before a restart (the overhead it measured).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

from ..errors import CkptrunError
from ..launcher.console.metrics_feed import MetricsTailer
from .freshness import Freshness, saves_freshness, worker_freshness
from .proccpu import CpuTrace
from .procmem import Memory

# Per-run figures, in report order (the summary's `median_step_s` is the median of `step_s`).
FIGURES = ("step_s", "compute_s", "stall_ms_per_step", "layer_wait_ms_per_step", "trainer_cpu_ms_per_step",
           "engine_cpu_ms_per_step", "launcher_cpu_ms_per_step", "bytes_per_step", "shipped_per_step", "write_MBps",
           "effective_MBps", "peak_rss_MB", "peak_MB", "staging_MB", "page_cache_MB", "committed", "recovery_s",
           "setup_s", "restore_s", "own_overhead", "own_budget", "fresh_memory_median", "fresh_memory_max",
           "fresh_disk_median", "fresh_disk_max", "fresh_restorable_mean", "fresh_disk_mean")


@dataclass
class RunFigures:
    step_s: float
    stall_ms_per_step: float
    bytes_per_step: float
    write_MBps: float | None  # None: nothing written in the timed steps
    peak_rss_MB: float  # RSS summed over the run's processes (shared staging once per process)
    committed: int
    peak_MB: float | None = None  # memory the run holds: shared staging counted once (bench/procmem.py)
    staging_MB: float | None = None  # of it, the shared-memory staging alone
    recovery_s: float | None = None  # None: nothing to recover from (no checkpoint)
    # Of recovery_s: the restart (process start and the script's set-up until its first optimizer
    # exists) and the state restore (ckptrun's decide, read, validate, load, replay; the script's
    # own load for the references). The rest is the first resumed step.
    setup_s: float | None = None
    restore_s: float | None = None
    # The part of the stall that updates waited for their own layer's copy (lightcheck); None: no such cause
    layer_wait_ms_per_step: float | None = None
    page_cache_MB: float | None = None  # the machine's page-cache growth during the run (bench/procmem.py)
    io_engine: str | None = None  # the engine's file writer that ran (native, python); None: not a ckptrun run
    # The script's forward, backward and gradient clipping per step (the work before optimizer.step(),
    # ckptrun's gradient hooks included): how much a background copy or the engine slows compute
    compute_s: float | None = None
    # CPU time (user + system) per timed step of each process role (bench/proccpu.py); launcher: None
    # when the bench started the trainer itself (no launcher)
    trainer_cpu_ms_per_step: float | None = None
    engine_cpu_ms_per_step: float | None = None
    launcher_cpu_ms_per_step: float | None = None
    # `bench --nodes 2` with --replicas: bytes of the copies rank 0's engine shipped to its partners per
    # timed step (bench/nodes.py); None: no copies
    shipped_per_step: float | None = None
    # Effective checkpoint throughput (DataStates-LLM's headline): checkpoint bytes written per second the
    # trainer was blocked for them; None: nothing written, or no measurable blocking
    effective_MBps: float | None = field(init=False, default=None)
    # Stall per timed step by cause (ms; ckptrun's worker's causes, `save` for a script's own saves)
    stall_by_cause: dict[str, float] | None = None
    # The run's own overhead (fraction of its no-checkpoint step) and budget from its last `overhead` event
    own_overhead: float | None = None
    own_budget: float | None = None
    budget_over: dict | None = None  # the run's first `budget` event with verdict `over`, if any
    # bench/freshness.py: steps from each timed step to the newest in memory / on disk (median, max), and the
    # means a failure loses resuming from memory or disk / from disk alone; None: no such tier, or no run
    fresh_memory_median: float | None = None
    fresh_memory_max: int | None = None
    fresh_disk_median: float | None = None
    fresh_disk_max: int | None = None
    fresh_restorable_mean: float | None = None
    fresh_disk_mean: float | None = None
    nothing_on_disk: bool = False  # no step reached the disk by the last timed step: freshness and waste understated

    def __post_init__(self) -> None:
        if self.bytes_per_step > 0 and self.stall_ms_per_step > 1e-3:
            self.effective_MBps = self.bytes_per_step / 1e6 / (self.stall_ms_per_step / 1e3)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def set_freshness(self, f: Freshness) -> RunFigures:
        self.fresh_memory_median, self.fresh_memory_max = f.memory_median, f.memory_max
        self.fresh_disk_median, self.fresh_disk_max = f.disk_median, f.disk_max
        self.fresh_restorable_mean, self.fresh_disk_mean = f.restorable_mean, f.disk_mean
        self.nothing_on_disk = f.nothing_on_disk
        return self


@dataclass
class Attempt:
    """One process's part of the example script's timing file (`--timing-json`, JSON lines)."""

    start_step: int
    params: int
    pid: int | None = None  # the process that trained
    steps: list[dict] = field(default_factory=list)
    saves: list[dict] = field(default_factory=list)
    recovery: dict | None = None  # the script's `recovery` event (the references' resume), if any

    def window(self, warmup: int) -> tuple[list[dict], int, int]:
        """The timed steps, and the step numbers that bound them (first, last)."""
        timed = self.steps[warmup:]
        if not timed:
            raise CkptrunError(f"the run recorded {len(self.steps)} steps, none after the {warmup} warm-up steps")
        return timed, timed[0]["step"], timed[-1]["step"]


def attempts(path: Path) -> list[Attempt]:
    """Every process that wrote to the timing file, in order (a killed one may end mid-line)."""
    try:
        events = [json.loads(line) for line in path.read_text().split("\n")[:-1]]
    except (OSError, ValueError) as e:
        raise CkptrunError(f"the run left no readable timing file {path}: {e}") from None
    out: list[Attempt] = []
    for e in events:
        if e["event"] == "start":
            out.append(Attempt(e["start_step"], e["params"], e.get("pid")))
        elif e["event"] == "step":
            out[-1].steps.append(e)
        elif e["event"] == "save":
            out[-1].saves.append(e)
        elif e["event"] == "recovery":
            out[-1].recovery = e
    if not out:
        raise CkptrunError(f"the run wrote nothing to its timing file {path}")
    return out


def _io(writes: list[tuple[int, int, float]], first: int, last: int) -> tuple[int, float | None]:
    """(bytes, MB/s) of the writes (step, bytes, seconds) of steps first..last."""
    inside = [(b, s) for step, b, s in writes if first <= step <= last]
    nbytes, seconds = sum(b for b, _ in inside), sum(s for _, s in inside)
    return nbytes, (nbytes / seconds / 1e6 if seconds > 0 else None)


def _memory(mem: Memory) -> dict[str, float]:
    return {"peak_rss_MB": mem.peak_rss_MB, "peak_MB": mem.peak_MB, "staging_MB": mem.staging_MB,
            "page_cache_MB": mem.page_cache_MB}


def _compute_and_cpu(timed: list[dict], trainer_pid: int | None, cpu: CpuTrace) -> dict[str, float | None]:
    """The timed steps' mean forward+backward time and each role's CPU ms per step."""
    start, end = timed[0]["t"] - timed[0]["wall_s"], timed[-1]["t"]
    roles = cpu.per_role(trainer_pid, start, end) if trainer_pid is not None else {}
    return {"compute_s": fmean(s["compute_s"] for s in timed),
            **{f"{role}_cpu_ms_per_step": None if roles.get(role) is None else 1e3 * roles[role] / len(timed)
               for role in ("trainer", "engine", "launcher")}}


def reference_figures(timing: Attempt, warmup: int, mem: Memory, cpu: CpuTrace, *, saving: bool = False
                      ) -> RunFigures:
    """`none` and the references (`saving`): everything is in the script's timing file."""
    timed, first, last = timing.window(warmup)
    nbytes, mbps = _io([(s["step"], s["bytes"], s["write_s"]) for s in timing.saves], first, last)
    stall = 1e3 * fmean(s["stall_s"] for s in timed)
    result = RunFigures(step_s=fmean(s["wall_s"] for s in timed), stall_ms_per_step=stall,
                        bytes_per_step=nbytes / len(timed), write_MBps=mbps, committed=len(timing.saves),
                        **_memory(mem), **_compute_and_cpu(timed, timing.pid, cpu),
                        stall_by_cause={"save": stall} if saving else None)
    return result.set_freshness(saves_freshness(timed, timing.saves)) if saving else result


def ckptrun_figures(timing: Attempt, metrics_dir: Path, warmup: int, mem: Memory, cpu: CpuTrace) -> RunFigures:
    """ckptrun runs: step time from the script, stall from the worker (per cause, and summed),
    bytes and write time from the engine's `write` events, commits from its `commit` events (up
    to the last timed step: the restarted worker's own are not counted), the writer from
    `io_engine`, freshness and the run's word on its budget from the worker (module docstring).
    A step redone by the restarted worker keeps its first record."""
    timed, first, last = timing.window(warmup)
    events = MetricsTailer(metrics_dir).poll()
    steps: dict[int, dict[str, float]] = {}
    for e in events:
        if e.get("type") == "step":
            steps.setdefault(e["step"], e["stall_s"])
    missing = [s["step"] for s in timed if s["step"] not in steps]
    if missing:
        raise CkptrunError(f"ckptrun's worker metrics in {metrics_dir} lack steps {missing[:5]}")
    causes = {c: 1e3 * fmean(steps[s["step"]].get(c, 0.0) for s in timed) for c in
              dict.fromkeys(c for s in timed for c in steps[s["step"]])}
    nbytes, mbps = _io([(e["step"], e["bytes"], e["write_s"]) for e in events if e.get("type") == "write"],
                       first, last)
    result = RunFigures(step_s=fmean(s["wall_s"] for s in timed), stall_ms_per_step=sum(causes.values()),
                        bytes_per_step=nbytes / len(timed), write_MBps=mbps, **_memory(mem),
                        **_compute_and_cpu(timed, timing.pid, cpu),
                        io_engine=next((str(e["engine"]) for e in events if e.get("type") == "io_engine"), None),
                        committed=sum(1 for e in events if e.get("type") == "commit" and e["step"] <= last),
                        layer_wait_ms_per_step=causes.get("layer_wait"), stall_by_cause=causes,
                        **_budget(events))
    return result.set_freshness(worker_freshness(events, first, last))


def _budget(events: list[dict]) -> dict[str, Any]:
    """The run's first `budget` event with verdict `over`, and its last `overhead` event's
    overhead and budget before the first restart (the restarted worker's own are not timed)."""
    restart = next((i for i, e in enumerate(events) if e.get("type") == "restart"), len(events))
    said = [e for e in events[:restart] if e.get("type") == "overhead" and e.get("overhead") is not None]
    last = said[-1] if said else {}
    return {"budget_over": next((e for e in events if e.get("type") == "budget" and e.get("verdict") == "over"),
                                None),
            "own_overhead": last.get("overhead"), "own_budget": last.get("budget")}


def ckptrun_recovery(result: RunFigures, events: list[dict], *, required: bool = True) -> dict:
    """Set `result`'s recovery figures from the restarted worker's `restart` event among its
    metrics `events`: its start to the end of its first resumed step, and of it the restart (its
    set-up until the first optimizer exists) and the state restore. Returns the event. A worker
    that started over from step 0 is an error when a step to resume from was `required`; else
    (a strategy at its defaults, whose budget may space its checkpoints beyond a short run) the
    recovery is left unmeasured (None)."""
    restarts = [e for e in events if e.get("type") == "restart"]
    if not restarts:
        raise CkptrunError("the crashed worker was not restarted and resumed (no restart event in its metrics)")
    first = restarts[0]
    if not first["resume_step"]:
        if not required:
            return first
        raise CkptrunError("the restarted worker found no committed step and started over from step 0")
    setup = first.get("setup_s")
    result.recovery_s, result.setup_s = float(first["recovery_s"]), None if setup is None else float(setup)
    result.restore_s = float(first.get("restore_s") or 0.0)
    return first
