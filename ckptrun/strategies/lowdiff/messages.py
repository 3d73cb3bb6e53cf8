"""lowdiff's own messages between its trainer side and its engine-side handler (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...ipc.messages import Op, Persist, StrategyMessage


@dataclass(kw_only=True)
class Diff(Persist):
    """One step's differential state; the handler batches `batch` of them into one record chained
    to `base`. Bytes past `disk_nbytes` (the top-k residual) stay in the engine's memory."""

    op: ClassVar[Op] = Op.STRATEGY
    base: str
    batch: int
    disk_nbytes: int


@dataclass(kw_only=True)
class Residual(StrategyMessage):
    """Ask for the top-k residual held in memory for `step` (reply: found, skeleton, tensors, data)."""

    step: int
