"""lightcheck's messages between its trainer side and its engine-side handler (torch-free).

Per checkpoint: `Take` (a request) for a region slot to copy into, answered once one is free
(the reply names the region file, its geometry and the slot; the checkpoint's sequence number
is taken here, in step order); `Seal` with the record's description once the step's late state
is added; `Ready` once every byte is in the slot (the copies run after the seal). The handler
commits once it has both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...ipc.messages import Op, Persist, StrategyMessage


@dataclass(kw_only=True)
class Take(StrategyMessage):
    step: int
    capacity: int  # bytes the region's slots must hold
    meta_hint: int  # about how large the slot's metadata (its index) will be
    inflight: int  # checkpoints in flight at most: the region holds this many + --keep slots
    mapped: bool = True  # the trainer maps the region and copies into it (--copy-to region), else into staging slots


@dataclass(kw_only=True)
class Ready(StrategyMessage):
    step: int


@dataclass(kw_only=True)
class Seal(Persist):
    """`slot` is -1 (the bytes are in the region slot taken for the step), or the staging slot
    holding them (--copy-to host, or a snapshot that outgrew the region's slot)."""

    op: ClassVar[Op] = Op.STRATEGY
