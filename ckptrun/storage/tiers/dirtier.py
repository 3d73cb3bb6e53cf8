"""The tier on a plain path (a shared file system): one folder per record, like --dir.

Each object is written to a hidden temporary file, fsynced and renamed into place, so a reader
never sees a part of one; the temporaries a killed writer left are what `sweep_partial` removes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from ...errors import CkptrunError, CorruptCheckpoint
from ..fsutil import _no_fault, fsync_dir, open_regular
from .base import Tier, UploadFault
from .source import Source

CHUNK = 8 << 20
_TMP = ".part-"


class DirTier(Tier):
    """Records under the folder `root`."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.url = str(root)

    def probe(self, write: bool = True) -> None:
        if not write:
            if not self.root.is_dir():
                raise CkptrunError(f"no checkpoint directory at {self.url}", exit_code=2)
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise CkptrunError(f"--durable {self.url} is not writable ({e.strerror})", exit_code=2) from None

    def _list(self) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        if not self.root.is_dir():
            return out
        with os.scandir(self.root) as top:
            for e in top:
                if e.name.startswith("."):
                    continue
                if not e.is_dir(follow_symlinks=False):
                    out.append((e.name, _size(e)))
                    continue
                with os.scandir(e.path) as inner:
                    out += [(f"{e.name}/{f.name}", _size(f)) for f in inner if _TMP not in f.name]
        return out

    def put(self, key: str, src: Source, fault: UploadFault = _no_fault) -> None:
        path = self.root / key
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}{_TMP}{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                for chunk in src.chunks(CHUNK):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(path.parent)

    def get(self, key: str, dest: Path, size: int) -> None:
        fd = open_regular(self.root / key, f"{self.url}: {key}")
        with os.fdopen(fd, "rb") as f, open(dest, "wb") as out:
            shutil.copyfileobj(f, out, CHUNK)
            if out.tell() != size:
                raise CorruptCheckpoint(f"{self.url}: {key} changed while read ({out.tell()} bytes, listed {size})")

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            (self.root / key).unlink(missing_ok=True)
        for parent in {key.split("/")[0] for key in keys if "/" in key}:
            with contextlib.suppress(OSError):
                (self.root / parent).rmdir()  # only once empty

    def sweep_partial(self) -> int:
        left = [p for p in self.root.glob(f"*/.*{_TMP}*") if not p.is_symlink()] if self.root.is_dir() else []
        for p in left:
            p.unlink(missing_ok=True)
        return len(left)


def _size(entry: os.DirEntry) -> int:
    """A regular file's size; -1 (refused by the listing) for a link, a folder or anything else."""
    return entry.stat(follow_symlinks=False).st_size if entry.is_file(follow_symlinks=False) else -1
