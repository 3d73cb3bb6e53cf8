"""pccheck's messages between its trainer side and its engine-side handler (torch-free).

Per checkpoint: `Begin` once its staging slot is taken (the handler takes a region slot and
starts waiting for bytes), `Ready` each time another chunk of the staging slot is final (it is
persisted at once, while the rest is still being copied), and `Seal` with the complete record
(the handler writes the tail, then commits). A `Seal` without a `Begin` carries the whole slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...ipc.messages import Op, Persist, StrategyMessage


@dataclass(kw_only=True)
class Begin(StrategyMessage):
    step: int
    slot: int
    capacity: int  # bytes of the staging slot: the region's slots are at least this large
    meta_hint: int  # about how large the slot's metadata (its index) will be
    chunk: int
    writers: int
    inflight: int  # N: checkpoints in flight at most (the region holds N + --keep + 1 slots)


@dataclass(kw_only=True)
class Ready(StrategyMessage):
    step: int
    upto: int  # the staging slot's first `upto` bytes are final


@dataclass(kw_only=True)
class Seal(Persist):
    op: ClassVar[Op] = Op.STRATEGY
    chunk: int
    writers: int
    inflight: int
