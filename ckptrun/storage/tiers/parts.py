"""A committed record of --dir as the objects a tier stores, in the checkpoint format unchanged.

Every rank's part is read from where --dir keeps it (record folder, rank file or region slot)
after the reader's own checks (`RecordReader.open_rank`), with the index's tensor checksums
carried along. A step held in region slots goes up as a record folder's files (its index is the same
bytes), its manifest saying layout "records".
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator

from ...errors import CorruptCheckpoint
from .. import rankfile
from ..fsutil import json_bytes
from ..schema import Manifest, rank_files
from ..store import Store
from .source import Source, Span

Part = list[tuple[str, Source]]


@contextlib.contextmanager
def record_parts(store: Store, m: Manifest, ranks: Iterable[int] | None = None
                 ) -> Iterator[tuple[list[Part], bytes]]:
    """(the objects of each of `ranks` (all when None), the commit object's bytes) of committed
    record `m` (with `ranks`, --dir may hold only theirs); every file it reads stays open until
    the block ends (retention may unlink it meanwhile)."""
    with contextlib.ExitStack() as stack:
        parts = [rank_part(store, m, r, stack)
                 for r in (range(m.world_size) if ranks is None else ranks)]
        remote = dataclasses.replace(m, layout="records") if m.layout == "region" else m
        yield parts, json_bytes(remote.to_json())


def rank_part(store: Store, m: Manifest, r: int, stack: contextlib.ExitStack) -> Part:
    """Rank `r`'s objects of committed record `m`, checked by `RecordReader.open_rank` (--dir may hold
    only some ranks' parts); the data file stays open until `stack` closes."""
    index, fd, base = store.open_rank(m, r)
    stack.callback(os.close, fd)
    spans = index_spans(index)
    what = f"{m.name}: rank {r}"
    if m.layout == "file":
        return [(rankfile.file_name(r), Source.of_fd(fd, 0, os.fstat(fd).st_size, spans, what))]
    raw, _ = store.index_bytes(m, r)
    return [(rank_files(r)[0], Source.of_fd(fd, base, index["data_nbytes"], spans, what)),
            (rank_files(r)[1], Source.of_bytes(raw, m.index_checksums[str(r)], f"{what} index"))]


def thin_rank_part(store: Store, m: Manifest, r: int) -> tuple[bytes, bytes] | None:
    """(thin data, index) of rank `r`'s part of committed record `m`, when its index names
    shared tensors (dpshared.py): only the other tensors' bytes are read, each checked against
    the index; None when it names none (the part goes whole)."""
    if m.layout != "records":
        return None
    checked, fd, base = store.open_rank(m, r)  # (the index checked against the manifest)
    try:
        if not checked["meta"].get("shared"):
            return None
        raw, _ = store.index_bytes(m, r)  # (read again, and checked again: it may be replaced since)
        return thin_part(raw, lambda offset, n: os.pread(fd, n, base + offset), f"{m.name}: rank {r}")
    finally:
        os.close(fd)


def thin_part(raw: bytes, read: Callable[[int, int], bytes], what: str) -> tuple[bytes, bytes] | None:
    """(thin data, index `raw`) of a part whose index names shared tensors, the others' bytes
    read by `read(offset, n)` from its data and each checked against the index; None when it
    names none (the part goes whole)."""
    from .dpshared import parse, shared_keys, thin, thin_spans

    index = parse(raw, what)
    shared = shared_keys(index)
    if not shared:
        return None
    data = thin(read, index, shared)
    spans, size = thin_spans(index, shared)
    src = Source.of_buffer(data, spans, what)
    if len(data) != size:
        raise CorruptCheckpoint(f"{what}: its data file is shorter than its index says")
    for _ in src.chunks(max(size, 1)):  # every tensor checked against the index
        pass
    return data, raw


def index_spans(index: dict) -> list[Span]:
    """The checksummed byte ranges of a rank's data that its index names, one per tensor."""
    return [Span(s["offset"], s["nbytes"], s["xxh3"]) for s in index["tensors"].values()]
