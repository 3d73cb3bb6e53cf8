"""Worker-side measurements: per-step stall by cause, bytes handed off, durability lag.

Lines go to `<metrics_dir>/worker-<rank>.jsonl` in small batches; the launcher's dashboard and
`ckptrun bench` read them. Stall is measured in the trainer, where it is felt.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from ..ipc.events import STALL_CAUSES, EventLog


class WorkerMetrics:
    def __init__(self, metrics_dir: str, rank: int, flush_every_s: float = 0.5) -> None:
        self.rank = rank
        self._log = EventLog(metrics_dir, f"worker-{rank}", flush_every_s=flush_every_s, rank=rank)
        self._last_step_t = time.perf_counter()
        self.stall: dict[str, float] = defaultdict(float)
        self.bytes = 0
        self.last_snapshot_step: int | None = None  # the newest snapshot begun
        self.last_snapshot_done: int | None = None  # the newest one complete in host memory
        self.last_durable_step: int | None = None
        self.last_memory_step: int | None = None  # held in the engine's memory (a replica), not on disk
        self.inflight = 0
        self.optim_s: float | None = None  # the optimizer's own update time in the last step
        self.host_memory: tuple[int, int] | None = None  # (this rank's --host-memory budget, bytes used)

    def emit(self, **event: Any) -> None:
        self._log.emit(**event)

    def flush(self) -> None:
        self._log.flush()

    def add_stall(self, cause: str, seconds: float) -> None:
        self.stall[cause] += seconds

    def stalled_since(self, cause: str, t0: float) -> None:
        """The trainer was blocked from `t0` (a `time.perf_counter()`) until now by `cause`."""
        self.add_stall(cause, time.perf_counter() - t0)

    def end_step(self, step: int) -> dict[str, Any]:
        """Close the books on one optimizer step (called after its post-step work); returns its record."""
        now = time.perf_counter()
        record = dict(type="step", step=step, step_s=now - self._last_step_t,
                      stall_s={**dict.fromkeys(STALL_CAUSES, 0.0), **self.stall}, bytes=self.bytes,
                      inflight=self.inflight, last_snapshot_step=self.last_snapshot_step,
                      last_snapshot_done=self.last_snapshot_done,
                      last_durable_step=self.last_durable_step, optim_s=self.optim_s)
        if self.last_memory_step is not None:
            record["last_memory_step"] = self.last_memory_step
        if self.host_memory is not None:
            record["host_memory"], record["host_memory_used"] = self.host_memory
        self.emit(**record)
        self._last_step_t = now
        self.stall.clear()
        self.bytes = 0
        return record

    def close(self) -> None:
        self._log.close()
