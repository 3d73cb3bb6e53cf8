"""Peak resident memory of a run's trainer and checkpoint engine, and the machine's page-cache
growth while it runs, sampled from outside.

The sum of RSS over the process tree, leaving out multiprocessing's resource tracker and, for
ckptrun runs, the launcher (it supervises; torchrun's agent would be there anyway). The trainer's
helpers that hold checkpoint data (ckptrun's engine, DCP's checkpoint daemon) are counted.
Shared memory mapped by two of them (staging slots) counts once per process that touched it,
as RSS does.

Page cache is the machine's file-backed cache (/proc/meminfo Cached less Shmem: the staging
slots are shared memory, not checkpoint files): its peak during the run less its value at the
start, what buffered checkpoint writes leave behind. It counts every process of the machine.
"""

from __future__ import annotations

import threading
from pathlib import Path

import psutil


def file_cache_bytes() -> int:
    """Page cache holding files (Cached - Shmem), 0 where /proc/meminfo is not readable."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return (int(fields["Cached"].split()[0]) - int(fields["Shmem"].split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return 0


class PeakRss:
    """Samples in a thread until `stop()`; `peak_MB` is the largest sum seen, `cache_growth_MB`
    the page cache's largest growth over its value when it was made."""

    def __init__(self, pid: int, *, include_root: bool, interval_s: float = 0.1) -> None:
        self.root = psutil.Process(pid)
        self.include_root, self.interval_s = include_root, interval_s
        self.peak_bytes = 0
        self.cache_start = self.cache_peak = file_cache_bytes()
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

    @property
    def cache_growth_MB(self) -> float:
        return (self.cache_peak - self.cache_start) / 2**20

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
            self.cache_peak = max(self.cache_peak, file_cache_bytes())
            if self._stop.wait(self.interval_s):
                return
