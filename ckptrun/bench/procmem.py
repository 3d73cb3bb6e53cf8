"""Peak resident memory of a run's trainer and checkpoint engine, sampled from outside.

The sum of RSS over the process tree, leaving out multiprocessing's resource tracker and, for
ckptrun runs, the launcher (it supervises; torchrun's agent would be there anyway). The trainer's
helpers that hold checkpoint data (ckptrun's engine, DCP's checkpoint daemon) are counted.
Shared memory mapped by two of them (staging slots) counts once per process that touched it,
as RSS does.
"""

from __future__ import annotations

import threading

import psutil


class PeakRss:
    """Samples in a thread until `stop()`; `peak_MB` is the largest sum seen."""

    def __init__(self, pid: int, *, include_root: bool, interval_s: float = 0.1) -> None:
        self.root = psutil.Process(pid)
        self.include_root, self.interval_s = include_root, interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptrun-bench-rss", daemon=True)

    def start(self) -> PeakRss:
        self._thread.start()
        return self

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_MB

    @property
    def peak_MB(self) -> float:
        return self.peak_bytes / 2**20

    def sample(self) -> int:
        """Resident bytes of the counted processes now (processes that just exited count 0)."""
        try:
            procs = ([self.root] if self.include_root else []) + self.root.children(recursive=True)
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            try:
                if not any("resource_tracker" in part for part in p.cmdline()):
                    total += p.memory_info().rss
            except psutil.Error:
                continue
        return total

    def _run(self) -> None:
        while True:
            self.peak_bytes = max(self.peak_bytes, self.sample())
            if self._stop.wait(self.interval_s):
                return
