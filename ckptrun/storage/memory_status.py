"""Which step an engine holds in memory (lowdiff+'s replica), told to read-only commands.

Not a record: the state itself is in the engine's memory, survives a worker crash and is lost
with the engine. Each engine that holds one rewrites `<dir>/ckptrun.memory.rNNNNN` (its rank,
step, bytes, pid, host) when it moves; `ckptrun ls` lists it while that process lives. The file
is read as untrusted input like the rest of the directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
from pathlib import Path

PREFIX = "ckptrun.memory.r"
FIELDS = ("rank", "step", "nbytes", "pid")


def _path(root: Path, rank: int) -> Path:
    return root / f"{PREFIX}{rank:05d}"


def publish(root: Path, rank: int, step: int, nbytes: int) -> None:
    """Say that this process holds `step` of `rank` (write-then-rename; no fsync: it is volatile)."""
    path = _path(root, rank)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"rank": rank, "step": step, "nbytes": nbytes, "pid": os.getpid(),
                               "host": socket.gethostname()}))
    os.replace(tmp, path)


def withdraw(root: Path, rank: int) -> None:
    with contextlib.suppress(OSError):
        _path(root, rank).unlink()


def live(root: Path) -> list[dict]:
    """The in-memory steps of engines alive on this host, by rank."""
    import psutil

    found = []
    for path in sorted(root.glob(f"{PREFIX}*")):
        try:  # only a regular file, never followed through a link, at most a few KiB
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            info = json.loads(os.read(fd, 4096)) if stat.S_ISREG(os.fstat(fd).st_mode) else None
        except (OSError, ValueError):
            info = None
        finally:
            os.close(fd)
        if not (isinstance(info, dict) and all(type(info.get(k)) is int and info[k] >= 0 for k in FIELDS)):
            continue
        if info.get("host") == socket.gethostname() and psutil.pid_exists(info["pid"]):
            found.append({k: info[k] for k in FIELDS})
    return found
