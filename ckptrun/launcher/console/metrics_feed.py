"""Read the workers' and engines' JSON-lines metrics and fold them into dashboard state.

Workers and checkpoint engines append events to ``<metrics_dir>/*.jsonl`` in small flushed
batches. The launcher tails those files (:class:`MetricsTailer`), folds every event into
:class:`MetricsState` (what the live view and the exit summary show) and, if asked, copies
the raw events to the user's ``--metrics-file`` (:class:`MetricsFileWriter`).

Nothing here talks to the processes: files are the only interface, so a crashed or slow
worker can never block the launcher.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ...ipc.events import STALL_CAUSES  # in display order (other causes are shown after them)

RATE_WINDOW_STEPS = 20  # steps/s is measured over this many recent steps
P99_WINDOW = 2_000  # p99 is computed over this many recent steps (mean is over the whole run); each
# stall cause of each rank keeps this many floats (~64 KB), reached within the first minutes of a run
BW_HISTORY = 32  # write-bandwidth samples kept per rank for the sparkline
_COMMITS_KEPT = 4096  # committed steps remembered to count each once (ranks report it close together)
_MAX_STEP_TIMES = 100_000  # bound on per-rank step->time memory when nothing becomes durable


# --------------------------------------------------------------------------- tailing


class MetricsTailer:
    """Incrementally read complete JSON lines from every ``*.jsonl`` file in a folder.

    Keeps one byte offset per file and only consumes up to the last newline, so a line that
    is being appended while we read is picked up whole on a later poll. Files may appear at
    any time (a restarted worker, a late engine). A file that shrinks or is replaced is read
    again from the start. Undecodable lines are skipped and counted in ``bad_lines``.
    """

    def __init__(self, metrics_dir: str | os.PathLike[str], pattern: str = "*.jsonl") -> None:
        self.metrics_dir = Path(metrics_dir)
        self.pattern = pattern
        self.bad_lines = 0
        self._offsets: dict[Path, int] = {}
        self._inodes: dict[Path, int] = {}

    def poll(self) -> list[dict[str, Any]]:
        """Return the events completed since the last poll, across all files, ordered by ``t``."""
        try:
            paths = sorted(self.metrics_dir.glob(self.pattern))
        except OSError:
            return []
        events: list[dict[str, Any]] = []
        for path in paths:
            events.extend(self._read_new(path))
        events.sort(key=_event_time)  # stable: per-file order is kept for equal times
        return events

    def _read_new(self, path: Path) -> list[dict[str, Any]]:
        try:
            with path.open("rb") as f:
                st = os.fstat(f.fileno())
                offset = self._offsets.get(path, 0)
                if st.st_size < offset or self._inodes.get(path, st.st_ino) != st.st_ino:
                    offset = 0  # truncated or replaced: start over
                self._inodes[path] = st.st_ino
                if st.st_size == offset:
                    self._offsets[path] = offset
                    return []
                f.seek(offset)
                data = f.read(st.st_size - offset)
        except OSError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            self._offsets[path] = offset  # only a partial line so far
            return []
        self._offsets[path] = offset + end + 1
        return self._decode(data[: end + 1])

    def _decode(self, chunk: bytes) -> list[dict[str, Any]]:
        events = []
        for raw in chunk.split(b"\n"):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError:  # includes UnicodeDecodeError and JSONDecodeError
                self.bad_lines += 1
                continue
            if isinstance(obj, dict):
                events.append(obj)
            else:
                self.bad_lines += 1
        return events


def _event_time(event: dict[str, Any]) -> float:
    t = event.get("t")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0


# --------------------------------------------------------------------------- copying


class MetricsFileWriter:
    """Append every event to the user's ``--metrics-file`` as one JSON object per line.

    Flushed after each batch so the file is useful while the run is still going (and after a
    crash of the launcher itself).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.parent:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: IO[str] | None = self.path.open("a", encoding="utf-8")

    def write(self, events: Iterable[dict[str, Any]]) -> None:
        """Append ``events`` and flush."""
        if self._f is None:
            raise ValueError("MetricsFileWriter is closed")
        lines = [json.dumps(e, separators=(",", ":"), default=str) + "\n" for e in events]
        if lines:
            self._f.write("".join(lines))
            self._f.flush()

    def close(self) -> None:
        """Flush and close the file (idempotent)."""
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> MetricsFileWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float] | Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); ``None`` for no values.

    Nearest-rank returns an observed value, so a p99 of stalls is a stall that really happened.
    """
    ordered = sorted(values)
    if not ordered:
        return None
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[k]


class Series:
    """Running statistics of one per-step quantity.

    The mean is exact over the whole run; the p99 uses the most recent ``window`` values so
    memory stays bounded on long runs.
    """

    def __init__(self, window: int = P99_WINDOW) -> None:
        self.last: float | None = None
        self.count = 0
        self.total = 0.0
        self.max: float | None = None
        self._recent: deque[float] = deque(maxlen=window)
        self._p99_cache: float | None = None
        self._dirty = False

    def add(self, value: float) -> None:
        self.last = value
        self.count += 1
        self.total += value
        self.max = value if self.max is None else max(self.max, value)
        self._recent.append(value)
        self._dirty = True

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    @property
    def p99(self) -> float | None:
        if self._dirty:
            self._p99_cache = percentile(self._recent, 99)
            self._dirty = False
        return self._p99_cache


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


@dataclass(frozen=True)
class Overview:
    """Job-level numbers for one log line or the dashboard header."""

    step: int | None  # slowest rank's step
    steps_per_s: float | None  # mean over ranks
    stall_mean_s: float | None  # mean over ranks of the mean stall per step
    stall_p99_s: float | None  # worst rank's p99
    durable_step: int | None  # lowest durable step over ranks
    durable_age_s: float | None
    memory_step: int | None  # lowest step held in the engines' memory over ranks (None: no replica)
    bw_mbps: float | None  # sum of each rank's latest write bandwidth (ranks write concurrently)
    restarts: int
    save_errors: int
    overhead: Budgeted | None = None  # --max-overhead: the worst rank's latest measure


@dataclass(frozen=True)
class Budgeted:
    """What checkpointing costs the loop against --max-overhead (fractions)."""

    overhead: float
    budget: float
    over: bool  # a rank said its strategy cannot keep within it
    skipped: int = 0  # due snapshots skipped while the disk was behind (the most of any rank)


@dataclass(frozen=True)
class RunSummary:
    """Totals for the exit summary."""

    steps: int | None  # highest step reached
    steps_executed: int  # step events of the busiest rank, including steps redone after restarts
    wall_s: float | None
    step_time_s: float  # summed over ranks
    stall_s_per_rank: float  # mean over ranks of the total stall
    stall_share: float | None  # total stall / total step time
    stall_by_cause_s: dict[str, float]  # mean over ranks
    checkpoints_committed: int
    bytes_committed: int
    bytes_written: int
    mean_bw_mbps: float | None  # bytes written / time spent writing (per writer)
    commit_lag_mean_s: float | None
    commit_lag_max_s: float | None
    restarts: int
    recovery_s: list[float]  # per restart, slowest rank
    save_errors: int
    last_durable_step: int | None
    last_memory_step: int | None = None  # lowest over ranks of the step their engines hold in memory
    overhead: Budgeted | None = None  # --max-overhead: the worst rank's latest measure


class MetricsState:
    """Fold events into per-rank and run-level state.

    ``apply`` never raises on a malformed event (it is counted in ``bad_events``): the
    dashboard must keep going whatever a worker writes.
    """

    def __init__(self) -> None:
        self.ranks: dict[int, RankStats] = {}
        self.strategy: str | None = None
        self.settings: dict[str, Any] = {}
        self.ckpt_dir: str | None = None
        self.world_size: int | None = None
        self.engine_pids: dict[int, int] = {}
        self.io_engine: str | None = None  # the engines' file writer: native or python (storage/iowriter.py)
        self.committed_step: int | None = None
        self.committed_t: float | None = None
        self.last_commit: dict[str, Any] | None = None
        self.commit_lag = Series()
        self.remote: dict[str, Any] | None = None  # the newest --durable upload (engine's `durable` event)
        self.checkpoints_committed = 0
        self.bytes_committed = 0
        self._committed_steps: set[int] = set()
        self.bytes_written = 0
        self.write_s_total = 0.0
        self.recoveries: dict[int, float] = {}  # restart_count -> slowest rank's recovery_s
        self.errors: deque[dict[str, Any]] = deque(maxlen=20)
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.events = 0
        self.bad_events = 0

    # ---- folding

    def apply(self, event: dict[str, Any]) -> None:
        """Fold one event in; unknown types are ignored, malformed ones counted."""
        handler = self._handlers.get(event.get("type")) if isinstance(event, dict) else None
        if handler is None:
            return
        try:
            t = float(event["t"])
            handler(self, event, t)
        except (KeyError, TypeError, ValueError, AttributeError):
            self.bad_events += 1
            return
        self.events += 1
        self.first_t = t if self.first_t is None else min(self.first_t, t)
        self.last_t = t if self.last_t is None else max(self.last_t, t)

    def apply_all(self, events: Iterable[dict[str, Any]]) -> None:
        for event in events:
            self.apply(event)

    def _rank(self, rank: Any) -> RankStats:
        r = int(rank)
        rs = self.ranks.get(r)
        if rs is None:
            rs = self.ranks[r] = RankStats(rank=r)
        return rs

    def _on_run(self, e: dict[str, Any], t: float) -> None:
        rs = self._rank(e["rank"])
        if e.get("pid") is not None:
            rs.pid = int(e["pid"])
        if rs.start_t is None:
            rs.start_t = t
        if e.get("strategy") is not None:
            self.strategy = str(e["strategy"])
        if isinstance(e.get("settings"), dict):
            self.settings = dict(e["settings"])
        if e.get("dir") is not None:
            self.ckpt_dir = str(e["dir"])
        if e.get("world_size") is not None:
            self.world_size = int(e["world_size"])

    def _on_step(self, e: dict[str, Any], t: float) -> None:
        rs = self._rank(e["rank"])
        step = int(e["step"])
        step_s = float(e.get("step_s") or 0.0)
        stall = e.get("stall_s") or {}
        if not isinstance(stall, dict):
            raise TypeError("stall_s must be an object")
        values = {c: float(v or 0.0) for c, v in stall.items()}
        if rs.start_t is None:
            rs.start_t = t - step_s
        rs.step = step
        rs.max_step = step if rs.max_step is None else max(rs.max_step, step)
        rs.last_step_t = t
        rs.steps_seen += 1
        rs.step_s_total += step_s
        rs.recent_step_s.append(step_s)
        for cause in set(STALL_CAUSES) | set(values):
            rs.stall.setdefault(cause, Series()).add(values.get(cause, 0.0))
        rs.stall_total.add(sum(values.values()))
        nbytes = int(e.get("bytes") or 0)
        if nbytes > 0:
            rs.ckpt_bytes_last = nbytes
            rs.ckpt_bytes_total += nbytes
            rs.ckpts_taken += 1
        if e.get("inflight") is not None:
            rs.inflight = int(e["inflight"])
        if e.get("host_memory_used") is not None:
            rs.host_memory = {**(rs.host_memory or {}), "host_memory": int(e.get("host_memory") or 0),
                              "host_memory_used": int(e["host_memory_used"])}
        if e.get("last_snapshot_step") is not None:
            rs.last_snapshot_step = int(e["last_snapshot_step"])
        if e.get("last_snapshot_done") is not None:
            rs.last_snapshot_done = int(e["last_snapshot_done"])
        durable = e.get("last_durable_step")
        if durable is not None and (
            rs.reported_durable_step is None or int(durable) > rs.reported_durable_step
        ):
            rs.reported_durable_step = int(durable)
            rs.reported_durable_t = t
            _prune_before(rs, int(durable))
        if e.get("last_memory_step") is not None:
            rs.memory_step = int(e["last_memory_step"])
        rs.step_t[step] = t
        if len(rs.step_t) > _MAX_STEP_TIMES:
            for old in list(rs.step_t)[: _MAX_STEP_TIMES // 2]:
                del rs.step_t[old]

    def _on_restart(self, e: dict[str, Any], t: float) -> None:
        rs = self._rank(e["rank"])
        count = int(e.get("restart_count") or rs.restarts + 1)
        recovery = float(e.get("recovery_s") or 0.0)
        rs.restarts = max(rs.restarts + 1, count)
        rs.recovery_s.append(recovery)
        self.recoveries[count] = max(self.recoveries.get(count, 0.0), recovery)
        if e.get("resume_step") is not None:
            resume = int(e["resume_step"])
            rs.step = resume
            rs.last_step_t = t
            # Steps after the resume point will be redone; the resumed state exists as of now.
            rs.step_t = {s: st for s, st in rs.step_t.items() if s < resume}
            rs.step_t[resume] = t
        rs.recent_step_s.clear()  # the old rate says nothing about the new process

    def _on_engine(self, e: dict[str, Any], t: float) -> None:
        if e.get("pid") is not None:
            self.engine_pids[int(e["local_rank"])] = int(e["pid"])

    def _on_io_engine(self, e: dict[str, Any], t: float) -> None:
        self.io_engine = str(e["engine"])

    def _on_write(self, e: dict[str, Any], t: float) -> None:
        rs = self._rank(e["rank"])
        nbytes = int(e.get("bytes") or 0)
        write_s = float(e.get("write_s") or 0.0)
        rs.writes += 1
        rs.write_bytes_total += nbytes
        rs.write_s_total += write_s
        self.bytes_written += nbytes
        self.write_s_total += write_s
        if write_s > 0:
            rs.bw_last_mbps = nbytes / write_s / 1e6
            rs.bw_history.append(rs.bw_last_mbps)
        if e.get("queue_depth") is not None:
            rs.queue_depth = int(e["queue_depth"])

    def _on_commit(self, e: dict[str, Any], t: float) -> None:
        step = int(e["step"])
        if step not in self._committed_steps:  # several engines may report the same commit
            self._committed_steps.add(step)
            if len(self._committed_steps) > _COMMITS_KEPT:  # bounded: a rank's report of an old step
                self._committed_steps = set(sorted(self._committed_steps)[-_COMMITS_KEPT // 2:])  # comes soon
            self.checkpoints_committed += 1
            self.bytes_committed += int(e.get("bytes") or 0)
            if e.get("lag_s") is not None:
                self.commit_lag.add(float(e["lag_s"]))
        if self.committed_step is None or step > self.committed_step:
            self.committed_step = step
            self.committed_t = t
            self.last_commit = dict(e)
            for rs in self.ranks.values():
                _prune_before(rs, step)

    def _on_save_error(self, e: dict[str, Any], t: float) -> None:
        rs = self._rank(e["rank"])
        rs.save_errors += 1
        rs.last_error = str(e.get("error", ""))
        self.errors.append({"t": t, "rank": rs.rank, "step": e.get("step"), "error": rs.last_error})

    def _on_durable(self, e: dict[str, Any], t: float) -> None:
        if self.remote is None or int(e["step"]) >= int(self.remote["step"]):
            self.remote = {**e, "t": t}

    def _on_durable_error(self, e: dict[str, Any], t: float) -> None:
        self.errors.append({"t": t, "rank": 0, "step": None, "error": f"--durable: {e['error']}"})

    def remote_lag(self) -> int | None:
        """Steps the newest commit is ahead of the newest step on --durable (None: none there yet)."""
        if self.remote is None:
            return None
        return max(0, (self.committed_step or 0) - int(self.remote["step"]))

    def _on_host_memory(self, e: dict[str, Any], t: float) -> None:
        self._rank(e["rank"]).host_memory = {k: v for k, v in e.items() if k.startswith("host_memory")}

    def _on_in_memory(self, e: dict[str, Any], t: float) -> None:
        self._rank(e["rank"]).memory_step = int(e["step"])

    def _on_replica_sent(self, e: dict[str, Any], t: float) -> None:
        rs = self._rank(e["rank"])
        newest = -1 if rs.replicated_step is None else rs.replicated_step
        if e.get("of") and len(e["partners"]) == int(e["of"]) and int(e["step"]) > newest:
            rs.replicated_step = int(e["step"])

    def _on_interval(self, e: dict[str, Any], t: float) -> None:
        """Settings chosen at run time (`--every auto`, lowdiff's auto F/B) replace the header's."""
        skip = {"type", "t", "rank", "step", "reason", "strategy"}
        self.settings.update({k: v for k, v in e.items() if k not in skip})

    def _on_overhead(self, e: dict[str, Any], t: float) -> None:
        rs = self._rank(e["rank"])
        rs.overhead, rs.budget = float(e["overhead"]), float(e["budget"])

    def _on_skipped(self, e: dict[str, Any], t: float) -> None:
        self._rank(e["rank"]).skipped += 1

    def _on_budget(self, e: dict[str, Any], t: float) -> None:
        if e.get("verdict") == "over":
            self._rank(e["rank"]).over_budget = True

    def budgeted(self) -> Budgeted | None:
        """The worst rank's latest overhead against its budget; None before one was measured."""
        measured = [rs for rs in self.ranks.values() if rs.overhead is not None and rs.budget]
        if not measured:
            return None
        worst = max(measured, key=lambda rs: rs.overhead)
        ranks = self.ranks.values()
        return Budgeted(worst.overhead, worst.budget, any(rs.over_budget for rs in ranks),
                        max(rs.skipped for rs in ranks))

    _handlers = {
        "interval": _on_interval,
        "overhead": _on_overhead,
        "budget": _on_budget,
        "skipped": _on_skipped,
        "run": _on_run,
        "step": _on_step,
        "restart": _on_restart,
        "engine": _on_engine,
        "io_engine": _on_io_engine,
        "write": _on_write,
        "commit": _on_commit,
        "save_error": _on_save_error,
        "durable": _on_durable,
        "durable_error": _on_durable_error,
        "in_memory": _on_in_memory,
        "replica_sent": _on_replica_sent,
        "host_memory": _on_host_memory,
    }

    # ---- derived views

    def durable(self, rank: int) -> tuple[int | None, float | None]:
        """Last durable step of ``rank`` and when it became durable.

        The newer of the global commit and what the rank itself reported.
        """
        rs = self.ranks[rank]
        candidates = [
            (s, t)
            for s, t in (
                (self.committed_step, self.committed_t),
                (rs.reported_durable_step, rs.reported_durable_t),
            )
            if s is not None
        ]
        if not candidates:
            return None, None
        best = max(s for s, _ in candidates)
        return best, min(t for s, t in candidates if s == best and t is not None)

    def durable_age(self, rank: int, now: float) -> float | None:
        """Seconds since ``rank``'s last durable step became durable."""
        _, t = self.durable(rank)
        return max(0.0, now - t) if t is not None else None

    def at_risk(self, rank: int, *, memory: bool = False) -> tuple[int | None, float | None]:
        """Work lost if ``rank``'s machine died now: steps and seconds since its last durable
        step; with `memory`, if only its worker died (the engine's in-memory step is kept)."""
        rs = self.ranks[rank]
        if rs.step is None:
            return None, None
        durable, _ = self.durable(rank)
        if memory and rs.memory_step is not None and (durable is None or rs.memory_step > durable):
            durable = rs.memory_step
        steps = max(0, rs.step - (durable if durable is not None else 0))
        if steps == 0:
            return 0, 0.0
        end = rs.last_step_t
        since = rs.step_t.get(durable) if durable is not None else rs.start_t
        if end is not None and since is not None:
            return steps, max(0.0, end - since)
        mean = rs.mean_step_s
        return steps, (steps * mean if mean is not None else None)

    def pids(self) -> dict[str, int]:
        """Processes whose memory the host line shows: ``rankN`` trainers and ``engineN`` engines."""
        out = {f"rank{r}": rs.pid for r, rs in sorted(self.ranks.items()) if rs.pid is not None}
        out.update({f"engine{lr}": pid for lr, pid in sorted(self.engine_pids.items())})
        return out

    @property
    def restarts(self) -> int:
        return max([len(self.recoveries)] + [rs.restarts for rs in self.ranks.values()])

    def overview(self, now: float) -> Overview:
        """Job-level numbers (slowest rank for progress, worst rank for tails)."""
        ranks = [r for r, rs in sorted(self.ranks.items()) if rs.step is not None]
        stats = [self.ranks[r] for r in ranks]
        rates = [rs.steps_per_s for rs in stats if rs.steps_per_s is not None]
        means = [rs.stall_total.mean for rs in stats if rs.stall_total.mean is not None]
        p99s = [rs.stall_total.p99 for rs in stats if rs.stall_total.p99 is not None]
        bws = [rs.bw_last_mbps for rs in self.ranks.values() if rs.bw_last_mbps is not None]
        durable_step, durable_age = None, None
        memory = [rs.memory_step for rs in stats if rs.memory_step is not None]
        durables = [(self.durable(r)[0], r) for r in ranks]
        if durables and all(d is not None for d, _ in durables):
            durable_step, worst = min(durables)
            durable_age = self.durable_age(worst, now)
        elif not ranks and self.committed_step is not None and self.committed_t is not None:
            durable_step, durable_age = self.committed_step, max(0.0, now - self.committed_t)
        # A step's metrics line can reach the feed after its commit: a step committed (or in the engine's
        # memory) on every rank has been reached, whatever the step lines say so far.
        memory_step = min(memory) if ranks and len(memory) == len(ranks) else None
        seen = min((rs.step for rs in stats if rs.step is not None), default=None)
        step = None if seen is None else max(s for s in (seen, durable_step, memory_step) if s is not None)
        return Overview(
            step=step,
            steps_per_s=sum(rates) / len(rates) if rates else None,
            stall_mean_s=sum(means) / len(means) if means else None,
            stall_p99_s=max(p99s) if p99s else None,
            durable_step=durable_step,
            durable_age_s=durable_age,
            memory_step=memory_step,
            bw_mbps=sum(bws) if bws else None,
            restarts=self.restarts,
            save_errors=sum(rs.save_errors for rs in self.ranks.values()),
            overhead=self.budgeted(),
        )

    def summary(self) -> RunSummary:
        """Totals for the end of the run."""
        stats = list(self.ranks.values())
        stepping = [rs for rs in stats if rs.steps_seen]
        step_time = sum(rs.step_s_total for rs in stepping)
        stall_total = sum(rs.stall_total.total for rs in stepping)
        causes: dict[str, float] = {}
        for rs in stepping:
            for cause in rs.stall_causes:
                series = rs.stall.get(cause)
                causes[cause] = causes.get(cause, 0.0) + (series.total if series else 0.0)
        n = len(stepping)
        return RunSummary(
            steps=max((rs.max_step for rs in stats if rs.max_step is not None), default=None),
            steps_executed=max((rs.steps_seen for rs in stats), default=0),
            wall_s=(self.last_t - self.first_t)
            if self.first_t is not None and self.last_t is not None
            else None,
            step_time_s=step_time,
            stall_s_per_rank=stall_total / n if n else 0.0,
            stall_share=stall_total / step_time if step_time > 0 else None,
            stall_by_cause_s={c: v / n for c, v in causes.items()} if n else {},
            checkpoints_committed=self.checkpoints_committed,
            bytes_committed=self.bytes_committed,
            bytes_written=self.bytes_written,
            mean_bw_mbps=self.bytes_written / self.write_s_total / 1e6 if self.write_s_total > 0 else None,
            commit_lag_mean_s=self.commit_lag.mean,
            commit_lag_max_s=self.commit_lag.max,
            restarts=self.restarts,
            recovery_s=[self.recoveries[k] for k in sorted(self.recoveries)],
            save_errors=sum(rs.save_errors for rs in stats),
            last_durable_step=self.committed_step,
            last_memory_step=min((rs.memory_step for rs in stats if rs.memory_step is not None), default=None),
            overhead=self.budgeted(),
        )


def _prune_before(rs: RankStats, durable: int) -> None:
    """Forget completion times of steps older than the durable one: they can no longer be at risk."""
    if any(s < durable for s in rs.step_t):
        rs.step_t = {s: t for s, t in rs.step_t.items() if s >= durable}
