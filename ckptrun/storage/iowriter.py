"""How the engine puts bytes into files: positional writes from any thread, then durability.

Every writer of the engine (record files, a datastates rank file, ...) goes through `open_out`,
so the write path can be swapped without its callers learning which one runs: the pure-Python
`pwrite` path (`OutFile`), or the compiled io_uring + O_DIRECT writer (`NativeOutFile`,
native/uring_writer.c, built by `pip install` when liburing's headers are there). `select`
picks one per process (`--io-engine`, or CKPTRUN_IO_ENGINE when the run leaves it at auto);
`native` where the extension is missing or io_uring is refused falls back to Python with one
warning. Both are equally durable: `sync` is an fsync of the file.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from ..log import log

ENGINES = ("auto", "native", "python")
ENV = "CKPTRUN_IO_ENGINE"
# What `auto` means when CKPTRUN_IO_ENGINE is unset: chosen by measurement (README, "Native writer":
# faster writes, less stall and step time, no page-cache growth); where native cannot run, auto
# quietly takes Python (only an explicit `native` warns).
DEFAULT = "native"


class OutFile:
    """A file being written: `write_at` from any thread (each call writes all of `data`), then
    `sync` (everything written is durable), then `close`."""

    engine = "python"

    def __init__(self, path: Path, *, existing: bool = False) -> None:
        self.path = Path(path)
        create = 0 if existing else os.O_CREAT | os.O_TRUNC
        self.fd = os.open(self.path, os.O_WRONLY | create | os.O_CLOEXEC, 0o644)

    def write_at(self, data: memoryview | bytes, offset: int) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            n = os.pwrite(self.fd, data, offset)
            offset, data = offset + n, data[n:]

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OutFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NativeOutFile(OutFile):
    """The same file through ckptrun._uring: whole 4 KiB pages with O_DIRECT (the page cache is
    not filled with checkpoint bytes), `DEPTH` pieces of `PIECE` bytes in flight; partial pages
    and writes under `SMALL` bytes (indexes, manifests, small records) buffered. `write_at` returns once its
    bytes are written, so the caller may reuse its memory."""

    engine = "native"
    DEPTH = 8
    PIECE = 1 << 20
    SMALL = 1 << 20  # measured: below this, O_DIRECT's device round trip loses to the page cache

    def __init__(self, path: Path, *, existing: bool = False) -> None:
        from .. import _uring

        self.path = Path(path)
        self._writer = _uring.Writer(os.fsencode(self.path), self.DEPTH, self.PIECE, small=self.SMALL,
                                     truncate=not existing)

    @property
    def fd(self) -> int:
        return self._writer.fd

    @property
    def direct(self) -> bool:
        """Whether whole pages bypass the page cache (False on file systems refusing O_DIRECT)."""
        return self._writer.direct

    def write_at(self, data: memoryview | bytes, offset: int) -> None:
        self._writer.write_at(memoryview(data).cast("B"), offset)

    def sync(self) -> None:
        self._writer.sync()

    def close(self) -> None:
        self._writer.close()


@functools.cache
def native_unavailable() -> str | None:
    """Why the compiled writer cannot run in this process; None when it can."""
    try:
        from .. import _uring
    except ImportError as e:
        return (f"the compiled writer ckptrun._uring is not built ({e}); install liburing's headers "
                "(Debian/Ubuntu: liburing-dev) and reinstall ckptrun, see native/README.md")
    try:
        _uring.probe()
    except OSError as e:
        return f"io_uring is refused here ({e.strerror}; kernel.io_uring_disabled or a seccomp filter?)"
    return None


def availability() -> str:
    """One line for headers (`ckptrun bench`): what `auto` runs and whether native can run here."""
    why = native_unavailable()
    return f"auto = {DEFAULT}, native " + ("available (io_uring + O_DIRECT)" if why is None else f"unavailable: {why}")


_current: type[OutFile] | None = None  # None: not chosen yet (the first open_out chooses `auto`)
_warned = False


def select(name: str = "auto") -> str:
    """Choose the writer of this process's files; returns the one that runs ("native" or
    "python"). `auto`: CKPTRUN_IO_ENGINE when set, else DEFAULT."""
    global _current
    _current = _resolve(name)
    return _current.engine


def _resolve(name: str) -> type[OutFile]:
    global _warned
    if name not in ENGINES:
        raise ValueError(f"io engine must be one of {', '.join(ENGINES)} (got {name!r})")
    explicit = name != "auto"
    if not explicit and os.environ.get(ENV, "auto") != "auto":
        name, explicit = os.environ[ENV], True
        if name not in ENGINES:
            log.warning(f"{ENV}={name!r} is not one of {', '.join(ENGINES)}; using the {DEFAULT} writer")
            name, explicit = DEFAULT, False
    if name == "auto":
        name = DEFAULT
    why = native_unavailable() if name == "native" else None
    if why is not None:
        if explicit and not _warned:
            log.warning(f"the native writer is unavailable, the Python writer runs instead: {why}")
            _warned = True
        name = "python"
    return NativeOutFile if name == "native" else OutFile


def _writer() -> type[OutFile]:
    if _current is None:
        select()
    return _current or OutFile


def engine_name() -> str:
    """The writer `open_out` uses now: "native" or "python"."""
    return _writer().engine


def open_out(path: str | os.PathLike, *, existing: bool = False) -> OutFile:
    """Create (or truncate) `path` for writing, with the selected writer; `existing`: open the
    file that is there, to write it in place (FileNotFoundError if it is gone)."""
    return _writer()(Path(path), existing=existing)
