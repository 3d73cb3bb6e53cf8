"""One run owns a checkpoint directory at a time (DESIGN invariant 6).

The launcher holds an exclusive `flock` on `<dir>/ckptrun.lock` for the whole run and writes who
it is into the file; its engines hold a shared `flock` on `<dir>/ckptrun.lock.engines` for as long
as they live, so a directory whose launcher died while its engines still write is not free
either. The OS drops both locks when their holders die, so a lock left by a dead run is simply
taken over (and said). Read-only commands never take them. A multi-node run locks per host
(`ckptrun.lock.<host>`): the nodes of one job share the directory. Each holder writes only while
the path still names the lock file it holds (`Claim`): a --dir deleted under a run, made again
by another, is no longer its own.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from ..errors import CkptrunError

LOCK = "ckptrun.lock"
ENGINES_WAIT_S = 10.0  # how long a new launcher waits for a dead run's engines to exit


class DirectoryInUse(CkptrunError):
    exit_code = 2


class DirectoryReplaced(OSError):
    """A run's --dir is no longer the directory it locked (`Claim`): a save error, never a write."""

    def __str__(self) -> str:
        return str(self.strerror)


class Claim:
    """A lock file this process holds open, which its path must still name: the proof that
    `<dir>` is the directory this run locked. The OS lock stays on a deleted file, so a --dir
    deleted under a run, or deleted and made again (by another run), is told by the file's
    (device, inode); holding it open keeps that inode from being reused meanwhile."""

    def __init__(self, path: Path, fd: int) -> None:
        st = os.fstat(fd)
        self.path, self._id = Path(path), (st.st_dev, st.st_ino)

    def problem(self) -> str | None:
        """Why the path no longer names the locked file, if it does not."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            st = None
        if st is not None and (st.st_dev, st.st_ino) == self._id:
            return None
        root = self.path.parent
        how = "was replaced by another directory" if root.exists() else "is gone"
        return f"checkpoint directory {root} {how} since this run locked it"

    def holds(self) -> bool:
        return self.problem() is None

    def check(self) -> None:
        """DirectoryReplaced, saying which, unless the path still names the locked file."""
        if (problem := self.problem()) is not None:
            raise DirectoryReplaced(errno.ESTALE, problem)


def lock_name(per_host: bool) -> str:
    return f"{LOCK}.{socket.gethostname()}" if per_host else LOCK


def _try_flock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _describe(info: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')}, started {started}"


def _read_info(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096) or b"{}")
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def live_holder(root: Path) -> str | None:
    """Who runs on `root` now, if anyone, for read-only commands: no lock is taken (a reader must
    never stand in a launcher's way); the holder's record is read and its pid checked on this host."""
    import psutil

    for path in root.glob(f"{LOCK}*"):
        if path.name.endswith(".engines"):
            continue
        try:  # the directory is untrusted: a FIFO or a link named like the lock is not read
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            info = _read_info(fd) if stat.S_ISREG(os.fstat(fd).st_mode) else {}
        finally:
            os.close(fd)
        try:
            alive = info.get("host") != socket.gethostname() or psutil.pid_exists(int(info.get("pid", 0)))
        except (TypeError, ValueError):
            continue
        if info and alive:
            return _describe(info)
    return None


class DirLock:
    """The launcher's lock on a checkpoint directory."""

    def __init__(self, root: Path, name: str = LOCK) -> None:
        self.path = root / name
        self.engines_path = root / f"{name}.engines"
        self.fd: int | None = None
        self.claim: Claim | None = None  # while held
        self.taken_over: str | None = None  # who held it before and died without releasing it

    def acquire(self) -> DirLock:
        """Take the directory, or raise DirectoryInUse naming the holder and the fix."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if not _try_flock(fd, fcntl.LOCK_EX):
            holder = _describe(_read_info(fd))
            os.close(fd)
            raise DirectoryInUse(f"checkpoint directory {self.path.parent} is in use by another ckptrun run "
                                 f"({holder}); wait for it to finish or stop it, or pass another --dir")
        try:
            self._wait_for_engines()
        except BaseException:
            os.close(fd)
            raise
        previous = _read_info(fd)
        if previous:  # a clean release empties the file: this holder died holding it
            self.taken_over = _describe(previous)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.fsync(fd)
        self.fd, self.claim = fd, Claim(self.path, fd)
        return self

    def _wait_for_engines(self) -> None:
        """Engines of a run whose launcher died exit on their own (parent-death); wait for them."""
        fd = os.open(self.engines_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + ENGINES_WAIT_S
            while not _try_flock(fd, fcntl.LOCK_EX):
                if time.monotonic() > deadline:
                    raise DirectoryInUse(
                        f"checkpoint engines of an earlier run still write to {self.path.parent}; wait for them "
                        f"to exit (`fuser {self.engines_path}` lists them), or pass another --dir")
                time.sleep(0.1)
        finally:
            os.close(fd)  # closing drops our exclusive probe

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        os.close(self.fd)
        self.fd, self.claim = None, None


def hold_for_engine(engines_path: str) -> Claim:
    """An engine's share of the lock, held until the process exits (the fd is never closed)."""
    fd = os.open(engines_path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return Claim(Path(engines_path), fd)
