"""What a killed run leaves behind, whose it is, and who removes it.

A run keeps its staging slots in shared memory (`staging.py`) and its sockets, metrics and worker
logs in a temporary folder. A normal exit removes both; a SIGKILL of the whole tree cannot. So
every such name carries the run's tag, and the tag names the launcher that owns it: its pid, the
pid's start time (a reused pid is not its owner) and a digest of the host and pid namespace (a pid
means nothing elsewhere). A new launcher removes what belongs to launchers that are gone
(`sweep_stale`), never a live run's. Engines end with their launcher (`exit_with_owner`) and
remove their own staging files on the way out.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ..ipc.staging import shm_root

PREFIX = "ckptrun-"
_OWNED = re.compile(rf"^{PREFIX}(\d+)\.([0-9a-f]+)\.([0-9a-f]+)\.[0-9a-f]+-")
_PR_SET_PDEATHSIG = 1
WATCH_S = 0.2


@functools.cache
def _host() -> str:
    """This host and pid namespace, as a short digest (an owner pid is only checked where it means something)."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return hashlib.blake2s(f"{socket.gethostname()}\0{ns}".encode(), digest_size=3).hexdigest()


def _start_cs(proc: psutil.Process) -> int:
    return round(proc.create_time() * 100)


@dataclass(frozen=True)
class Owner:
    """The launcher process that owns a run's leftovers."""

    pid: int
    start: int  # the process's start time, centiseconds since the epoch
    host: str = field(default_factory=_host)

    @classmethod
    def current(cls) -> Owner:
        return cls(os.getpid(), _start_cs(psutil.Process()))

    @classmethod
    def of(cls, name: str) -> Owner | None:
        """The owner named in a staging file's or temporary folder's name; None if it names none."""
        m = _OWNED.match(name)
        return cls(int(m[1]), int(m[2], 16), m[3]) if m else None

    def tag(self) -> str:
        """A new run tag owned by this owner (random, so one process can launch several runs)."""
        return f"{self.pid}.{self.start:x}.{self.host}.{secrets.token_hex(2)}"

    def alive(self) -> bool:
        """Still running (or not ours to judge: another host or pid namespace, or no permission)."""
        if self.host != _host():
            return True
        try:
            proc = psutil.Process(self.pid)
            return abs(_start_cs(proc) - self.start) <= 1 and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
        except psutil.Error:
            return True


def new_tag() -> str:
    """The tag of a run this process launches."""
    return Owner.current().tag()


def run_name(tag: str, *parts: object) -> str:
    """The name of one of the run's files: `run_name(tag, "")` prefixes its temporary folder,
    `run_name(tag, local_rank, slot)` is a staging file, "*" parts make a glob."""
    return PREFIX + "-".join([tag, *map(str, parts)])


def staging_path(tag: str, local_rank: int, slot: int) -> Path:
    return shm_root() / run_name(tag, local_rank, slot)


def remove_staging(tag: str, local_rank: int | str = "*") -> None:
    """Remove a run's staging files (one local rank's, or all); a process mapping one keeps its memory."""
    for path in shm_root().glob(run_name(tag, local_rank, "*")):
        path.unlink(missing_ok=True)


@dataclass
class Swept:
    bytes: int = 0
    files: int = 0
    folders: int = 0
    owners: set[Owner] = field(default_factory=set)

    def __str__(self) -> str:
        return (f"freed {self.bytes:,} bytes left by {len(self.owners)} killed run(s) "
                f"({self.files} staging file(s), {self.folders} temporary folder(s))")


def _footprint(path: Path) -> int:
    """Bytes a file or folder occupies (allocated blocks: a staging file is sparse until written)."""
    st = path.lstat()
    total = st.st_blocks * 512
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except OSError:
                    pass
    return total


def owned() -> Iterator[tuple[Path, Owner]]:
    """Every staging file and temporary folder whose name says who owns it, with its owner."""
    for root in {shm_root(), Path(tempfile.gettempdir())}:
        for path in root.glob(f"{PREFIX}*"):
            if (owner := Owner.of(path.name)) is not None:
                yield path, owner


def sweep_stale() -> Swept:
    """Remove the staging files and temporary folders of runs whose launcher is gone."""
    swept, alive = Swept(), {}
    for path, owner in owned():
        if alive.setdefault(owner, owner.alive()):
            continue
        try:
            size, folder = _footprint(path), path.is_dir() and not path.is_symlink()
            shutil.rmtree(path) if folder else path.unlink()
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        swept.bytes += size
        swept.folders += folder
        swept.files += not folder
        swept.owners.add(owner)
    return swept


DEATH_SIGNAL = signal.SIGUSR2  # the parent-death signal an engine asks for


def exit_with_owner(owner_pid: int, cleanup: Callable[[], None], *, pdeathsig: bool, name: str) -> None:
    """End this process (an engine) when its parent `owner_pid` (the launcher) dies, after `cleanup`.

    A watchdog thread notices the re-parenting, whatever thread started this process and on any
    platform. With `pdeathsig` (Linux), the kernel also sends DEATH_SIGNAL the moment the parent
    dies; it does so when the parent's *thread* that started this process ends, so only a process
    started from the launcher's main thread asks for it. DEATH_SIGNAL runs `cleanup` and ends the
    process. It is not SIGTERM: an engine ignores the SIGTERM a scheduler sends the whole job, so
    that the launcher can shut it down after the last step is committed.
    """
    try:
        owner = psutil.Process(owner_pid)
    except psutil.NoSuchProcess:
        owner = None

    def gone() -> bool:  # the parent-death signal comes while the dying launcher is still the parent
        try:
            return owner is None or os.getppid() != owner_pid or owner.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def leave() -> None:
        if gone():
            with contextlib.suppress(OSError, RuntimeError):  # no terminal left, or stderr busy in this thread
                print(f"ckptrun: {name}: launcher (pid {owner_pid}) is gone; exiting", file=sys.stderr, flush=True)
        cleanup()

    def on_death_signal(signum: int, frame: object) -> None:
        leave()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def watch() -> None:
        while not gone():
            time.sleep(WATCH_S)
        leave()
        os._exit(1)

    signal.signal(DEATH_SIGNAL, on_death_signal)
    if pdeathsig and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(DEATH_SIGNAL), 0, 0, 0)
    threading.Thread(target=watch, name="ckptrun-owner-watch", daemon=True).start()
