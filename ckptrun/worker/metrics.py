"""Worker-side measurements: per-step stall by cause, bytes handed off, durability lag.

Lines go to `<metrics_dir>/worker-<rank>.jsonl` in small batches; the launcher's dashboard and
`ckptrun bench` read them. Stall is measured in the trainer, where it is felt.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

CAUSES = ("snapshot", "backpressure", "sync_write")


class WorkerMetrics:
    def __init__(self, metrics_dir: str, rank: int, flush_every_s: float = 0.5) -> None:
        self.rank = rank
        self._f = None
        if metrics_dir:
            Path(metrics_dir).mkdir(parents=True, exist_ok=True)
            self._f = open(Path(metrics_dir) / f"worker-{rank}.jsonl", "a")
        self._buf: list[str] = []
        self._flush_every = flush_every_s
        self._last_flush = time.monotonic()
        self._last_step_t = time.perf_counter()
        self.stall: dict[str, float] = defaultdict(float)
        self.bytes = 0
        self.last_snapshot_step: int | None = None
        self.last_durable_step: int | None = None
        self.inflight = 0
        self.optim_s: float | None = None  # the optimizer's own update time in the last step

    def emit(self, **event: Any) -> None:
        if self._f is None:
            return
        self._buf.append(json.dumps({"t": time.time(), "rank": self.rank, **event}))
        if time.monotonic() - self._last_flush > self._flush_every:
            self.flush()

    def flush(self) -> None:
        if self._f and self._buf:
            self._f.write("\n".join(self._buf) + "\n")
            self._f.flush()
            self._buf.clear()
        self._last_flush = time.monotonic()

    def add_stall(self, cause: str, seconds: float) -> None:
        self.stall[cause] += seconds

    def end_step(self, step: int) -> dict[str, Any]:
        """Close the books on one optimizer step (called after its post-step work); returns its record."""
        now = time.perf_counter()
        record = dict(type="step", step=step, step_s=now - self._last_step_t,
                      stall_s={c: self.stall.get(c, 0.0) for c in CAUSES}, bytes=self.bytes,
                      inflight=self.inflight, last_snapshot_step=self.last_snapshot_step,
                      last_durable_step=self.last_durable_step, optim_s=self.optim_s)
        self.emit(**record)
        self._last_step_t = now
        self.stall.clear()
        self.bytes = 0
        return record

    def close(self) -> None:
        self.flush()
        if self._f:
            self._f.close()
            self._f = None
