"""Peak memory of a run's trainer and checkpoint engine, and the machine's page-cache growth
while it runs, sampled from outside.

Counted: the process tree, leaving out multiprocessing's resource tracker and, for ckptrun
runs, the launcher (it supervises; torchrun's agent would be there anyway). The trainer's
helpers that hold checkpoint data (ckptrun's engine, DCP's checkpoint daemon) are counted.

Three figures, all peaks of a sum over those processes:
- RSS, as `ps` shows it: shared memory mapped by two processes (ckptrun's staging slots, which
  the trainer fills and the engine writes out) counts once per process that touched it.
- Memory held: private and file-backed resident pages per process (/proc/PID/status RssAnon +
  RssFile) plus every shared-memory file the processes map, counted once at its mapped size:
  RSS with the staging counted once. (PSS would also split shared libraries, but walking a
  process's page tables 10 times a second costs ~10 ms per GB and would slow the run measured.)
- Staging: those shared-memory files alone (the slots, lowdiff+'s replica), what /dev/shm and
  host memory must hold for the run's checkpoints.

Page cache is the machine's file-backed cache (/proc/meminfo Cached less Shmem: the staging
slots are shared memory, not checkpoint files): its peak during the run less its value at the
start, what buffered checkpoint writes leave behind. It counts every process of the machine.

The same samples record each process's CPU time (`proccpu.CpuTrace`, the launcher included),
so one walk of the process tree serves both.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import psutil

from ..ipc.staging import shm_root
from .proccpu import CpuTrace

MB = 2**20


def file_cache_bytes() -> int:
    """Page cache holding files (Cached - Shmem), 0 where /proc/meminfo is not readable."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return (int(fields["Cached"].split()[0]) - int(fields["Shmem"].split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return 0


def resident_bytes(pid: int) -> tuple[int, int] | None:
    """(RSS, RssAnon + RssFile) of `pid`: all its resident pages, and those less shared memory,
    from one read of /proc/PID/status; None where unreadable (the process is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        fields = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in lines)
                  if k in ("VmRSS", "RssAnon", "RssFile")}
        return fields["VmRSS"], fields["RssAnon"] + fields["RssFile"]
    except (OSError, KeyError, ValueError):
        return None


def shared_mappings(pid: int, root: Path) -> dict[tuple[str, str], int]:
    """{(device, inode): mapped bytes} of the files under `root` (shared memory) that `pid` maps."""
    out: dict[tuple[str, str], int] = {}
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return out
    prefix = f"{root}/"
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith(prefix):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            key = (parts[3], parts[4])
            out[key] = max(out.get(key, 0), hi - lo)
    return out


@dataclass
class Memory:
    """A run's peaks (MB) and page-cache growth (MB); see the module docstring."""

    peak_rss_MB: float = 0.0
    peak_MB: float = 0.0
    staging_MB: float = 0.0
    page_cache_MB: float = 0.0


class PeakMemory:
    """Samples in a thread until `stop()`, which returns the `Memory` peaks; `cpu` holds the CPU
    times sampled alongside."""

    def __init__(self, pid: int, *, include_root: bool, interval_s: float = 0.1) -> None:
        self.root = psutil.Process(pid)
        self.include_root, self.interval_s = include_root, interval_s
        self.shm = shm_root()
        self.rss = self.held = self.staging = 0
        self.cache_start = self.cache_peak = file_cache_bytes()
        self.cpu = CpuTrace(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptrun-bench-memory", daemon=True)

    def start(self) -> PeakMemory:
        self._thread.start()
        return self

    def stop(self) -> Memory:
        self._stop.set()
        self._thread.join()
        return Memory(self.rss / MB, self.held / MB, self.staging / MB, (self.cache_peak - self.cache_start) / MB)

    def processes(self, *, root: bool = False) -> list[psutil.Process]:
        """The counted processes now (see the module docstring); `root`: the root too, counted
        or not."""
        try:
            procs = ([self.root] if self.include_root or root else []) + self.root.children(recursive=True)
        except psutil.Error:
            return []
        out = []
        for p in procs:
            try:
                if not any("resource_tracker" in part for part in p.cmdline()):
                    out.append(p)
            except psutil.Error:
                continue
        return out

    def sample(self) -> tuple[int, int, int]:
        """(RSS, memory held, staging) bytes of the counted processes now (gone ones count 0);
        records their CPU times and the root's in `cpu`."""
        rss = own = 0
        shared: dict[tuple[str, str], int] = {}
        procs = self.processes(root=True)
        self.cpu.record(procs)
        for p in procs:
            if p.pid == self.root.pid and not self.include_root:
                continue
            resident = resident_bytes(p.pid)
            if resident is None:
                continue
            rss, own = rss + resident[0], own + resident[1]
            for key, nbytes in shared_mappings(p.pid, self.shm).items():
                shared[key] = max(shared.get(key, 0), nbytes)
        staging = sum(shared.values())
        return rss, own + staging, staging

    def _run(self) -> None:
        while True:
            rss, held, staging = self.sample()
            self.rss, self.held, self.staging = max(self.rss, rss), max(self.held, held), max(self.staging, staging)
            self.cache_peak = max(self.cache_peak, file_cache_bytes())
            if self._stop.wait(self.interval_s):
                return
