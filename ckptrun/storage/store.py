"""The checkpoint directory: immutable records, per-rank raw data + JSON index, atomic commit.

Readers (`ls`, `verify`, `restore`, resume, retention) see committed steps as `Manifest`s and
never learn where the bytes lie: in a record directory (below), in one self-describing file per
rank inside it (`storage/rankfile.py`, layout "file"), or in a slot of the per-rank region files
(`storage/region.py`, layout "region"). All give a rank's index (the same checked JSON) and a
descriptor plus offset of its data (`open_rank`).

A record is a directory (`step-00000010` for a full checkpoint, `diff-00000011-00000015` for a
differential batch). Each rank publishes `rank-NNNNN.data` (4 KiB-aligned raw tensor bytes) and
`rank-NNNNN.json` (dtype/shape/offset/xxh3 per tensor and the JSON skeleton of everything
else). A record exists for readers only once `MANIFEST.json` is published, after every rank's
files are durable (DESIGN invariant 2). Nothing here unpickles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import xxhash
from pydantic import ValidationError

from ..errors import AlreadyCommitted, CkptrunError, CorruptCheckpoint
from ..log import log
from . import rankfile
from .fsutil import FaultHook, _no_fault, fsync_dir, open_regular, publish_bytes, publish_json, why_unopened
from .region import Regions
from .schema import (
    FORMAT,
    MAX_METADATA_BYTES,
    Manifest,
    RankIndex,
    checksum,
    diff_name,
    full_name,
    is_record_name,
    problem,
    rank_files,
)
from .skeleton import check_skeleton

if TYPE_CHECKING:
    from .dirlock import Claim
    from .layout import ReadBuffer

__all__ = ["FORMAT", "MANIFEST", "MARKER", "Manifest", "Store", "checksum", "diff_name", "full_name", "rank_files"]

MANIFEST = "MANIFEST.json"
MARKER = "ckptrun.json"
ABANDONED = ".abandoned-"  # an uncommitted record on its way out (`Store.abandon`)
CHUNK = 1 << 20  # verify hashes data files in pieces of this size (bounded memory)
_RANK_PART = {"records": re.compile(r"rank-([0-9]{5})\.json"), "file": re.compile(r"rank-([0-9]{5})\.ckpt")}
_RANK_FAILED = re.compile(r"rank-([0-9]{5})\.failed")
# A manifest file whose inode was changed less than this long ago is parsed at every scan: a
# rewrite within the filesystem's timestamp granularity could leave its stat unchanged (git's
# "racy" entries). Older ones are parsed again only when their stat changes.
RACY_S = 2.0


def _read_small(fd: int, what: str) -> bytes:
    """All of a metadata file (manifest, index, marker); one over MAX_METADATA_BYTES is not read."""
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > MAX_METADATA_BYTES:
            raise CorruptCheckpoint(f"{what} is {size} bytes (more than {MAX_METADATA_BYTES})")
        return f.read(size)


class WrittenPart(NamedTuple):
    """One rank's part as `Store.write_rank` published it."""

    nbytes: int  # its data file's
    index: bytes  # its index file's bytes, which the record's manifest pins

    def summary(self) -> tuple[str, int]:
        """What `Store.part_summary` reads back from the files: (its index's checksum, its data bytes)."""
        return checksum(self.index), self.nbytes


class Store:
    """One run's checkpoint directory. With `claim` (a run's, storage/dirlock.py), nothing is
    written or removed once the path names another directory than the one the run locked: a
    write, commit or retention raises DirectoryReplaced (an OSError), a removal of uncommitted
    parts does nothing."""

    def __init__(self, root: str | os.PathLike, copy_of: str | None = None, *, claim: Claim | None = None) -> None:
        self.root = Path(root)
        # The remote tier (its URL) that `root` is a private, read-only copy of (`tiers.mirror`):
        # messages name the URL the user gave, and nothing of a node-local disk applies.
        self.copy_of = copy_of
        self.claim = claim
        self.regions = Regions(self.root)
        self._ranks_ok: set[tuple[str, int]] = set()  # committed records whose rank files match world_size
        # record -> (its manifest file's stat identity, the manifest parsed from it): the engine
        # lists --dir at every commit, a lowdiff chain holds hundreds of records (`_scan`).
        self._parsed: dict[str, tuple[tuple[int, ...], Manifest]] = {}

    @property
    def where(self) -> str:
        """What messages call this directory: the URL of the tier it copies, else its path."""
        return self.copy_of or str(self.root)

    @classmethod
    def existing(cls, root: str | os.PathLike) -> Store:
        """The directory a reading command (ls, verify, restore) works on; an error if absent."""
        if not Path(root).is_dir():
            raise CkptrunError(f"no checkpoint directory at {root}; pass --dir", exit_code=2)
        return cls(root)

    # ---- writing -----------------------------------------------------------------------
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
            body = json.loads(_read_small(open_regular(self.root / MARKER, MARKER), MARKER))
        except (CorruptCheckpoint, ValueError, RecursionError) as e:
            raise CkptrunError(f"{self.root} is not a ckptrun checkpoint directory ({MARKER}: "
                               f"{e if isinstance(e, CorruptCheckpoint) else 'not JSON'})", exit_code=2) from None
        fmt = body.get("format") if isinstance(body, dict) else None
        if fmt != FORMAT:
            raise CkptrunError(f"{self.root} holds checkpoint format {fmt}, this ckptrun reads {FORMAT}")

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
        if self.is_committed(name):
            raise AlreadyCommitted(f"{name} is committed; committed records are immutable")
        if not (self.root / MARKER).is_file():
            raise FileNotFoundError(errno.ENOENT, f"checkpoint directory {self.root} is gone (no {MARKER})")
        rdir = self.root / name
        rdir.mkdir(exist_ok=True)
        self.discard_rank(name, rank, keep_dir=True)
        return rdir

    def is_committed(self, name: str) -> bool:
        return is_record_name(name) and os.path.lexists(self.root / name / MANIFEST)

    def _own_record_dir(self, name: str) -> Path | None:
        """`name`'s directory if it is one this store may delete from: a record name, a real
        directory (never a symbolic link out of --dir), not committed."""
        rdir = self.root / name
        if not is_record_name(name) or rdir.is_symlink() or self.is_committed(name):
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

    def ranks_present(self, name: str, layout: str = "records") -> list[int]:
        """The ranks whose part of record `name` (in `layout`: records or file) is published."""
        rdir = self.root / name
        if not rdir.is_dir() or rdir.is_symlink():
            return []
        return sorted(int(m[1]) for p in rdir.iterdir() if (m := _RANK_PART[layout].fullmatch(p.name)))

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
            return self.manifest(name)
        if parts is None:
            every_rank = self.ranks_present(name, layout) == list(range(world_size))
            if not every_rank or not self._data_present(name, world_size, layout):
                return None
            parts = {r: self.part_summary(name, r, layout) for r in range(world_size)}
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

    def part_summary(self, name: str, rank: int, layout: str = "records") -> tuple[str, int]:
        """(checksum of its index, its data bytes) of rank `rank`'s part of uncommitted record
        `name`, as written here by this run's own engine: what the manifest pins."""
        if layout == "file":
            fd = self._open(name, rankfile.file_name(rank), f"rank {rank} file")
            try:
                raw, head = rankfile.read_header(fd, f"{name}: rank {rank} file")
            finally:
                os.close(fd)
            return checksum(raw), head.data_nbytes
        raw = (self.root / name / rank_files(rank)[1]).read_bytes()
        return checksum(raw), json.loads(raw)["data_nbytes"]

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
            if m.index_checksums.get(str(r)) != self.part_summary(name, r, m.layout)[0]:
                raise CorruptCheckpoint(f"{name}: the committed manifest pins another rank {r} part than "
                                        f"{self.where}'s")
        if not self.is_committed(name):
            publish_json(self.root / name / MANIFEST, m.to_json(), name="manifest")
        return m

    # ---- reading: the directory is untrusted input (DESIGN invariant 7) -------------------
    def _open(self, name: str, file: str, what: str) -> int:
        """A read-only descriptor of `file` in record `name`, or CorruptCheckpoint: the record must
        be a real directory (a symbolic link is not followed), the file a regular one."""
        if not is_record_name(name):
            raise CorruptCheckpoint(f"{name!r} is not a record name")
        try:
            dfd = os.open(self.root / name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise CorruptCheckpoint(f"{name}: record directory {why_unopened(e)}") from None
        try:
            return open_regular(file, f"{name}: {what}", dfd)
        finally:
            os.close(dfd)

    def _read_metadata(self, name: str, file: str, what: str) -> bytes:
        return _read_small(self._open(name, file, what), f"{name}: {what}")

    def manifest(self, name: str) -> Manifest:
        try:
            m = Manifest.from_json(json.loads(self._read_metadata(name, MANIFEST, "manifest")))
        except CorruptCheckpoint as e:
            raise CorruptCheckpoint(str(e) if str(e).startswith(f"{name}: ") else f"{name}: {e}") from None
        except (ValueError, RecursionError):
            raise CorruptCheckpoint(f"{name}: manifest is not valid JSON") from None
        if m.name != name:
            raise CorruptCheckpoint(f"{name}: manifest names another record ({m.name})")
        if m.layout == "region":
            raise CorruptCheckpoint(f"{name}: a record directory's manifest claims layout {m.layout}")
        return m

    def _records(self) -> list[tuple[str, bool]]:
        """(name, is a real directory) of every entry named like a record, from the listing only."""
        if not self.root.is_dir():
            return []
        with os.scandir(self.root) as it:
            return sorted((e.name, e.is_dir(follow_symlinks=False)) for e in it
                          if is_record_name(e.name) and (e.is_symlink() or e.is_dir(follow_symlinks=False)))

    def _scan(self) -> tuple[list[Manifest], dict[str, str]]:
        """(readable manifests oldest first, {record: problem} of records that fail their checks).
        A step held both by a record directory and by region slots is listed once (the directory)."""
        good, bad, parsed = [], {}, {}
        for name, real in self._records():
            if not real:
                bad[name] = f"{name}: record directory is a symbolic link (not followed)"
                continue
            try:
                st = os.stat(self.root / name / MANIFEST, follow_symlinks=False)
            except OSError:
                continue  # no manifest: not committed (`incomplete`)
            try:
                good.append(self._manifest_unless_parsed(name, st, parsed))
            except CorruptCheckpoint as e:
                bad[name] = str(e)
        self._parsed = parsed
        in_region, region_bad = self.regions.scan()
        names = {m.name for m in good}  # (a damaged directory does not hide a good region copy)
        good += [m for m in in_region if m.name not in names]
        bad.update(region_bad)
        return sorted(good, key=lambda m: (m.step, m.kind != "full")), bad

    def _manifest_unless_parsed(self, name: str, st: os.stat_result,
                                parsed: dict[str, tuple[tuple[int, ...], Manifest]]) -> Manifest:
        """`manifest(name)`, not parsed again if its file (`st`, its lstat) is the one parsed at
        the last scan, unchanged (device, inode, size, modified and changed times) and not racy
        (`RACY_S`); kept in `parsed` for the next scan. A manifest is never changed once read."""
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        known = self._parsed.get(name)
        m = known[1] if known is not None and known[0] == key else self.manifest(name)
        if time.time_ns() - st.st_ctime_ns > RACY_S * 1e9:
            parsed[name] = (key, m)
        return m

    def manifests(self, *, warn: bool = True) -> list[Manifest]:
        """Every committed record, oldest first; unreadable manifests are skipped loudly."""
        good, bad = self._scan()
        for problem_ in bad.values() if warn else []:
            log.warning(f"skipping {problem_}")
        return good

    def unreadable(self) -> dict[str, str]:
        """{record: problem} of records whose manifest exists but fails its checks (never loaded)."""
        return self._scan()[1]

    def index_bytes(self, m: Manifest, rank: int) -> tuple[bytes, Any]:
        """(rank `rank`'s index of committed record `m` as stored, its JSON body where its layout
        parsed it already, else None), the bytes checked against the manifest's checksum."""
        body = None
        if m.layout == "region":
            raw = self.regions.copy(m, rank).index_raw
        elif m.layout == "file":
            fd = self._open(m.name, rankfile.file_name(rank), f"rank {rank} file")
            try:
                raw, body = rankfile.read_index(fd, f"{m.name}: rank {rank} file")
            finally:
                os.close(fd)
        else:
            raw = self._read_metadata(m.name, rank_files(rank)[1], f"rank {rank} index")
        if m.index_checksums.get(str(rank)) != checksum(raw):
            raise CorruptCheckpoint(f"{m.name}: rank {rank} index checksum mismatch")
        return raw, body

    def read_index(self, name: str, rank: int, manifest: Manifest | None = None) -> dict:
        """Rank `rank`'s index of committed record `name`, every field checked against the manifest."""
        m = manifest or self.manifest(name)
        if not 0 <= rank < m.world_size:
            raise CorruptCheckpoint(f"{name}: has no rank {rank} (world_size {m.world_size})")
        raw, body = self.index_bytes(m, rank)
        try:
            body = json.loads(raw) if body is None else body
            index = RankIndex.model_validate(body)
        except ValidationError as e:
            raise CorruptCheckpoint(f"{name}: rank {rank} index: {problem(e)}") from None
        except (ValueError, RecursionError):
            raise CorruptCheckpoint(f"{name}: rank {rank} index is not valid JSON") from None
        if (index.record, index.rank) != (name, rank):
            raise CorruptCheckpoint(f"{name}: rank {rank} index belongs to {index.record} rank {index.rank}")
        try:
            check_skeleton(index.skeleton, {k: {"dtype": t.dtype, "shape": t.shape} for k, t in index.tensors.items()})
            if m.kind == "diff":
                _check_diff_steps(m, index.skeleton)
        except ValueError as e:
            raise CorruptCheckpoint(f"{name}: rank {rank} skeleton: {e}") from None
        return body

    def ranks_held(self, m: Manifest) -> list[int]:
        """The ranks whose part of committed record `m` this directory holds: all of them, except
        where --dir is node-local (each node's holds its own ranks' parts) or a part was lost.
        CorruptCheckpoint if it holds a rank the manifest does not have (never read)."""
        if m.layout == "region" or (m.name, m.world_size) in self._ranks_ok:
            return list(range(m.world_size))
        present = self.ranks_present(m.name, m.layout)
        if present and not 0 <= present[-1] < m.world_size:
            raise CorruptCheckpoint(f"{m.name}: world_size {m.world_size}, but it holds a part of rank {present[-1]}")
        if present == list(range(m.world_size)):
            self._ranks_ok.add((m.name, m.world_size))
        return present

    def partial(self, m: Manifest, held: list[int]) -> str:
        """One line: record `m` holds only the ranks `held` here, and where the others would be."""
        hint = "" if self.copy_of else (" (node-local --dir: see the other nodes' --dir, --durable or partners' "
                                        "memory)")
        return (f"{m.name}: holds the part(s) of rank(s) {_ranks_text(held)} of {m.world_size}; the others' "
                f"are not in {self.where}{hint}")

    def open_rank(self, m: Manifest, rank: int) -> tuple[dict, int, int]:
        """(index, open data file, offset of the data in it) of one rank of committed record `m`
        after every check that does not read tensor bytes: restore and verify both start here, so
        they cannot disagree. Tensor offsets in the index are relative to that offset. The other
        ranks' parts may be elsewhere (a node-local --dir): `ranks_held` says which are here."""
        held = self.ranks_held(m)
        if rank not in held and 0 <= rank < m.world_size:
            raise CorruptCheckpoint(self.partial(m, held))
        index = self.read_index(m.name, rank, m)
        if m.layout == "region":
            fd, base = self.regions.open_data(m, rank, index["data_nbytes"])
            return index, fd, base
        if m.layout == "file":  # (its header was read and checked past the data just now)
            return index, self._open(m.name, rankfile.file_name(rank), f"rank {rank} file"), 0
        fd = self._open(m.name, index["data"], f"rank {rank} data file")
        size = os.fstat(fd).st_size
        if size != index["data_nbytes"]:
            os.close(fd)
            raise CorruptCheckpoint(f"{m.name}: rank {rank} data file is {size} bytes, its index says "
                                    f"{index['data_nbytes']} (truncated or replaced)")
        return index, fd, 0

    def read_rank(self, m: Manifest, rank: int, *, verify: bool = True, into: ReadBuffer | None = None,
                  private: bool = False) -> tuple[dict, dict]:
        """(index, tensors) of one rank of a committed record; raises CorruptCheckpoint. The
        tensors are views of one buffer: `into`'s (reused, see ReadBuffer), or a new one; with
        `private`, each tensor has storage of its own, read into directly (state that is kept
        needs that, and a copy after the read would cost as much as the read)."""
        import torch

        from .layout import TensorSpec, view

        index, fd, base = self.open_rank(m, rank)
        specs = [TensorSpec.from_json(key, spec) for key, spec in index["tensors"].items()]
        what = f"{m.name}: rank {rank} data file"
        try:
            if private:
                placed = []
                for spec in specs:
                    own = torch.empty(spec.nbytes, dtype=torch.uint8)
                    placed.append((dataclasses.replace(spec, offset=0), own,
                                   _read_fully(fd, own, base + spec.offset, what)))
            else:
                nbytes = index["data_nbytes"]
                buf = into.take(nbytes) if into is not None else torch.empty(nbytes, dtype=torch.uint8)
                raw = _read_fully(fd, buf, base, what)
                placed = [(spec, buf, raw) for spec in specs]
        finally:
            os.close(fd)
        tensors = {}
        for spec, buf, raw in placed:
            if verify and checksum(raw[spec.offset : spec.offset + spec.nbytes]) != index["tensors"][spec.key]["xxh3"]:
                raise CorruptCheckpoint(f"{m.name}: rank {rank} tensor {spec.key!r} checksum mismatch")
            tensors[spec.key] = view(buf, spec)
        return index, tensors

    def verify_record(self, m: Manifest, committed: set[str] | None = None, *, checksums: bool = True,
                      ranks: list[int] | None = None) -> list[str]:
        """Problems found re-checking everything a restore of `m` relies on: its dependencies, every
        field (`open_rank`) and, with `checksums`, every tensor checksum, streaming the data with
        bounded memory (`committed`: the names of the committed records, when the caller has them
        already). Without `checksums` the caller checks them as it reads the data (`read_rank`).
        `ranks`: only those ranks' parts are needed (a node-local --dir's); None: every rank's,
        and a record holding only some is a problem, said after every part it holds is checked."""
        names = committed if committed is not None else {x.name for x in self.manifests(warn=False)}
        problems = [f"{m.name}: depends on {d}, which is not committed" for d in m.depends_on if d not in names]
        sizes: list[int] = []
        chunk = memoryview(bytearray(CHUNK)) if checksums else None
        checked = ranks
        if ranks is None:
            try:
                checked = self.ranks_held(m)
            except CorruptCheckpoint as e:
                return [*problems, str(e)]
        for r in checked:
            try:
                index, fd, base = self.open_rank(m, r)
                sizes.append(index["data_nbytes"])
                with os.fdopen(fd, "rb", buffering=0):
                    problems += [f"{m.name}: rank {r} tensor {k!r} checksum mismatch"
                                 for k, s in index["tensors"].items()
                                 if chunk is not None
                                 and _hash_range(fd, base + s["offset"], s["nbytes"], chunk) != s["xxh3"]]
            except CorruptCheckpoint as e:
                return [*problems, str(e)]
            except OSError as e:
                return [*problems, f"{m.name}: rank {r}: {e.strerror}"]
        if checked != list(range(m.world_size)):  # the parts checked, against what the manifest says of them
            if m.rank_bytes and sizes != [m.rank_bytes[r] for r in checked]:
                problems.append(f"{m.name}: manifest says {m.rank_bytes} bytes per rank, rank(s) {checked} hold "
                                f"{sizes}")
            return problems if ranks is not None else [*problems, self.partial(m, checked)]
        total = sum(sizes)
        if total != m.bytes or m.rank_bytes and m.rank_bytes != sizes:
            problems.append(f"{m.name}: manifest says {m.bytes} bytes ({m.rank_bytes or 'per rank: not recorded'}), "
                            f"its ranks hold {total} ({sizes})")
        return problems

    def incomplete(self) -> list[str]:
        """Record directories without a manifest (torn or still being written)."""
        return [name for name, real in self._records() if real and not os.path.lexists(self.root / name / MANIFEST)]

    def sweep_incomplete(self) -> list[str]:
        """Remove every record directory without a manifest. Only when no writer is left (the
        run is over), since a record being written has no manifest yet either."""
        if not self.owned():
            return []
        names = self.incomplete()
        for name in names:
            self.abandon(name)
        for left in self.root.glob(f"{ABANDONED}*"):  # an abandon cut short by a kill
            if left.is_dir() and not left.is_symlink():
                shutil.rmtree(left, ignore_errors=True)
        return names

    # ---- retention ---------------------------------------------------------------------
    def remove(self, name: str) -> None:
        """Unpublish (manifest first, so a crash never leaves a half-deleted committed record)."""
        rdir = self.root / name
        if not is_record_name(name) or rdir.is_symlink():
            raise CkptrunError(f"refusing to remove {rdir}: not a record directory")
        (rdir / MANIFEST).unlink(missing_ok=True)
        fsync_dir(rdir)
        shutil.rmtree(rdir, ignore_errors=True)

    def prune(self, keep: int, *, incomplete_grace_s: float = 60.0, protect: frozenset[str] = frozenset(),
              upto: int | None = None) -> list[str]:
        """Drop full checkpoints beyond the newest `keep` (0 keeps all) and what only they need.

        Runs after a commit: the newest committed record is never a candidate, and a record a
        kept one depends on is kept, as is one in `protect` (being copied to --durable). With
        `upto`, only records of steps up to it count (a node-local --dir: the newest step every
        node has committed), and every newer one is kept. Torn directories older than the newest
        commit go too.
        """
        self.check_owned()
        ms = self.manifests(warn=False)
        removed: list[str] = []
        if not ms:
            return removed
        counted = ms if upto is None else [m for m in ms if m.step <= upto]
        if keep > 0 and counted:
            kept = retained(counted, keep) | protect | {m.name for m in ms[len(counted):]}
            for m in ms:  # region slots are reused by their writer, never removed from here
                if m.name not in kept and m.layout != "region":
                    self.remove(m.name)
                    removed.append(m.name)
        newest = ms[-1].step
        for name in self.incomplete():
            rdir = self.root / name
            last = int(name.split("-")[-1])
            if last < newest and time.time() - rdir.stat().st_mtime > incomplete_grace_s:
                shutil.rmtree(rdir, ignore_errors=True)
                removed.append(name)
        return removed


def retained(ms: list[Manifest], keep: int) -> set[str]:
    """The records retention keeps of `ms` (oldest first): the newest `keep` full checkpoints,
    what depends on them, the newest record, and the whole ancestry of each kept one."""
    fulls = [m for m in ms if m.kind == "full"]
    kept = {m.name for m in fulls[-keep:]}
    kept |= {m.name for m in ms if m.kind != "full" and set(m.depends_on) & kept}
    kept.add(ms[-1].name)
    for m in reversed(ms):  # newest first, so chains pull in their whole ancestry
        if m.name in kept:
            kept |= set(m.depends_on)
    return kept


def rank_index(name: str, rank: int, data: memoryview, tensors: dict[str, dict], skeleton: Any,
               meta: dict[str, Any]) -> dict:
    """One rank's index of record `name` (rank-NNNNN.json, or a region slot's): each tensor's
    place with the xxh3 of its bytes in `data`, the skeleton and the metadata."""
    sums = {k: {**spec, "xxh3": checksum(data[spec["offset"] : spec["offset"] + spec["nbytes"]])}
            for k, spec in tensors.items()}
    return {"format": FORMAT, "record": name, "rank": rank, "data": rank_files(rank)[0],
            "data_nbytes": len(data), "tensors": sums, "skeleton": skeleton, "meta": meta}


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if ranks else "none"


def _hash_range(fd: int, offset: int, nbytes: int, chunk: memoryview) -> str:
    """xxh3 of `nbytes` bytes at `offset` of `fd`, read into `chunk` (reused: no allocation per read)."""
    h = xxhash.xxh3_64()
    while nbytes > 0:
        n = os.preadv(fd, [chunk[: min(len(chunk), nbytes)]], offset)
        if not n:
            break
        h.update(chunk[:n])
        offset, nbytes = offset + n, nbytes - n
    return h.hexdigest()


def _check_diff_steps(m: Manifest, skeleton: Any) -> None:
    """A differential record holds exactly the steps its name says, each once."""
    steps = skeleton.get("steps") if isinstance(skeleton, dict) else None
    if not isinstance(steps, dict) or set(skeleton) != {"steps"}:
        raise ValueError("a diff record's skeleton must be {\"steps\": {...}}")
    if len(steps) != m.step - m.first_step + 1 or set(steps) != {str(s) for s in range(m.first_step, m.step + 1)}:
        raise ValueError(f"holds steps other than {m.first_step}..{m.step}")


def _read_fully(fd: int, buf: Any, at: int, what: str) -> memoryview:
    """Fill the flat uint8 tensor `buf` from `fd` at offset `at`; returns its bytes."""
    raw = memoryview(buf.numpy()) if len(buf) else memoryview(b"")
    done = 0
    while done < len(raw):
        n = os.preadv(fd, [raw[done:]], at + done)
        if not n:
            raise CorruptCheckpoint(f"{what} shrank while being read")
        done += n
    return raw
