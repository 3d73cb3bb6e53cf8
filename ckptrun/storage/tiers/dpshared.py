"""The data-parallel short-cut of the replicated memory tier: a partner's copy of a rank's part
leaves out the tensors every data-parallel rank holds alike, and gets them back from a peer.

Under DDP with --node-local-dir, every rank writes its whole state, and its index names the
replicated tensors (parameters, their gradients, the optimizer state over them: meta "shared",
worker/state.py). A copy shipped to a partner is `thin`: the bytes of the other tensors only,
packed (RNG, buffers, unreplicated parameters; no alignment padding). The partner checks what
it got (the index against the manifest, every tensor kept against the index) and, to give the
copy back, `rebuild`s the data file with the shared tensors read from its own part of the same
record, each checked against the owner's index before it is used. Every tensor of the rebuilt
file is the owner's byte for byte (the alignment padding, which no reader looks at, is zeros),
and the owner checks it again as it lands (`mirror.fill`). So each step only per-rank state
crosses the network, and a partner's memory holds only that.
"""

from __future__ import annotations

from collections.abc import Callable

import xxhash
from pydantic import ValidationError

from ...errors import CorruptCheckpoint
from ..schema import RankIndex, TensorEntry
from .source import Span


def parse(raw: bytes, what: str) -> RankIndex:
    """The rank index `raw`, checked (offsets inside its data, no overlaps) before any use
    (validated from the JSON in one pass: a third less CPU than loading it first, per copy)."""
    try:
        return RankIndex.model_validate_json(raw)
    except (ValidationError, ValueError, RecursionError):
        raise CorruptCheckpoint(f"{what}: its index is not a rank index") from None


def shared_keys(index: RankIndex) -> set[str]:
    """The tensors the index names as every data-parallel rank's alike (none if it names none)."""
    shared = getattr(index.meta, "shared", None) or []
    if not isinstance(shared, list) or not all(isinstance(k, str) and k in index.tensors for k in shared):
        raise CorruptCheckpoint(f"{index.record}: rank {index.rank}'s index names shared tensors it does not hold")
    return set(shared)


def _kept(index: RankIndex, shared: set[str]) -> list[TensorEntry]:
    return [t for _, t in kept_tensors(index, shared)]


def kept_tensors(index: RankIndex, shared: set[str]) -> list[tuple[str, TensorEntry]]:
    """(key, entry) of each tensor that is not `shared`, in the order a thin copy packs them."""
    return sorted(((k, t) for k, t in index.tensors.items() if k not in shared), key=lambda kt: kt[1].offset)


def thin(read: Callable[[int, int], bytes], index: RankIndex, shared: set[str]) -> bytes:
    """The bytes of the tensors that are not `shared`, packed in offset order; `read(offset,
    n)` reads the part's data file."""
    return b"".join(read(t.offset, t.nbytes) for t in _kept(index, shared))


def thin_spans(index: RankIndex, shared: set[str]) -> tuple[list[Span], int]:
    """(the checksummed spans of a thin copy's tensors, at their places in it; its size)."""
    spans, pos = [], 0
    for t in _kept(index, shared):
        spans.append(Span(pos, t.nbytes, t.xxh3))
        pos += t.nbytes
    return spans, pos


def copy_spans(index: RankIndex, is_thin: bool) -> tuple[list[Span], int]:
    """(the checksummed spans of a copy's data, its size): a thin copy's packed (`thin_spans`),
    a whole one's where its index puts them."""
    if is_thin:
        return thin_spans(index, shared_keys(index))
    return [Span(t.offset, t.nbytes, t.xxh3) for t in index.tensors.values()], index.data_nbytes


def rebuild(data: bytes, index: RankIndex, shared: set[str], peer: Callable[[str, memoryview], int]) -> bytearray:
    """The whole data file of thin copy `data`: each shared tensor read by `peer(key, into)`
    (returns the bytes it read into `into`) from a data-parallel peer's own part, where it must
    hash as the owner's index says."""
    whole, pos = bytearray(index.data_nbytes), 0
    view = memoryview(whole)
    for t in _kept(index, shared):
        view[t.offset : t.offset + t.nbytes] = data[pos : pos + t.nbytes]
        pos += t.nbytes
    for key in sorted(shared):
        t = index.tensors[key]
        into = view[t.offset : t.offset + t.nbytes]
        if peer(key, into) != t.nbytes or xxhash.xxh3_64_hexdigest(into) != t.xxh3:
            raise CorruptCheckpoint(f"{key}: the peer's own copy differs from the owner's (not replicated)")
    return whole
