"""A committed record's tensor bytes, read and checked against its index: restore's `read_rank`
and verify's `verify_record`.

Both start from the gate's `RecordReader.open_rank` (every check that reads no tensor byte),
so they cannot disagree, and read only through the descriptor it opened: nothing here opens
a file of the directory itself.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import xxhash

from ..errors import CorruptCheckpoint
from .schema import Manifest, checksum

if TYPE_CHECKING:
    from .layout import ReadBuffer
    from .store_read import RecordReader

CHUNK = 1 << 20  # verify hashes data files in pieces of this size (bounded memory)


def read_rank(reader: RecordReader, m: Manifest, rank: int, *, verify: bool = True, into: ReadBuffer | None = None,
              private: bool = False) -> tuple[dict, dict]:
    """(index, tensors) of one rank of a committed record; raises CorruptCheckpoint. The
    tensors are views of one buffer: `into`'s (reused, see ReadBuffer), or a new one; with
    `private`, each tensor has storage of its own, read into directly (state that is kept
    needs that, and a copy after the read would cost as much as the read)."""
    import torch

    from .layout import TensorSpec, view

    index, fd, base = reader.open_rank(m, rank)
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


def verify_record(reader: RecordReader, m: Manifest, committed: set[str] | None = None, *, checksums: bool = True,
                  ranks: list[int] | None = None) -> list[str]:
    """Problems found re-checking everything a restore of `m` relies on: its dependencies, every
    field (`open_rank`) and, with `checksums`, every tensor checksum, streaming the data with
    bounded memory (`committed`: the names of the committed records, when the caller has them
    already). Without `checksums` the caller checks them as it reads the data (`read_rank`).
    `ranks`: only those ranks' parts are needed (a node-local --dir's); None: every rank's,
    and a record holding only some is a problem, said after every part it holds is checked."""
    names = committed if committed is not None else {x.name for x in reader.manifests(warn=False)}
    problems = [f"{m.name}: depends on {d}, which is not committed" for d in m.depends_on if d not in names]
    sizes: list[int] = []
    chunk = memoryview(bytearray(CHUNK)) if checksums else None
    checked = ranks
    if ranks is None:
        try:
            checked = reader.ranks_held(m)
        except CorruptCheckpoint as e:
            return [*problems, str(e)]
    for r in checked:
        try:
            index, fd, base = reader.open_rank(m, r)
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
        return problems if ranks is not None else [*problems, reader.partial(m, checked)]
    total = sum(sizes)
    if total != m.bytes or m.rank_bytes and m.rank_bytes != sizes:
        problems.append(f"{m.name}: manifest says {m.bytes} bytes ({m.rank_bytes or 'per rank: not recorded'}), "
                        f"its ranks hold {total} ({sizes})")
    return problems


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
