"""One rank's figures, and the folding of the events that concern that rank alone.

The run-level parts of an event (a commit, the run's totals, the error list) are the caller's
(:class:`~ckptrun.launcher.console.metrics_state.MetricsState`); each method here raises on a
malformed field, and the caller counts the event as bad.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ...ipc.events import STALL_CAUSES  # in display order (other causes are shown after them)
from .series import Series

RATE_WINDOW_STEPS = 20  # steps/s is measured over this many recent steps
BW_HISTORY = 32  # write-bandwidth samples kept per rank for the sparkline
_MAX_STEP_TIMES = 100_000  # bound on per-rank step->time memory when nothing becomes durable


@dataclass
class RankStats:
    """Everything the dashboard shows for one rank."""

    rank: int
    pid: int | None = None
    step: int | None = None
    max_step: int | None = None  # highest step reached, across restarts
    last_step_t: float | None = None
    start_t: float | None = None
    steps_seen: int = 0
    step_s_total: float = 0.0
    recent_step_s: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW_STEPS))
    stall: dict[str, Series] = field(default_factory=lambda: {c: Series() for c in STALL_CAUSES})
    stall_total: Series = field(default_factory=Series)
    # --max-overhead: the rank's latest measured overhead and its budget (fractions), and whether it
    # said its strategy cannot keep within it
    overhead: float | None = None
    budget: float | None = None
    over_budget: bool = False
    skipped: int = 0  # due snapshots skipped while the disk was behind (worker/hooks.py `_disk_behind`)
    ckpt_bytes_last: int | None = None
    ckpt_bytes_total: int = 0
    ckpts_taken: int = 0
    inflight: int | None = None
    queue_depth: int | None = None
    last_snapshot_step: int | None = None  # begun
    last_snapshot_done: int | None = None  # complete in host memory (the trainer may update)
    reported_durable_step: int | None = None
    reported_durable_t: float | None = None
    memory_step: int | None = None  # held in the engine's memory (lowdiff+'s replica): survives a worker crash
    # --replicas: the newest step this rank's engine shipped to every partner (each checks it as
    # it arrives: `replica_held` in the partner's metrics): survives the loss of its node
    replicated_step: int | None = None
    writes: int = 0
    write_bytes_total: int = 0
    write_s_total: float = 0.0
    bw_last_mbps: float | None = None
    bw_history: deque[float] = field(default_factory=lambda: deque(maxlen=BW_HISTORY))
    restarts: int = 0
    recovery_s: list[float] = field(default_factory=list)
    save_errors: int = 0
    last_error: str | None = None
    step_t: dict[int, float] = field(default_factory=dict)  # step -> time it completed
    # --host-memory: this rank's budget, bytes used, peak and bytes by use (staging slots, a strategy's
    # buffers), from its `host_memory` events and step records (bytes; None without a budget)
    host_memory: dict[str, Any] | None = None

    @property
    def steps_per_s(self) -> float | None:
        """Steps per second over the last few steps."""
        total = sum(self.recent_step_s)
        return len(self.recent_step_s) / total if total > 0 else None

    @property
    def mean_step_s(self) -> float | None:
        return self.step_s_total / self.steps_seen if self.steps_seen else None

    @property
    def stall_causes(self) -> list[str]:
        """Known causes first, then any other cause a strategy reported."""
        return list(STALL_CAUSES) + sorted(c for c in self.stall if c not in STALL_CAUSES)

    @property
    def mean_bw_mbps(self) -> float | None:
        """Bytes-weighted mean write bandwidth of this rank (MB/s, 1 MB = 1e6 bytes)."""
        return self.write_bytes_total / self.write_s_total / 1e6 if self.write_s_total > 0 else None

    # ---- folding this rank's events

    def on_run(self, e: dict[str, Any], t: float) -> None:
        if e.get("pid") is not None:
            self.pid = int(e["pid"])
        if self.start_t is None:
            self.start_t = t

    def on_step(self, e: dict[str, Any], t: float) -> None:
        step = int(e["step"])
        step_s = float(e.get("step_s") or 0.0)
        stall = e.get("stall_s") or {}
        if not isinstance(stall, dict):
            raise TypeError("stall_s must be an object")
        values = {c: float(v or 0.0) for c, v in stall.items()}
        if self.start_t is None:
            self.start_t = t - step_s
        self.step = step
        self.max_step = step if self.max_step is None else max(self.max_step, step)
        self.last_step_t = t
        self.steps_seen += 1
        self.step_s_total += step_s
        self.recent_step_s.append(step_s)
        for cause in set(STALL_CAUSES) | set(values):
            self.stall.setdefault(cause, Series()).add(values.get(cause, 0.0))
        self.stall_total.add(sum(values.values()))
        nbytes = int(e.get("bytes") or 0)
        if nbytes > 0:
            self.ckpt_bytes_last = nbytes
            self.ckpt_bytes_total += nbytes
            self.ckpts_taken += 1
        if e.get("inflight") is not None:
            self.inflight = int(e["inflight"])
        if e.get("host_memory_used") is not None:
            self.host_memory = {**(self.host_memory or {}), "host_memory": int(e.get("host_memory") or 0),
                                "host_memory_used": int(e["host_memory_used"])}
        if e.get("last_snapshot_step") is not None:
            self.last_snapshot_step = int(e["last_snapshot_step"])
        if e.get("last_snapshot_done") is not None:
            self.last_snapshot_done = int(e["last_snapshot_done"])
        durable = e.get("last_durable_step")
        if durable is not None and (
            self.reported_durable_step is None or int(durable) > self.reported_durable_step
        ):
            self.reported_durable_step = int(durable)
            self.reported_durable_t = t
            self.forget_before(int(durable))
        if e.get("last_memory_step") is not None:
            self.memory_step = int(e["last_memory_step"])
        self.step_t[step] = t
        if len(self.step_t) > _MAX_STEP_TIMES:
            for old in list(self.step_t)[: _MAX_STEP_TIMES // 2]:
                del self.step_t[old]

    def restarted(self, e: dict[str, Any]) -> tuple[int, float]:
        """Count a restart; (its restart count, this rank's recovery seconds)."""
        count = int(e.get("restart_count") or self.restarts + 1)
        recovery = float(e.get("recovery_s") or 0.0)
        self.restarts = max(self.restarts + 1, count)
        self.recovery_s.append(recovery)
        return count, recovery

    def resumed(self, e: dict[str, Any], t: float) -> None:
        """The restarted process resumed at `resume_step` (when given) as of `t`."""
        if e.get("resume_step") is not None:
            resume = int(e["resume_step"])
            self.step = resume
            self.last_step_t = t
            # Steps after the resume point will be redone; the resumed state exists as of now.
            self.step_t = {s: st for s, st in self.step_t.items() if s < resume}
            self.step_t[resume] = t
        self.recent_step_s.clear()  # the old rate says nothing about the new process

    def wrote(self, nbytes: int, write_s: float) -> None:
        """One write of `nbytes` bytes that took `write_s` seconds."""
        self.writes += 1
        self.write_bytes_total += nbytes
        self.write_s_total += write_s
        if write_s > 0:
            self.bw_last_mbps = nbytes / write_s / 1e6
            self.bw_history.append(self.bw_last_mbps)

    def on_save_error(self, e: dict[str, Any], t: float) -> None:
        self.save_errors += 1
        self.last_error = str(e.get("error", ""))

    def on_host_memory(self, e: dict[str, Any], t: float) -> None:
        self.host_memory = {k: v for k, v in e.items() if k.startswith("host_memory")}

    def on_in_memory(self, e: dict[str, Any], t: float) -> None:
        self.memory_step = int(e["step"])

    def on_replica_sent(self, e: dict[str, Any], t: float) -> None:
        newest = -1 if self.replicated_step is None else self.replicated_step
        if e.get("of") and len(e["partners"]) == int(e["of"]) and int(e["step"]) > newest:
            self.replicated_step = int(e["step"])

    def on_overhead(self, e: dict[str, Any], t: float) -> None:
        self.overhead, self.budget = float(e["overhead"]), float(e["budget"])

    def on_skipped(self, e: dict[str, Any], t: float) -> None:
        self.skipped += 1

    def forget_before(self, durable: int) -> None:
        """Forget completion times of steps older than the durable one: they can no longer be at risk."""
        if any(s < durable for s in self.step_t):
            self.step_t = {s: t for s, t in self.step_t.items() if s >= durable}
