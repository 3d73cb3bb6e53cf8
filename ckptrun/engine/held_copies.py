"""Copies of the steps partners hold in memory only (--replicas with a snapshot strategy's
--persist-every): the memory tier itself is replicated, every step, not only the steps written.

A copy is cut from the staging slot the owner's engine holds the step in (`cut`): its rank index
(each tensor's place in the slot and its xxh3, as a written part's), and the bytes of the tensors
every data-parallel rank does not hold alike (thin, dpshared.py), or all of them. A partner
checks it as it arrives (`HeldCopies.hold`: the index, every tensor kept against it) and keeps
the two newest per owner. To give one back to a replaced node's engine it is made whole
(`HeldCopies.whole`): the shared tensors come from the partner's own slot of the same step, each
checked against the owner's index, and the owner's engine checks every tensor again before it
holds the state (`taken`). A step's copy is thus per-rank state only under DDP, and a lost
node resumes from the newest step every rank holds, with no disk read.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Annotated, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import CorruptCheckpoint
from ..ipc.messages import RecordSpec
from ..storage.fsutil import json_bytes
from ..storage.schema import RankIndex
from ..storage.store import rank_index
from ..storage.tiers.dpshared import copy_spans, parse, rebuild, shared_keys
from ..storage.tiers.dpshared import thin as thin_data
from ..storage.tiers.parts import thin_part
from ..storage.tiers.source import Source

KEEP = 2  # copies per owner: its newest step and the one before (engine/held.py)


class Header(BaseModel):
    """What a held copy says of itself beyond its index."""

    model_config = ConfigDict(strict=True, extra="forbid")
    step: Annotated[int, Field(ge=0)]
    kind: Annotated[str, Field(pattern=r"^[a-z]{1,16}$")]


@dataclass(frozen=True)
class HeldCopy:
    header: bytes
    data: bytes | bytearray
    raw_index: bytes
    thin: bool
    step: int
    index: RankIndex
    kind: str  # of its record: "full" (a snapshot's, a replica's) or "diff" (a step's gradients)

    def blobs(self) -> list[bytes | bytearray]:
        """[header, data, index], as `Round.send` ships a copy."""
        return [self.header, self.data, self.raw_index]


def cut(rank: int, spec: RecordSpec, view: memoryview, *, thin: bool = True, into: bytearray | None = None) -> HeldCopy:
    """Rank `rank`'s copy of the step `spec` describes, held in `view` (its staging slot, pinned):
    thin where its index names shared tensors, unless `thin` is False. A whole copy's bytes go
    `into` a buffer of its size, if given (one used before: a new one's pages fault in)."""
    raw = json_bytes(rank_index(spec.record, rank, view, spec.tensors, spec.skeleton, spec.meta))
    what = f"step {spec.step}: rank {rank}"
    part = thin_part(raw, lambda offset, n: bytes(view[offset : offset + n]), what) if thin else None
    header = Header(step=spec.step, kind=spec.kind).model_dump_json().encode()
    if part is not None:
        data = part[0]
    elif into is not None and len(into) == len(view):
        data = into
        memoryview(into)[:] = view
    else:
        data = bytearray(view)
    return HeldCopy(header, data, raw, part is not None, spec.step, parse(raw, what), spec.kind)


def thinned(copy: HeldCopy) -> HeldCopy:
    """`copy` without the bytes of the tensors its index names shared (itself if none): what a
    partner needs of a whole copy this engine keeps."""
    shared = shared_keys(copy.index)
    if copy.thin or not shared:
        return copy
    data = thin_data(lambda offset, n: copy.data[offset : offset + n], copy.index, shared)
    return replace(copy, data=data, thin=True)


def checked(owner: int, header: bytes, data: bytes | bytearray, raw_index: bytes, thin: bool) -> HeldCopy:
    """A copy of rank `owner`'s held step as it arrived, once every check passed (else
    CorruptCheckpoint): its header, its index, and each tensor it carries against the index."""
    try:
        head = Header.model_validate_json(header)
    except (ValidationError, ValueError):
        raise CorruptCheckpoint(f"rank {owner}'s copy of a held step has no valid header") from None
    what = f"rank {owner}'s copy of step {head.step}"
    index = parse(raw_index, what)
    if index.rank != owner:
        raise CorruptCheckpoint(f"{what}: its index is rank {index.rank}'s")
    spans, size = copy_spans(index, thin)
    if len(data) != size:
        raise CorruptCheckpoint(f"{what}: its data is {len(data):,} bytes, its index says {size:,}")
    for _ in Source.of_buffer(data, spans, what).chunks(max(size, 1)):
        pass
    return HeldCopy(header, data, raw_index, thin, head.step, index, head.kind)


def spec_of(copy: HeldCopy) -> RecordSpec:
    """The record spec of a whole copy's state, as the engine holds a snapshot's."""
    index = json.loads(copy.raw_index)
    tensors = {k: {f: t[f] for f in ("dtype", "shape", "offset", "nbytes")} for k, t in index["tensors"].items()}
    return RecordSpec(record=copy.index.record, kind=copy.kind, step=copy.step,
                      skeleton=index["skeleton"], tensors=tensors, meta=index["meta"])


class HeldMemory(Protocol):
    """The steps this engine holds in memory (a snapshot strategy's slots: `persist.HeldSlots`;
    lowdiff+'s replica: its handler)."""

    def held_steps(self) -> list[int]: ...

    def pinned(self, step: int) -> contextlib.AbstractContextManager[tuple[RecordSpec, memoryview] | None]: ...

    def install(self, spec: RecordSpec, data: bytes | bytearray) -> None: ...


class PartnerCopies(Protocol):
    """What an engine keeps of its partners' steps held in memory: the copies themselves
    (`HeldCopies`, a snapshot strategy's), or lowdiff+'s replicas stepped by the diffs their
    owners ship (strategies/lowdiff_plus/copies.py). Called by the replicator's threads under
    its lock; `whole` only while no copy arrives (a new round's exchange)."""

    owners: dict[int, Any]  # the owners it keeps copies of

    def hold(self, owner: int, copy: HeldCopy, damage: bool = False) -> bool:
        """Take `copy` (checked) in; False if it is not kept. `damage`: flip a bit in what is
        kept, after its checks (the `corrupt-replica` fault)."""

    def steps(self, owner: int) -> list[int]:
        """The steps of `owner` it can give back, newest first (some only with `own`'s help)."""

    def whole_steps(self, owner: int, own: Collection[int]) -> list[int]:
        """Of `steps`, those it can give back whole while this engine holds `own`."""

    def whole(self, owner: int, step: int, own: Callable[[str, memoryview], int] | None) -> HeldCopy:
        """`owner`'s state of `step`, whole and checked (else CorruptCheckpoint); `own(key, into)`
        reads a tensor of this engine's own state of that step (None: not held)."""

    def forget(self, owner: int) -> None:
        """Let `owner`'s copies go (it is no partner of this engine's rank any more)."""


class HeldCopies:
    """The copies this engine holds of its partners' held steps, the KEEP newest per owner
    (`PartnerCopies`)."""

    def __init__(self) -> None:
        self.owners: dict[int, list[HeldCopy]] = {}  # newest first

    def hold(self, owner: int, copy: HeldCopy, damage: bool = False) -> bool:
        """Keep `copy` (checked) unless one of its step or a newer one is held already."""
        held = self.owners.setdefault(owner, [])
        if held and held[0].step >= copy.step:
            return False
        held.insert(0, replace(copy, data=flipped(copy.data, copy.index, copy.thin)) if damage else copy)
        del held[KEEP:]
        return True

    def steps(self, owner: int) -> list[int]:
        return [c.step for c in self.owners.get(owner, [])]

    def whole_steps(self, owner: int, own: Collection[int]) -> list[int]:
        """A thin copy is made whole from this engine's own state of its step."""
        return [c.step for c in self.owners.get(owner, []) if c.step in own or not c.thin]

    def forget(self, owner: int) -> None:
        self.owners.pop(owner, None)

    def get(self, owner: int, step: int) -> HeldCopy | None:
        return next((c for c in self.owners.get(owner, []) if c.step == step), None)

    def whole(self, owner: int, step: int, own: Callable[[str, memoryview], int] | None) -> HeldCopy:
        """`owner`'s copy of `step`, whole: a thin one with its shared tensors read by `own(key,
        into)` from this engine's own held state of the same step (None: it holds none)."""
        copy = self.get(owner, step)
        if copy is None:
            raise CorruptCheckpoint(f"no copy of rank {owner}'s step {step} is held")
        if not copy.thin:
            return copy
        if own is None:
            raise CorruptCheckpoint(f"step {step} is no longer held here to complete rank {owner}'s copy")
        data = rebuild(copy.data, copy.index, shared_keys(copy.index), own)
        return replace(copy, data=data, thin=False)


def flipped(data: bytes | bytearray, index: RankIndex, thin: bool) -> bytes:
    """`data` (a copy's, laid out as `thin` says) with one bit flipped inside its largest tensor
    (not the alignment padding): memory going bad, as the `corrupt-replica` fault has it."""
    span = max(copy_spans(index, thin)[0], key=lambda s: s.nbytes)
    out = bytearray(data)
    out[span.offset + span.nbytes // 2] ^= 1
    return bytes(out)
