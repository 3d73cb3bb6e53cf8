"""datastates' messages between its trainer side and its engine-side handler (torch-free).

Per checkpoint: `Begin` once the snapshot's staging slot is taken (the handler opens the rank
file), `Chunks` each time more of the slot is final (written at once, while the rest is still
being copied), `Objects` with serialized objects (appended to the file's log) and `Seal` with
the record (once everything it names has arrived, the handler writes the header and commits).
`Objects` and the last `Chunks` may arrive after `Seal`: they are sent from other threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...ipc.messages import Op, Persist, StrategyMessage

APPEND = -1  # a chunk's file offset: at the end of the file's log


@dataclass(kw_only=True)
class Begin(StrategyMessage):
    step: int
    slot: int
    fixed: int  # the slot's first `fixed` bytes go to the same offsets of the file; later ones to its log


@dataclass(kw_only=True)
class Chunks(StrategyMessage):
    step: int
    slot: int  # the staging slot they lie in (a snapshot that outgrew its slot moved to a larger one)
    chunks: list[tuple[int, int, int]]  # (offset in the slot, bytes, offset in the file or APPEND)


@dataclass(kw_only=True)
class Objects(StrategyMessage):
    step: int
    items: list[tuple[tuple[str, ...], bytes]]  # (path in the skeleton, its JSON)


@dataclass(kw_only=True)
class Seal(Persist):
    op: ClassVar[Op] = Op.STRATEGY
    objects: list[tuple[str, ...]]  # the paths of every object of the record, in skeleton order
    snapshot_s: float  # capture to snapshot done (the trainer may update from then on)
