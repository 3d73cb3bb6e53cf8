"""The write side of a checkpoint directory: rank parts published, and records committed.

A record is a directory (`step-00000010` for a full checkpoint, `diff-00000011-00000015` for a
differential batch). Each rank publishes `rank-NNNNN.data` (4 KiB-aligned raw tensor bytes) and
`rank-NNNNN.json` (dtype/shape/offset/xxh3 per tensor and the JSON skeleton of everything
else), or one self-describing rank file (`storage/rankfile.py`). A record exists for readers
only once `MANIFEST.json` is published, after every rank's files are durable (DESIGN invariant
2). What the writer needs to know of the directory it asks the read side (`store_read.py`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import AlreadyCommitted, CkptrunError, CorruptCheckpoint
from . import rankfile
from .fsutil import FaultHook, _no_fault, fsync_dir, publish_bytes, publish_json
from .schema import FORMAT, MANIFEST, MARKER, Manifest, checksum, is_record_name, rank_files

if TYPE_CHECKING:
    from .dirlock import Claim
    from .store_read import RecordReader

ABANDONED = ".abandoned-"  # an uncommitted record on its way out (`RecordWriter.abandon`)
_RANK_FAILED = re.compile(r"rank-([0-9]{5})\.failed")


class WrittenPart(NamedTuple):
    """One rank's part as `RecordWriter.write_rank` published it."""

    nbytes: int  # its data file's
    index: bytes  # its index file's bytes, which the record's manifest pins

    def summary(self) -> tuple[str, int]:
        """What `RecordReader.part_summary` reads back from the files: (its index's checksum, its data bytes)."""
        return checksum(self.index), self.nbytes


class RecordWriter:
    """Writes one run's records into the directory `reader` reads. With `claim` (a run's,
    storage/dirlock.py), nothing is written once the path names another directory than the one
    the run locked: a write or commit raises DirectoryReplaced (an OSError), a removal of
    uncommitted parts does nothing."""

    def __init__(self, reader: RecordReader, claim: Claim | None = None) -> None:
        self.reader = reader
        self.root = reader.root
        self.claim = claim

    def owned(self) -> bool:
        """Whether the path still names the directory the run locked (a store of no run: yes)."""
        return self.claim is None or self.claim.holds()

    def check_owned(self) -> None:
        """DirectoryReplaced unless the path still names the directory the run locked."""
        if self.claim is not None:
            self.claim.check()

    def ensure_writable(self) -> None:
        """Create the directory and prove it accepts durable writes, or explain why not."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            marker = self.root / MARKER
            if not marker.exists():
                publish_json(marker, {"format": FORMAT, "created": time.time()})
            probe = self.root / f".probe-{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise CkptrunError(
                f"checkpoint directory {self.root} is not writable ({e.strerror}); "
                "pass --dir with a writable path",
                exit_code=2,
            ) from None
        try:
            body = self.reader.marker()
        except (CorruptCheckpoint, ValueError, RecursionError) as e:
            raise CkptrunError(f"{self.root} is not a ckptrun checkpoint directory ({MARKER}: "
                               f"{e if isinstance(e, CorruptCheckpoint) else 'not JSON'})", exit_code=2) from None
        fmt = body.get("format") if isinstance(body, dict) else None
        if fmt != FORMAT:
            raise CkptrunError(f"{self.root} holds checkpoint format {fmt}, this ckptrun reads {FORMAT}")

    # ---- rank parts ---------------------------------------------------------------------
    def write_rank(
        self,
        name: str,
        rank: int,
        data: memoryview,
        tensors: dict[str, dict],
        skeleton: Any,
        meta: dict[str, Any],
        *,
        fault: FaultHook = _no_fault,
        threads: int = 1,
    ) -> WrittenPart:
        """Durably publish one rank's part of record `name`; returns its size and index.

        `tensors` maps key -> {dtype, shape, offset, nbytes}; `data` holds them at those offsets.
        Raises AlreadyCommitted (touching nothing) if `name` is committed, and OSError after
        removing whatever it wrote if a write fails. The run's directory is never re-created: a
        directory deleted under a running job is a save error, not a silent fresh start.
        """
        rdir = self._fresh_part(name, rank)
        data_file, index_file = rank_files(rank)
        index = rank_index(name, rank, data, tensors, skeleton, meta)
        try:
            publish_bytes(rdir / data_file, data, fault=fault, name="data", threads=threads)
            raw = publish_json(rdir / index_file, index, fault=fault, name="index")
        except OSError:
            self.discard_rank(name, rank)
            raise
        return WrittenPart(len(data), raw)

    def begin_rank_file(self, name: str, rank: int, fixed: int, *, fault: FaultHook = _no_fault
                        ) -> rankfile.RankFileWriter:
        """Start one rank's self-describing file of record `name` (layout "file"), its first
        `fixed` bytes at fixed offsets; the same refusals as `write_rank`."""
        return rankfile.RankFileWriter(self._fresh_part(name, rank) / rankfile.file_name(rank), fixed, fault)

    def _fresh_part(self, name: str, rank: int) -> Path:
        """The folder of record `name`, ready for a new part of `rank`: AlreadyCommitted if the
        record is committed; the run's directory is never re-created; a stale part of an
        earlier attempt is removed first (it must not commit)."""
        self.check_owned()  # (first: a record of the same name in another run's directory is not ours)
        if self.reader.is_committed(name):
            raise AlreadyCommitted(f"{name} is committed; committed records are immutable")
        if not (self.root / MARKER).is_file():
            raise FileNotFoundError(errno.ENOENT, f"checkpoint directory {self.root} is gone (no {MARKER})")
        rdir = self.root / name
        rdir.mkdir(exist_ok=True)
        self.discard_rank(name, rank, keep_dir=True)
        return rdir

    def _own_record_dir(self, name: str) -> Path | None:
        """`name`'s directory if it is one this store may delete from: a record name, a real
        directory (never a symbolic link out of --dir), not committed."""
        rdir = self.root / name
        if not is_record_name(name) or rdir.is_symlink() or self.reader.is_committed(name):
            return None
        return rdir

    def discard_rank(self, name: str, rank: int, *, keep_dir: bool = False) -> None:
        """Remove one rank's files of an uncommitted record (and the record's directory once it
        is empty). A committed record is never touched: that is retention's job alone."""
        rdir = self._own_record_dir(name)
        if rdir is None or not self.owned():
            return
        for f in (rank_files(rank)[1], rankfile.file_name(rank), rank_files(rank)[0]):  # index first: the part
            # stops counting
            with contextlib.suppress(OSError):
                (rdir / f).unlink(missing_ok=True)
        if not keep_dir:
            with contextlib.suppress(OSError):
                rdir.rmdir()  # only if empty; other ranks' files keep it

    def mark_failed(self, name: str, rank: int) -> None:
        """Tell the committer (another process) that this rank's part of `name` will not come.
        Best effort: with the disk full even an empty file may fail; the record then waits."""
        rdir = self._own_record_dir(name)
        with contextlib.suppress(OSError):
            if rdir is not None and self.root.is_dir() and self.owned():
                rdir.mkdir(exist_ok=True)
                (rdir / f"rank-{rank:05d}.failed").touch()

    def failed_ranks(self, name: str) -> list[int]:
        rdir = self._own_record_dir(name)
        if rdir is None or not rdir.is_dir():
            return []
        return sorted(int(m[1]) for p in rdir.iterdir() if (m := _RANK_FAILED.fullmatch(p.name)))

    def abandon(self, name: str) -> None:
        """Remove an uncommitted record whose commit will never happen (a rank failed to write
        it, or it depends on one that did). Never a committed one."""
        rdir = self._own_record_dir(name)
        if rdir is None or not self.owned():
            return
        # Moved aside before it is removed, and put back if it was committed between the check
        # and the move: a commit never lands in a directory on its way out.
        aside = rdir.with_name(f"{ABANDONED}{name}-{os.getpid()}")
        try:
            os.rename(rdir, aside)
        except OSError:  # gone already
            return
        if os.path.lexists(aside / MANIFEST):
            os.rename(aside, rdir)
            return
        shutil.rmtree(aside, ignore_errors=True)

    # ---- committing ---------------------------------------------------------------------
    def try_commit(
        self,
        name: str,
        *,
        kind: str,
        step: int,
        first_step: int,
        world_size: int,
        depends_on: list[str] | None = None,
        meta: dict[str, Any] | None = None,
        fault: FaultHook = _no_fault,
        layout: str = "records",
        parts: dict[int, tuple[str, int]] | None = None,
    ) -> Manifest | None:
        """Publish the manifest of `name` if every rank's part (in `layout`) is there; else None.
        `parts`: each rank's (index checksum, data bytes) as its engine reported them (a node-local
        --dir holds only its node's parts), instead of read here."""
        self.check_owned()
        rdir = self.root / name
        if (rdir / MANIFEST).exists():
            fsync_dir(rdir)  # a retry after a failed directory fsync makes the commit durable
            return self.reader.manifest(name)
        if parts is None:
            every_rank = self.reader.ranks_present(name, layout) == list(range(world_size))
            if not every_rank or not self._data_present(name, world_size, layout):
                return None
            parts = {r: self.reader.part_summary(name, r, layout) for r in range(world_size)}
        if sorted(parts) != list(range(world_size)):
            return None
        sizes = [parts[r][1] for r in range(world_size)]
        m = Manifest(name, kind, step, first_step, world_size, sum(sizes), list(depends_on or []),
                     dict(meta or {}), {str(r): parts[r][0] for r in range(world_size)}, time.time(),
                     layout=layout, rank_bytes=sizes)
        publish_json(rdir / MANIFEST, m.to_json(), fault=fault, name="manifest")
        return m

    def _data_present(self, name: str, world_size: int, layout: str) -> bool:
        """Every rank's data file beside its index: a part is published data first, so an index
        alone means its data was removed since (never pinned by a manifest)."""
        return layout != "records" or all(os.path.isfile(self.root / name / rank_files(r)[0])
                                           for r in range(world_size))

    def adopt_manifest(self, name: str, raw: bytes, ranks: list[int]) -> Manifest:
        """Publish in this --dir (a node-local one) the manifest global rank 0 committed `name`
        with (`raw`, through the job store), once it names `name` and pins exactly the indexes
        of `ranks`, this node's parts of it written here; CorruptCheckpoint (nothing published)
        otherwise."""
        self.check_owned()
        try:
            m = Manifest.from_json(json.loads(raw))
        except (ValueError, RecursionError):
            raise CorruptCheckpoint(f"{name}: the committed manifest is not valid JSON") from None
        if m.name != name:
            raise CorruptCheckpoint(f"{name}: the committed manifest names {m.name}")
        for r in ranks:
            if m.index_checksums.get(str(r)) != self.reader.part_summary(name, r, m.layout)[0]:
                raise CorruptCheckpoint(f"{name}: the committed manifest pins another rank {r} part than "
                                        f"{self.reader.where}'s")
        if not self.reader.is_committed(name):
            publish_json(self.root / name / MANIFEST, m.to_json(), name="manifest")
        return m


def rank_index(name: str, rank: int, data: memoryview, tensors: dict[str, dict], skeleton: Any,
               meta: dict[str, Any]) -> dict:
    """One rank's index of record `name` (rank-NNNNN.json, or a region slot's): each tensor's
    place with the xxh3 of its bytes in `data`, the skeleton and the metadata."""
    sums = {k: {**spec, "xxh3": checksum(data[spec["offset"] : spec["offset"] + spec["nbytes"]])}
            for k, spec in tensors.items()}
    return {"format": FORMAT, "record": name, "rank": rank, "data": rank_files(rank)[0],
            "data_nbytes": len(data), "tensors": sums, "skeleton": skeleton, "meta": meta}
