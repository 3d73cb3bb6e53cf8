"""lowdiff+'s messages between its trainer side and its engine-side handler (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...ipc.messages import BuildsFull, Op, Persist


@dataclass(kw_only=True)
class Base(BuildsFull):
    """A real full snapshot of its step: the replica starts (or re-bases) from it; `persist` also
    writes it. `exact`: the trainer computes on the CPU, so the replica's updates are bit-exact."""

    op: ClassVar[Op] = Op.STRATEGY
    persist: bool
    exact: bool


@dataclass(kw_only=True)
class Grads(Persist):
    """One step's gradients as the optimizer consumed them, its hyper-parameters and post-step
    state (lowdiff's diff format): the engine applies it to the replica; `persist` writes the
    replica of that step; `final` (the run's last step) writes it at once, even with --replicas
    (where a step is otherwise written once the partners' copies have its diff too)."""

    op: ClassVar[Op] = Op.STRATEGY
    persist: bool
    final: bool = False
