"""The checkpoint directory: immutable records, per-rank raw data + JSON index, atomic commit.

A record is a directory (`step-00000010` for a full checkpoint, `diff-00000011-00000015` for a
differential batch). Each rank publishes `rank-NNNNN.data` (4 KiB-aligned raw tensor bytes) and
`rank-NNNNN.json` (dtype/shape/offset/xxh3 per tensor and the JSON skeleton of everything
else). A record exists for readers only once `MANIFEST.json` is published, after every rank's
files are durable (DESIGN invariant 2). Nothing here unpickles.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from .errors import AlreadyCommitted, CkptrunError, CorruptCheckpoint
from .fsutil import FaultHook, _no_fault, fsync_dir, publish_bytes, publish_json

FORMAT = 1
MANIFEST = "MANIFEST.json"
MARKER = "ckptrun.json"


def checksum(data: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def full_name(step: int) -> str:
    return f"step-{step:08d}"


def diff_name(first: int, last: int) -> str:
    return f"diff-{first:08d}-{last:08d}"


def rank_files(rank: int) -> tuple[str, str]:
    return f"rank-{rank:05d}.data", f"rank-{rank:05d}.json"


@dataclass
class Manifest:
    """The commit record of one record directory."""

    name: str
    kind: str
    step: int
    first_step: int
    world_size: int
    bytes: int
    depends_on: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    index_checksums: dict[str, str] = field(default_factory=dict)
    committed_at: float = 0.0

    def to_json(self) -> dict:
        body = asdict(self)
        body["format"] = FORMAT
        body["checksum"] = checksum(json.dumps(body, sort_keys=True).encode())
        return body

    @classmethod
    def from_json(cls, body: dict) -> Manifest:
        body = dict(body)
        stored = body.pop("checksum", None)
        if stored != checksum(json.dumps(body, sort_keys=True).encode()):
            raise CorruptCheckpoint("manifest checksum mismatch")
        body.pop("format", None)
        return cls(**body)


class Store:
    """One run's checkpoint directory."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    @classmethod
    def existing(cls, root: str | os.PathLike) -> Store:
        """The directory a reading command (ls, verify, restore) works on; an error if absent."""
        if not Path(root).is_dir():
            raise CkptrunError(f"no checkpoint directory at {root}; pass --dir", exit_code=2)
        return cls(root)

    # ---- writing -----------------------------------------------------------------------
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
        fmt = json.loads((self.root / MARKER).read_text()).get("format")
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
    ) -> int:
        """Durably publish one rank's part of record `name`; returns the bytes written.

        `tensors` maps key -> {dtype, shape, offset, nbytes}; `data` holds them at those offsets.
        Raises AlreadyCommitted (touching nothing) if `name` is committed, and OSError after
        removing whatever it wrote if a write fails. The run's directory is never re-created: a
        directory deleted under a running job is a save error, not a silent fresh start.
        """
        rdir = self.root / name
        if self.is_committed(name):
            raise AlreadyCommitted(f"{name} is committed; committed records are immutable")
        if not (self.root / MARKER).is_file():
            raise FileNotFoundError(errno.ENOENT, f"checkpoint directory {self.root} is gone (no {MARKER})")
        rdir.mkdir(exist_ok=True)
        self.discard_rank(name, rank, keep_dir=True)  # a stale part of an earlier attempt must not commit
        data_file, index_file = rank_files(rank)
        sums = {k: {**spec, "xxh3": checksum(data[spec["offset"] : spec["offset"] + spec["nbytes"]])}
                for k, spec in tensors.items()}
        index = {"format": FORMAT, "record": name, "rank": rank, "data": data_file,
                 "data_nbytes": len(data), "tensors": sums, "skeleton": skeleton, "meta": meta}
        try:
            publish_bytes(rdir / data_file, data, fault=fault, name="data", threads=threads)
            publish_json(rdir / index_file, index, fault=fault, name="index")
        except OSError:
            self.discard_rank(name, rank)
            raise
        return len(data)

    def is_committed(self, name: str) -> bool:
        return (self.root / name / MANIFEST).exists()

    def discard_rank(self, name: str, rank: int, *, keep_dir: bool = False) -> None:
        """Remove one rank's files of an uncommitted record (and the record's directory once it
        is empty). A committed record is never touched: that is retention's job alone."""
        rdir = self.root / name
        if self.is_committed(name):
            return
        for f in (rank_files(rank)[1], rank_files(rank)[0]):  # index first: the part stops counting
            with contextlib.suppress(OSError):
                (rdir / f).unlink(missing_ok=True)
        if not keep_dir:
            with contextlib.suppress(OSError):
                rdir.rmdir()  # only if empty; other ranks' files keep it

    def mark_failed(self, name: str, rank: int) -> None:
        """Tell the committer (another process) that this rank's part of `name` will not come.
        Best effort: with the disk full even an empty file may fail; the record then waits."""
        rdir = self.root / name
        with contextlib.suppress(OSError):
            if self.root.is_dir() and not self.is_committed(name):
                rdir.mkdir(exist_ok=True)
                (rdir / f"rank-{rank:05d}.failed").touch()

    def failed_ranks(self, name: str) -> list[int]:
        rdir = self.root / name
        return sorted(int(p.name[5:10]) for p in rdir.glob("rank-*.failed")) if rdir.is_dir() else []

    def abandon(self, name: str) -> None:
        """Remove an uncommitted record whose commit will never happen (a rank failed to write
        it, or it depends on one that did). Never a committed one."""
        if not self.is_committed(name):
            shutil.rmtree(self.root / name, ignore_errors=True)

    def ranks_present(self, name: str) -> list[int]:
        rdir = self.root / name
        if not rdir.is_dir():
            return []
        return sorted(int(p.name[5:10]) for p in rdir.glob("rank-*.json"))

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
    ) -> Manifest | None:
        """Publish the manifest of `name` if every rank's files are there; else None."""
        rdir = self.root / name
        if (rdir / MANIFEST).exists():
            fsync_dir(rdir)  # a retry after a failed directory fsync makes the commit durable
            return self.manifest(name)
        if self.ranks_present(name) != list(range(world_size)):
            return None
        sums, total = {}, 0
        for r in range(world_size):
            raw = (rdir / rank_files(r)[1]).read_bytes()
            sums[str(r)] = checksum(raw)
            total += json.loads(raw)["data_nbytes"]
        m = Manifest(name, kind, step, first_step, world_size, total, list(depends_on or []),
                     dict(meta or {}), sums, time.time())
        publish_json(rdir / MANIFEST, m.to_json(), fault=fault, name="manifest")
        return m

    # ---- reading -----------------------------------------------------------------------
    def manifest(self, name: str) -> Manifest:
        try:
            return Manifest.from_json(json.loads((self.root / name / MANIFEST).read_text()))
        except (OSError, ValueError, TypeError, CorruptCheckpoint) as e:
            raise CorruptCheckpoint(f"{name}: unreadable manifest ({e})") from None

    def _scan(self) -> tuple[list[Manifest], dict[str, str]]:
        """(readable manifests oldest first, {record: problem} of manifests that fail their checks)."""
        good, bad = [], {}
        for p in sorted(self.root.glob("*/" + MANIFEST)) if self.root.is_dir() else []:
            try:
                good.append(self.manifest(p.parent.name))
            except CorruptCheckpoint as e:
                bad[p.parent.name] = str(e)
        return sorted(good, key=lambda m: (m.step, m.kind != "full")), bad

    def manifests(self, *, warn: bool = True) -> list[Manifest]:
        """Every committed record, oldest first; unreadable manifests are skipped loudly."""
        good, bad = self._scan()
        for problem in bad.values() if warn else []:
            warnings.warn(f"ckptrun: skipping {problem}", stacklevel=2)
        return good

    def unreadable(self) -> dict[str, str]:
        """{record: problem} of records whose manifest exists but fails its checks (never loaded)."""
        return self._scan()[1]

    def read_index(self, name: str, rank: int, manifest: Manifest | None = None) -> dict:
        m = manifest or self.manifest(name)
        path = self.root / name / rank_files(rank)[1]
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise CorruptCheckpoint(f"{name}: rank {rank} index missing ({e.strerror})") from None
        if m.index_checksums.get(str(rank)) != checksum(raw):
            raise CorruptCheckpoint(f"{name}: rank {rank} index checksum mismatch")
        return json.loads(raw)

    def read_rank(self, name: str, rank: int, *, verify: bool = True) -> tuple[dict, dict]:
        """(index, tensors) of one rank of a committed record; raises CorruptCheckpoint."""
        import torch

        from .layout import TensorSpec, view

        index = self.read_index(name, rank)
        path = self.root / name / index["data"]
        size = index["data_nbytes"]
        if not path.exists() or path.stat().st_size != size:
            raise CorruptCheckpoint(f"{name}: rank {rank} data file missing or truncated")
        buf = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8) if size else \
            torch.empty(0, dtype=torch.uint8)
        raw = memoryview(buf.numpy()) if size else memoryview(b"")
        tensors = {}
        for key, spec in index["tensors"].items():
            if verify and checksum(raw[spec["offset"] : spec["offset"] + spec["nbytes"]]) != spec["xxh3"]:
                raise CorruptCheckpoint(f"{name}: rank {rank} tensor {key!r} checksum mismatch")
            tensors[key] = view(buf, TensorSpec.from_json(key, spec))
        return index, tensors

    def verify_record(self, m: Manifest, committed: set[str] | None = None) -> list[str]:
        """Problems found re-checking every checksum of one record and its dependencies
        (`committed`: the names of the committed records, when the caller has them already)."""
        problems = []
        names = committed if committed is not None else {x.name for x in self.manifests(warn=False)}
        problems += [f"{m.name}: depends on {d}, which is not committed" for d in m.depends_on if d not in names]
        for r in range(m.world_size):
            try:
                index = self.read_index(m.name, r, m)
                path = self.root / m.name / index["data"]
                data = path.read_bytes()
                if len(data) != index["data_nbytes"]:
                    raise CorruptCheckpoint(f"{m.name}: rank {r} data file truncated")
                raw = memoryview(data)
                bad = [k for k, s in index["tensors"].items()
                       if checksum(raw[s["offset"] : s["offset"] + s["nbytes"]]) != s["xxh3"]]
                problems += [f"{m.name}: rank {r} tensor {k!r} checksum mismatch" for k in bad]
            except (CorruptCheckpoint, OSError) as e:
                problems.append(str(e) if isinstance(e, CorruptCheckpoint) else f"{m.name}: rank {r}: {e}")
        return problems

    def incomplete(self) -> list[str]:
        """Record directories without a manifest (torn or still being written)."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and p.name[:5] in ("step-", "diff-") and not (p / MANIFEST).exists())

    def sweep_incomplete(self) -> list[str]:
        """Remove every record directory without a manifest. Only when no writer is left (the
        run is over), since a record being written has no manifest yet either."""
        names = self.incomplete()
        for name in names:
            self.abandon(name)
        return names

    # ---- retention ---------------------------------------------------------------------
    def remove(self, name: str) -> None:
        """Unpublish (manifest first, so a crash never leaves a half-deleted committed record)."""
        rdir = self.root / name
        (rdir / MANIFEST).unlink(missing_ok=True)
        fsync_dir(rdir)
        shutil.rmtree(rdir, ignore_errors=True)

    def prune(self, keep: int, *, incomplete_grace_s: float = 60.0) -> list[str]:
        """Drop full checkpoints beyond the newest `keep` (0 keeps all) and what only they need.

        Runs after a commit: the newest committed record is never a candidate, and a record a
        kept one depends on is kept. Torn directories older than the newest commit go too.
        """
        ms = self.manifests(warn=False)
        removed: list[str] = []
        if not ms:
            return removed
        if keep > 0:
            fulls = [m for m in ms if m.kind == "full"]
            kept = {m.name for m in fulls[-keep:]}
            kept |= {m.name for m in ms if m.kind != "full" and set(m.depends_on) & kept}
            kept.add(ms[-1].name)
            for m in reversed(ms):  # newest first, so chains pull in their whole ancestry
                if m.name in kept:
                    kept |= set(m.depends_on)
            for m in ms:
                if m.name not in kept:
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
