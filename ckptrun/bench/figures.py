"""The figures of one run, from the files it leaves behind: the example script's timing file
(`--timing-json`, every configuration) and, for ckptrun runs, the workers' and engines' metrics.

Step time and stall are averaged over the timed steps: all but the first `warmup` steps of the
run (one-time costs such as the allocation, first touch and page-locking of staging memory at
the first checkpoint are left out of every configuration alike, where the warm-up covers the
first checkpoint: at --every N, N steps or more). Bytes and write bandwidth count the
checkpoints of those same steps, and so does the CPU time per process role (`proccpu`): the
trainer's, the engine's, the launcher's, from the first timed step's start to the last one's end.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

from ..errors import CkptrunError
from ..launcher.console.metrics_feed import MetricsTailer
from .proccpu import CpuTrace
from .procmem import Memory

# Per-run figures, in report order (the summary's `median_step_s` is the median of `step_s`).
# The stall's causes (the worker's `stall_s`), each a figure of its own: what a slow row waits on.
CAUSE_FIGURES = {"snapshot": "snapshot_ms_per_step", "backpressure": "backpressure_ms_per_step",
                 "setup": "setup_ms_per_step", "sync_write": "sync_write_ms_per_step",
                 "layer_wait": "layer_wait_ms_per_step"}
FIGURES = ("step_s", "compute_s", "stall_ms_per_step", *CAUSE_FIGURES.values(), "trainer_cpu_ms_per_step",
           "engine_cpu_ms_per_step", "launcher_cpu_ms_per_step", "bytes_per_step", "shipped_per_step", "write_MBps",
           "effective_MBps", "peak_rss_MB", "peak_MB", "staging_MB", "page_cache_MB", "committed", "recovery_s",
           "setup_s", "restore_s")


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
    # The stall by cause (ckptrun runs; None: a reference, or no step of the run had the cause): the
    # snapshot (state built and copied, sends), back-pressure (every slot in flight), the staging
    # slots' set-up (allocated, faulted in, page-locked: a first checkpoint before it was done, or
    # a state that outgrew them), the write on the training path (sync), and an update waiting
    # for its own layer's copy (lightcheck)
    snapshot_ms_per_step: float | None = None
    backpressure_ms_per_step: float | None = None
    setup_ms_per_step: float | None = None
    sync_write_ms_per_step: float | None = None
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

    def __post_init__(self) -> None:
        if self.bytes_per_step > 0 and self.stall_ms_per_step > 1e-3:
            self.effective_MBps = self.bytes_per_step / 1e6 / (self.stall_ms_per_step / 1e3)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


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


def _by_cause(steps: dict[int, dict[str, float]], timed: list[int]) -> dict[str, float | None]:
    """Each cause's stall, ms per timed step; None for a cause no step of the run reported."""
    seen = {c for causes in steps.values() for c in causes}
    return {figure: 1e3 * fmean(steps[s].get(cause, 0.0) for s in timed) if cause in seen else None
            for cause, figure in CAUSE_FIGURES.items()}


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


def reference_figures(timing: Attempt, warmup: int, mem: Memory, cpu: CpuTrace) -> RunFigures:
    """`none` and the references: everything is in the script's timing file."""
    timed, first, last = timing.window(warmup)
    nbytes, mbps = _io([(s["step"], s["bytes"], s["write_s"]) for s in timing.saves], first, last)
    return RunFigures(step_s=fmean(s["wall_s"] for s in timed),
                      stall_ms_per_step=1e3 * fmean(s["stall_s"] for s in timed),
                      bytes_per_step=nbytes / len(timed), write_MBps=mbps, committed=len(timing.saves),
                      **_memory(mem), **_compute_and_cpu(timed, timing.pid, cpu))


def ckptrun_figures(timing: Attempt, metrics_dir: Path, warmup: int, mem: Memory, cpu: CpuTrace) -> RunFigures:
    """ckptrun runs: step time from the script, stall from the worker (per cause, summed), bytes
    and write time from the engine's `write` events, commits from its `commit` events (up to the
    last timed step: the restarted worker's own are not counted), the writer from `io_engine`."""
    timed, first, last = timing.window(warmup)
    events = MetricsTailer(metrics_dir).poll()
    steps = {e["step"]: e["stall_s"] for e in events if e.get("type") == "step"}
    stall = {step: sum(causes.values()) for step, causes in steps.items()}
    missing = [s["step"] for s in timed if s["step"] not in stall]
    if missing:
        raise CkptrunError(f"ckptrun's worker metrics in {metrics_dir} lack steps {missing[:5]}")
    nbytes, mbps = _io([(e["step"], e["bytes"], e["write_s"]) for e in events if e.get("type") == "write"],
                       first, last)
    return RunFigures(step_s=fmean(s["wall_s"] for s in timed),
                      stall_ms_per_step=1e3 * fmean(stall[s["step"]] for s in timed),
                      bytes_per_step=nbytes / len(timed), write_MBps=mbps, **_memory(mem),
                      **_compute_and_cpu(timed, timing.pid, cpu),
                      io_engine=next((str(e["engine"]) for e in events if e.get("type") == "io_engine"), None),
                      committed=sum(1 for e in events if e.get("type") == "commit" and e["step"] <= last),
                      **_by_cause(steps, [s["step"] for s in timed]))


def ckptrun_recovery(result: RunFigures, events: list[dict]) -> dict:
    """Set `result`'s recovery figures from the restarted worker's `restart` event among its
    metrics `events`: its start to the end of its first resumed step, and of it the restart (its
    set-up until the first optimizer exists) and the state restore. Returns the event."""
    restarts = [e for e in events if e.get("type") == "restart"]
    if not restarts:
        raise CkptrunError("the crashed worker was not restarted and resumed (no restart event in its metrics)")
    if not restarts[0]["resume_step"]:
        raise CkptrunError("the restarted worker found no committed step and started over from step 0")
    first = restarts[0]
    setup = first.get("setup_s")
    result.recovery_s, result.setup_s = float(first["recovery_s"]), None if setup is None else float(setup)
    result.restore_s = float(first.get("restore_s") or 0.0)
    return first
