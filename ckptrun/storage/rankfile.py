"""The self-describing rank file (layout "file", datastates): one file per rank per checkpoint.

    [0, fixed)              tensors at precomputed 4 KiB-aligned offsets (the staging slot's own)
    [fixed, header_at)      a log: chunks appended as they arrive (serialized objects, tensors
                            that settled after the snapshot began), each at a 64-byte boundary
    [header_at, +len)       the header: JSON, the rank index (each tensor's place and xxh3) with
                            the objects' places and xxh3 instead of the skeleton
    footer (FOOTER bytes)   magic, header_at, len, xxh3 of the header

The header is written last, so the file describes itself only once everything before it is in
place; a file without a matching footer and header is torn (DESIGN invariant 2). The skeleton is
rebuilt from the objects: each names the path in the skeleton its JSON value goes to, so state
providers compose hierarchically. A reader checks every field before it reads on its say-so
(invariant 7); nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from ..errors import CorruptCheckpoint
from .fsutil import FaultHook, _no_fault, fsync_dir
from .iowriter import open_out
from .schema import (
    _STRICT,
    FORMAT,
    MAX_METADATA_BYTES,
    MAX_SKELETON_DEPTH,
    Checksum,
    IndexMeta,
    Nbytes,
    RecordName,
    TensorEntry,
    checksum,
    problem,
    rank_files,
    short,
)

MAGIC = b"CKPTRNF1"
_FOOTER = struct.Struct("<8sQQ16s")
FOOTER = _FOOTER.size
LOG_ALIGN = 64  # what the log's chunks are aligned to (any dtype's itemsize divides it)


def file_name(rank: int) -> str:
    return f"rank-{rank:05d}.ckpt"


def _log_align(n: int) -> int:
    return -(-n // LOG_ALIGN) * LOG_ALIGN


class ObjectEntry(BaseModel):
    """One serialized object: its JSON bytes at `offset`, set at `path` of the skeleton."""

    model_config = _STRICT
    path: Annotated[list[Annotated[str, Field(min_length=1, max_length=1000)]],
                    Field(min_length=1, max_length=MAX_SKELETON_DEPTH)]
    offset: Nbytes
    nbytes: Annotated[int, Field(ge=0, le=MAX_METADATA_BYTES)]
    xxh3: Checksum


class Header(BaseModel):
    model_config = _STRICT
    format: Literal[1]
    record: RecordName
    rank: Annotated[int, Field(ge=0)]
    data: str
    data_nbytes: Nbytes
    tensors: dict[str, TensorEntry]
    objects: Annotated[list[ObjectEntry], Field(max_length=1024)]
    meta: IndexMeta

    @model_validator(mode="after")
    def _bounded(self) -> Header:
        if sum(o.nbytes for o in self.objects) > MAX_METADATA_BYTES:
            raise ValueError(f"objects take more than {MAX_METADATA_BYTES} bytes")
        paths = [tuple(o.path) for o in self.objects]
        for i, p in enumerate(paths):
            if any(q[: len(p)] == p or p[: len(q)] == q for q in paths[:i]):
                raise ValueError(f"object path {short('/'.join(p))} overlaps another")
        return self


class RankFileWriter:
    """Writes one rank's file under a temporary name; `publish` makes it the rank's file.

    Call order: `put` (fixed part, any thread, any order) and `append` (the log, any thread)
    while chunks arrive, then `publish(header)` once, or `discard`. The fault points are those of
    `fsutil.publish_bytes` for a file called "data" (open, written, synced, renamed, dir-synced)."""

    def __init__(self, path: Path, fixed: int, fault: FaultHook = _no_fault) -> None:
        self.path, self.fault = Path(path), fault
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.cursor = _log_align(fixed)
        self._lock = threading.Lock()
        self.out = open_out(self.tmp)
        try:
            fault("data:open")
        except BaseException:
            self.discard()
            raise

    def put(self, data: memoryview | bytes, offset: int) -> None:
        self.out.write_at(data, offset)

    def append(self, data: memoryview | bytes) -> int:
        """Write `data` at the log's end; returns where it went."""
        with self._lock:
            at = self.cursor
            self.cursor = _log_align(at + len(data))
        self.out.write_at(data, at)
        return at

    def publish(self, header: dict) -> tuple[bytes, int]:
        """Write the header and footer after the log, make the file durable and give it its
        name; returns (the header's bytes, the file's size)."""
        raw = json.dumps(header).encode()
        with self._lock:
            at = self.cursor
        try:
            self.out.write_at(raw + _FOOTER.pack(MAGIC, at, len(raw), checksum(raw).encode()), at)
            self.fault("data:written")
            self.out.sync()
            self.out.close()
            self.fault("data:synced")
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        self.fault("data:renamed")
        fsync_dir(self.path.parent)
        self.fault("data:dir-synced")
        return raw, at + len(raw) + FOOTER

    def discard(self) -> None:
        self.out.close()
        self.tmp.unlink(missing_ok=True)


def header(record: str, rank: int, tensors: dict[str, dict], objects: list[dict], meta: dict) -> dict:
    """The header of a rank file: `tensors` key -> {dtype, shape, offset, nbytes, xxh3} (file
    offsets), `objects` [{path, offset, nbytes, xxh3}]."""
    end = max((t["offset"] + t["nbytes"] for t in tensors.values()), default=0)
    return {"format": FORMAT, "record": record, "rank": rank, "data": rank_files(rank)[0], "data_nbytes": end,
            "tensors": tensors, "objects": objects, "meta": meta}


def _pread(fd: int, n: int, offset: int, what: str) -> bytes:
    raw = os.pread(fd, n, offset)
    while len(raw) < n:
        more = os.pread(fd, n - len(raw), offset + len(raw))
        if not more:
            raise CorruptCheckpoint(f"{what} ends early (file changed while being read)")
        raw += more
    return raw


def read_header(fd: int, what: str) -> tuple[bytes, Header]:
    """(raw header, checked header) of an open rank file; CorruptCheckpoint when torn or crafted."""
    size = os.fstat(fd).st_size
    if size < FOOTER:
        raise CorruptCheckpoint(f"{what} is {size} bytes: no header (torn)")
    magic, at, n, sum_ = _FOOTER.unpack(_pread(fd, FOOTER, size - FOOTER, what))
    if magic != MAGIC or at + n + FOOTER != size:
        raise CorruptCheckpoint(f"{what}: no header at its end (torn or not a ckptrun rank file)")
    if n > MAX_METADATA_BYTES:
        raise CorruptCheckpoint(f"{what}: header of {n} bytes (more than {MAX_METADATA_BYTES})")
    raw = _pread(fd, n, at, what)
    if checksum(raw).encode() != sum_:
        raise CorruptCheckpoint(f"{what}: header checksum mismatch")
    try:
        head = Header.model_validate(json.loads(raw))
    except ValidationError as e:
        raise CorruptCheckpoint(f"{what}: header: {problem(e)}") from None
    except (ValueError, RecursionError):
        raise CorruptCheckpoint(f"{what}: header is not valid JSON") from None
    for key, t in head.tensors.items():
        if t.offset + t.nbytes > at:
            raise CorruptCheckpoint(f"{what}: tensor {short(key)} lies beyond the data (offset {t.offset})")
    for o in head.objects:
        if o.offset + o.nbytes > at:
            raise CorruptCheckpoint(f"{what}: object {short('/'.join(o.path))} lies beyond the data")
    return raw, head


def read_index(fd: int, what: str) -> tuple[bytes, dict]:
    """(raw header, the rank index it describes): the header's fields with the skeleton rebuilt
    from the objects (each read, checked against its xxh3 and parsed as JSON)."""
    raw, head = read_header(fd, what)
    skeleton: dict[str, Any] = {}
    for o in head.objects:
        body = _pread(fd, o.nbytes, o.offset, what)
        name = "/".join(o.path)
        if checksum(body) != o.xxh3:
            raise CorruptCheckpoint(f"{what}: object {short(name)} checksum mismatch")
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):
            raise CorruptCheckpoint(f"{what}: object {short(name)} is not valid JSON") from None
        place = skeleton
        for part in o.path[:-1]:
            place = place.setdefault(part, {})
            if not isinstance(place, dict):
                raise CorruptCheckpoint(f"{what}: object {short(name)} lies inside a value")
        place[o.path[-1]] = value
    index = head.model_dump(exclude={"objects"})
    index["tensors"] = {k: t.model_dump() for k, t in head.tensors.items()}
    index["meta"] = json.loads(raw)["meta"]
    index["skeleton"] = skeleton
    return raw, index
