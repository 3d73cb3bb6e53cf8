"""The read side of a checkpoint directory: the one gate every reader of it goes through.

A checkpoint directory is untrusted input (DESIGN invariant 7): it may be damaged, hand-edited,
copied from elsewhere or crafted. Every file of it that is read is opened here: names come from
the listing, a record must be a real directory (a symbolic link is not followed), each file a
regular one, metadata bounded in size, and every field checked (schema.py) before anything is
read on its say-so. `ls`, `verify`, `restore`, resume, the engine's scans, retention and the
tiers' copies (`tiers.mirror`) all read through this class (most by way of `Store`).

Readers see committed steps as `Manifest`s and never learn where the bytes lie: in a record
directory (`rank-NNNNN.data` + `rank-NNNNN.json`), in one self-describing file per rank inside
it (`storage/rankfile.py`, layout "file"), or in a slot of the per-rank region files
(`storage/region.py`, layout "region"). All give a rank's index (the same checked JSON) and a
descriptor plus offset of its data (`open_rank`). Nothing here unpickles.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import CorruptCheckpoint
from ..log import log
from . import rankfile
from .fsutil import open_regular, why_unopened
from .region import Regions
from .schema import (
    MANIFEST,
    MARKER,
    MAX_METADATA_BYTES,
    Manifest,
    RankIndex,
    checksum,
    is_record_name,
    problem,
    rank_files,
)
from .skeleton import check_skeleton

_RANK_PART = {"records": re.compile(r"rank-([0-9]{5})\.json"), "file": re.compile(r"rank-([0-9]{5})\.ckpt")}
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


class RecordReader:
    """What one checkpoint directory holds, every byte of it checked on the way in."""

    def __init__(self, root: str | os.PathLike, copy_of: str | None = None) -> None:
        self.root = Path(root)
        # The remote tier (its URL) that `root` is a private, read-only copy of (`tiers.mirror`):
        # messages name the URL the user gave, and nothing of a node-local disk applies.
        self.copy_of = copy_of
        self.regions = Regions(self.root)
        self._ranks_ok: set[tuple[str, int]] = set()  # committed records whose rank files match world_size
        # record -> (its manifest file's stat identity, the manifest parsed from it): the engine
        # lists --dir at every commit, a lowdiff chain holds hundreds of records (`_scan`).
        self._parsed: dict[str, tuple[tuple[int, ...], Manifest]] = {}

    @property
    def where(self) -> str:
        """What messages call this directory: the URL of the tier it copies, else its path."""
        return self.copy_of or str(self.root)

    # ---- the listing: names come from it, never from a file's say-so ----------------------
    def _records(self) -> list[tuple[str, bool]]:
        """(name, is a real directory) of every entry named like a record, from the listing only."""
        if not self.root.is_dir():
            return []
        with os.scandir(self.root) as it:
            return sorted((e.name, e.is_dir(follow_symlinks=False)) for e in it
                          if is_record_name(e.name) and (e.is_symlink() or e.is_dir(follow_symlinks=False)))

    def is_committed(self, name: str) -> bool:
        return is_record_name(name) and os.path.lexists(self.root / name / MANIFEST)

    def ranks_present(self, name: str, layout: str = "records") -> list[int]:
        """The ranks whose part of record `name` (in `layout`: records or file) is published."""
        rdir = self.root / name
        if not rdir.is_dir() or rdir.is_symlink():
            return []
        return sorted(int(m[1]) for p in rdir.iterdir() if (m := _RANK_PART[layout].fullmatch(p.name)))

    def incomplete(self) -> list[str]:
        """Record directories without a manifest (torn or still being written)."""
        return [name for name, real in self._records() if real and not os.path.lexists(self.root / name / MANIFEST)]

    # ---- metadata: the marker, manifests ------------------------------------------------
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

    def marker(self) -> Any:
        """The JSON body of the directory's marker (MARKER); CorruptCheckpoint if it is not a
        regular file of bounded size, ValueError or RecursionError if it is not JSON."""
        return json.loads(_read_small(open_regular(self.root / MARKER, MARKER), MARKER))

    def manifest(self, name: str) -> Manifest:
        try:
            m = parse_manifest(self._read_metadata(name, MANIFEST, "manifest"), name)
        except CorruptCheckpoint as e:
            raise CorruptCheckpoint(str(e) if str(e).startswith(f"{name}: ") else f"{name}: {e}") from None
        if m.name != name:
            raise CorruptCheckpoint(f"{name}: manifest names another record ({m.name})")
        if m.layout == "region":
            raise CorruptCheckpoint(f"{name}: a record directory's manifest claims layout {m.layout}")
        return m

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

    # ---- one rank's part ----------------------------------------------------------------
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


def parse_manifest(raw: bytes, what: str) -> Manifest:
    """The checked manifest in the bytes of a commit object (`what` names it in errors): the one
    parser of manifests read, here and from a tier."""
    try:
        return Manifest.from_json(json.loads(raw))
    except (ValueError, RecursionError):
        raise CorruptCheckpoint(f"{what}: manifest is not valid JSON") from None


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if ranks else "none"


def _check_diff_steps(m: Manifest, skeleton: Any) -> None:
    """A differential record holds exactly the steps its name says, each once."""
    steps = skeleton.get("steps") if isinstance(skeleton, dict) else None
    if not isinstance(steps, dict) or set(skeleton) != {"steps"}:
        raise ValueError("a diff record's skeleton must be {\"steps\": {...}}")
    if len(steps) != m.step - m.first_step + 1 or set(steps) != {str(s) for s in range(m.first_step, m.step + 1)}:
        raise ValueError(f"holds steps other than {m.first_step}..{m.step}")
