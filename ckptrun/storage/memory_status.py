"""Which step an engine holds in memory, told to read-only commands: its own rank's (lowdiff+'s
replica) and, with --replicas, the copies it holds of its partners' parts.

Not a record: the state itself is in the engine's memory, survives a worker crash and is lost
with the engine. Each engine that holds one rewrites `<dir>/ckptrun.memory.rNNNNN` (its rank,
step, bytes, pid, host) when it moves, and `<dir>/ckptrun.copies.rNNNNN.pPID` for each copy of
rank NNNNN's part it holds; `ckptrun ls` lists them while that process lives.
The files are read as untrusted input like the rest of the directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
from pathlib import Path

PREFIX = "ckptrun.memory.r"
COPIES = "ckptrun.copies.r"  # a partner's copy: `{COPIES}{owner:05d}.p{the holding engine's pid}`
FIELDS = ("rank", "step", "nbytes", "pid")


def _path(root: Path, rank: int, copy: bool) -> Path:
    return root / (f"{COPIES}{rank:05d}.p{os.getpid()}" if copy else f"{PREFIX}{rank:05d}")


def publish(root: Path, rank: int, step: int, nbytes: int, *, copy: bool = False) -> None:
    """Say that this process holds `step` of `rank` (a partner's copy, with `copy`);
    write-then-rename, no fsync: it is volatile."""
    path = _path(root, rank, copy)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"rank": rank, "step": step, "nbytes": nbytes, "pid": os.getpid(),
                               "host": socket.gethostname()}))
    os.replace(tmp, path)


def withdraw(root: Path, rank: int, *, copy: bool = False) -> None:
    with contextlib.suppress(OSError):
        _path(root, rank, copy).unlink()


def live(root: Path, *, copies: bool = False) -> list[dict]:
    """The in-memory steps of engines alive on this host, by rank: their own, or with `copies`
    the partners' copies they hold (by the rank whose part each is)."""
    import psutil

    found = []
    for path in sorted(root.glob(f"{COPIES if copies else PREFIX}*")):
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
