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

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import CorruptCheckpoint
from ..ipc.messages import RecordSpec
from ..storage.schema import RankIndex
from ..storage.store import rank_index
from ..storage.tiers.dpshared import copy_spans, parse, rebuild, shared_keys
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

    def blobs(self) -> list[bytes | bytearray]:
        """[header, data, index], as `Round.send` ships a copy."""
        return [self.header, self.data, self.raw_index]


def cut(rank: int, spec: RecordSpec, view: memoryview) -> HeldCopy:
    """Rank `rank`'s copy of the step `spec` describes, held in `view` (its staging slot, pinned)."""
    raw = json.dumps(rank_index(spec.record, rank, view, spec.tensors, spec.skeleton, spec.meta)).encode()
    what = f"step {spec.step}: rank {rank}"
    thin = thin_part(raw, lambda offset, n: bytes(view[offset : offset + n]), what)
    header = Header(step=spec.step, kind=spec.kind).model_dump_json().encode()
    data = thin[0] if thin is not None else bytes(view)
    return HeldCopy(header, data, raw, thin is not None, spec.step, parse(raw, what))


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
    return HeldCopy(header, data, raw_index, thin, head.step, index)


def spec_of(copy: HeldCopy) -> RecordSpec:
    """The record spec of a whole copy's state, as the engine holds a snapshot's."""
    index = json.loads(copy.raw_index)
    tensors = {k: {f: t[f] for f in ("dtype", "shape", "offset", "nbytes")} for k, t in index["tensors"].items()}
    return RecordSpec(record=copy.index.record, kind=Header.model_validate_json(copy.header).kind, step=copy.step,
                      skeleton=index["skeleton"], tensors=tensors, meta=index["meta"])


class HeldCopies:
    """The copies this engine holds of its partners' held steps, the KEEP newest per owner."""

    def __init__(self) -> None:
        self.owners: dict[int, list[HeldCopy]] = {}  # newest first

    def hold(self, owner: int, copy: HeldCopy) -> bool:
        """Keep `copy` (checked) unless one of its step or a newer one is held already."""
        held = self.owners.setdefault(owner, [])
        if held and held[0].step >= copy.step:
            return False
        held.insert(0, copy)
        del held[KEEP:]
        return True

    def steps(self, owner: int) -> list[int]:
        return [c.step for c in self.owners.get(owner, [])]

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
        return HeldCopy(copy.header, data, copy.raw_index, False, step, copy.index)
