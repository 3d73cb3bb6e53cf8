"""CPU seconds per step of a run's processes, by role, over its timed steps.

A process's CPU since its start includes imports and set-up (seconds of it, against steps of
~0.1 s), so a total read at the end of the run would say little about a step. Instead the bench's
sampler (`procmem.PeakMemory`) records every process's cumulative user + system CPU with the wall
clock, ten times a second; the CPU of the timed steps is each process's value at the window's end
less its value at the window's start, both interpolated between samples (a process counts 0 at
its creation time; one that exited keeps its last sampled value, so up to one interval of a
process that died inside the window is lost).

Roles: `trainer` is the process that wrote the timing file (its `start` event's pid): the
training loop and every thread of it (ckptrun's copy threads in the worker included); `launcher`
is the process the bench started when that is not the trainer (ckptrun's launcher, its dashboard
and metrics reader); `engine` is every other process of the tree (ckptrun's checkpoint engine;
DCP's checkpoint daemon for `dcp-process`), multiprocessing's resource tracker left out.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil

ROLES = ("trainer", "engine", "launcher")


@dataclass
class _Series:
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def at(self, t: float) -> float:
        """Cumulative CPU seconds at wall-clock time `t` (linear between samples)."""
        i = bisect.bisect_right(self.times, t)
        if i == len(self.times):
            return self.cpu[-1]
        if i == 0:
            return 0.0
        t0, t1, c0, c1 = self.times[i - 1], self.times[i], self.cpu[i - 1], self.cpu[i]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1


class CpuTrace:
    """Every sampled process's cumulative CPU seconds over time (see the module docstring)."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.series: dict[int, _Series] = {}

    def record(self, procs: Iterable[psutil.Process], now: float | None = None) -> None:
        """One sample of `procs` (the root among them or not) at `now` (default: the wall clock)."""
        now = time.time() if now is None else now
        for p in procs:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    created = p.create_time()
            except psutil.Error:
                continue
            s = self.series.get(p.pid)
            if s is None:
                s = self.series[p.pid] = _Series([min(created, now)], [0.0])
            s.times.append(now)
            s.cpu.append(t.user + t.system)

    def per_role(self, trainer_pid: int, start: float, end: float) -> dict[str, float | None]:
        """CPU seconds each role used between wall-clock `start` and `end`; `launcher` is None when
        the trainer is the root, `trainer` None when it was never sampled."""
        out: dict[str, float | None] = dict.fromkeys(ROLES, 0.0)
        if self.root_pid == trainer_pid:
            out["launcher"] = None
        if trainer_pid not in self.series:
            out["trainer"] = None
        for pid, s in self.series.items():
            role = "trainer" if pid == trainer_pid else "launcher" if pid == self.root_pid else "engine"
            if out[role] is not None:
                out[role] = out[role] + max(0.0, s.at(end) - s.at(start))
        return out
