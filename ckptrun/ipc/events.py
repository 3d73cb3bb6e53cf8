"""The metrics event files: one JSON object per line in `<metrics_dir>/<name>.jsonl`, written by
workers (`worker-<rank>`) and engines (`engine-<local_rank>`), read by the launcher's console,
`bench` and `tune` (ckptrun/launcher/console/metrics_feed.py)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

# What blocks the trainer; a strategy may add its own cause (lightcheck: layer_wait).
STALL_CAUSES: tuple[str, ...] = ("snapshot", "backpressure", "sync_write")


class EventLog:
    """Appends events to `<metrics_dir>/<name>.jsonl` (nothing without a metrics dir), each with its
    time and the `fixed` fields. With `flush_every_s`, lines are written in small batches (the
    training thread's hot path); without, each at once (thread-safe)."""

    def __init__(self, metrics_dir: str | None, name: str, *, flush_every_s: float = 0.0, **fixed: Any) -> None:
        self._f = None
        if metrics_dir:
            Path(metrics_dir).mkdir(parents=True, exist_ok=True)
            self._f = open(Path(metrics_dir) / f"{name}.jsonl", "a")
        self._fixed = fixed
        self._flush_every = flush_every_s
        self._buf: list[str] = []
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()

    def emit(self, **event: Any) -> None:
        if self._f is None:
            return
        with self._lock:
            self._buf.append(json.dumps({"t": time.time(), **self._fixed, **event}))
        if time.monotonic() - self._last_flush >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if self._f and self._buf:
                self._f.write("\n".join(self._buf) + "\n")
                self._f.flush()
                self._buf.clear()
            self._last_flush = time.monotonic()

    def close(self) -> None:
        self.flush()
        with self._lock:
            if self._f:
                self._f.close()
                self._f = None
