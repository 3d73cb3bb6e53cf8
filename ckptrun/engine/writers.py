"""The engine's writer threads: every job that writes (a Persist, a handler's `write` and `run`)
is queued here, so that a flush (a worker's Hello, its Flush, the engine's close) can wait
until all of them have ended, and back-pressure can bound how many are queued."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any


class Writers:
    """A thread pool (made at the first Hello, its size the worker's --writers) and the jobs in
    flight on it; a job that raises is printed, never lost silently."""

    def __init__(self) -> None:
        self.pool: ThreadPoolExecutor | None = None
        self.inflight: set[Future] = set()
        self._lock = threading.Lock()

    def start(self, n: int) -> None:
        """Make the pool of `n` threads, once: a restarted worker's Hello keeps it."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max(1, n), thread_name_prefix="writer")

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut = self.pool.submit(fn, *args)
        with self._lock:
            self.inflight.add(fut)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut: Future) -> None:
        with self._lock:
            self.inflight.discard(fut)
        if fut.exception() is not None:
            traceback.print_exception(fut.exception())

    def wait(self, fewer_than: int) -> None:
        """Block until fewer than `fewer_than` submitted jobs are queued or running."""
        while True:
            with self._lock:
                futs = list(self.inflight)
            if len(futs) < fewer_than:
                return
            wait(futs, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        if self.pool:
            self.pool.shutdown()
