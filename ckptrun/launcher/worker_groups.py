"""What a dead worker started, ended with it.

torch elastic starts each worker in a session of its own (its process group's id is its pid) and,
when it closes its workers (before a restart, at the end of the run), signals the group of each
worker still running. A worker that has died already (a crash, an out-of-memory kill, SIGKILL) is
skipped, so whatever it started lives on: a DataLoader's forkserver and the loader workers forked
from it (their parent, the forkserver, is alive, so they never notice), or the script's own
helpers. They hold host memory and the launcher's output pipes (a `ckptrun ... | tee` or a CI
log that never ends), and every restart adds more. After the agent's close, what is left of each
worker's group gets SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Iterable

GRACE_S = 5.0  # from SIGTERM to SIGKILL for what a closed worker left


def install() -> None:
    """End what is left of each worker's process group after torch elastic closes its workers
    (call it in the launcher, before the agent starts)."""
    from torch.distributed.elastic.multiprocessing import api

    close = api.SubprocessContext._close
    if getattr(close, "ends_groups", False):
        return

    @functools.wraps(close)
    def close_and_end_groups(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        try:
            close(self, death_sig, timeout)
        finally:
            end_groups([h.proc.pid for h in (self.subprocess_handlers or {}).values()])

    close_and_end_groups.ends_groups = True  # type: ignore[attr-defined]
    api.SubprocessContext._close = close_and_end_groups


def end_groups(pgids: Iterable[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM every process of the groups `pgids`, then SIGKILL those still there after `grace_s`.
    A group's id is its leader's pid, which the kernel gives no new process while the group has
    members: a group found under a dead worker's pid is the one that worker made."""
    left = _running(set(pgids) - {os.getpgrp()})
    for g in left:
        _signal(g, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = _running(left)
    for g in left:
        _signal(g, signal.SIGKILL)


def _running(pgids: set[int]) -> set[int]:
    """Those of `pgids` with a process still running (a zombie, waiting to be reaped, is not)."""
    import psutil

    found: set[int] = set()
    if not pgids:
        return found
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and (g := os.getpgid(p.pid)) in pgids:
                found.add(g)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def _signal(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
