"""gockpt's message between its trainer side and its engine-side handler (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...ipc.messages import BuildsFull, Op


@dataclass(kw_only=True)
class Spread(BuildsFull):
    """One step `spec.step` of the spread that started at `start`: first the gradients that step
    consumed for every block already sent (and its hyper-parameters), then the blocks sent at
    this step (at version `spec.step`). `last`: the spread ends here (version V = spec.step); the
    slot also holds the rest of the state of V (buffers, RNG, schedulers, ...) and the engine
    writes the full record of V. `exact`: the trainer computes on the CPU, like the engine."""

    op: ClassVar[Op] = Op.STRATEGY
    start: int
    last: bool
    exact: bool
