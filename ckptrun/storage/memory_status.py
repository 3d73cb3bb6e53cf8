"""Which step an engine holds in memory, told to read-only commands: its own rank's (lowdiff+'s
replica) and, with --replicas, the copies it holds of its partners' parts.

Not a record: the state itself is in the engine's memory, survives a worker crash and is lost
with the engine. Each engine that holds one rewrites `<dir>/ckptrun.memory.rNNNNN` (its rank,
step, bytes, pid, host) when it moves, `<dir>/ckptrun.copies.rNNNNN.pPID` for each copy of
rank NNNNN's part of a record it holds, and `<dir>/ckptrun.heldcopies.rNNNNN.pPID` for its copy
of the newest step rank NNNNN holds in memory only; `ckptrun ls` lists them while that process
lives.
The files are read as untrusted input like the rest of the directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
from pathlib import Path

OWN = "ckptrun.memory.r"  # what an engine holds of its own rank
COPIES = "ckptrun.copies.r"  # a partner's copy of a record: `{COPIES}{owner:05d}.p{the holding engine's pid}`
HELD_COPIES = "ckptrun.heldcopies.r"  # a partner's copy of a step it holds in memory only (the same)
FIELDS = ("rank", "step", "nbytes", "pid")


def _path(root: Path, rank: int, of: str) -> Path:
    return root / (f"{OWN}{rank:05d}" if of == OWN else f"{of}{rank:05d}.p{os.getpid()}")


def publish(root: Path, rank: int, step: int, nbytes: int, *, of: str = OWN) -> None:
    """Say that this process holds `step` of `rank` (`of`: its own, or a partner's copy);
    write-then-rename, no fsync: it is volatile."""
    path = _path(root, rank, of)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"rank": rank, "step": step, "nbytes": nbytes, "pid": os.getpid(),
                               "host": socket.gethostname()}))
    os.replace(tmp, path)


def withdraw(root: Path, rank: int, *, of: str = OWN) -> None:
    with contextlib.suppress(OSError):
        _path(root, rank, of).unlink()


def live(root: Path, *, of: str = OWN) -> list[dict]:
    """The in-memory steps of engines alive on this host, by rank: their own, or (`of`) the
    partners' copies they hold (by the rank whose part each is)."""
    import psutil

    found = []
    for path in sorted(root.glob(f"{of}*")):
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
