"""The worker's side of `StrategyContext` (ckptrun/strategies/context.py): each call of a
strategy, passed to the part of the worker that does it.

Made once, with the strategy, when the worker's Runtime starts; called from the strategy's
hooks for the rest of the run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..ipc.messages import Message, Persist
from ..memory_budget import Budget
from ..storage.layout import TensorSpec
from ..strategies.context import StrategyContext
from ..strategies.save_policy import IntervalPolicy, SavePolicy
from .capture import Order, Snapshot, Stream
from .hooks import StepHooks
from .loading import ResumeState


class WorkerContext(StrategyContext):
    """`StrategyContext` over the parts of `rt` (the worker's Runtime)."""

    def __init__(self, rt: StepHooks) -> None:
        self._rt = rt
        self._cfg = rt.cfg

    # ---- the run ------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self._rt.step

    @property
    def rank(self) -> int:
        return self._rt.rank

    @property
    def world_size(self) -> int:
        return self._rt.world_size

    @property
    def options(self) -> dict[str, Any]:
        return self._cfg.options

    @property
    def dir(self) -> str:
        return self._cfg.dir

    @property
    def every(self) -> int:
        return self._cfg.every

    @property
    def max_inflight(self) -> int:
        return self._cfg.max_inflight

    @property
    def replicas(self) -> int:
        return self._cfg.replicas

    @property
    def host_memory(self) -> Budget:
        return self._rt.staging.budget

    @property
    def staging_slots(self) -> int:
        return self._rt.staging.nslots

    @property
    def final_checkpoint(self) -> bool:
        return self._cfg.final_checkpoint

    @property
    def resume(self) -> ResumeState | None:
        return self._rt.loading.resume

    @property
    def checkpointed_step(self) -> int | None:
        return self._rt.capture.checkpointed_step

    @property
    def primary(self) -> torch.optim.Optimizer | None:
        return self._rt.state.primary

    @property
    def models(self) -> dict[str, torch.nn.Module]:
        return self._rt.state.models

    def due(self, step: int) -> bool:
        return self._rt.due(step)

    @property
    def every_auto(self) -> bool:
        return self._cfg.interval_auto

    @property
    def every_given(self) -> bool:
        return self._cfg.every_given

    def use_interval(self, policy: IntervalPolicy) -> None:
        self._rt.use_interval(policy)

    def policy(self, policy: SavePolicy) -> SavePolicy:
        return self._rt.retuner.add(policy)

    # ---- snapshots ----------------------------------------------------------------------
    def capture(self, step: int, *, background: bool, stream: Stream | None = None,
                into: Callable[[int], torch.Tensor | None] | None = None, order: Order | None = None,
                lazy: bool = False, whole: bool = False) -> Snapshot:
        return self._rt.capture.capture(step, background=background, stream=stream, into=into, order=order,
                                        lazy=lazy, whole=whole)

    @property
    def staging_bytes(self) -> int:
        return self._rt.staging.pool.nbytes

    def index_hint(self) -> int:
        return self._rt.handoff.index_hint()

    def begin(self, step: int, kind: str = "full", need: int = 0, prefix: str = "") -> Snapshot:
        return self._rt.capture.begin(step, kind, need, prefix)

    def add(self, snap: Snapshot, state: dict, *, background: bool = False, write_once: bool = False) -> None:
        self._rt.capture.add(snap, state, background=background, write_once=write_once)

    def replicated_positions(self) -> list[int]:
        return self._rt.state.replicated_positions()

    def shared_positions(self) -> list[int]:
        return self._rt.state.shared_positions()

    def reserve(self, snap: Snapshot, skeleton: dict, like: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
        return self._rt.capture.reserve(snap, skeleton, like)

    def put(self, snap: Snapshot, places: list[tuple[TensorSpec, torch.Tensor]]) -> None:
        self._rt.capture.put(snap, places)

    def post_step_state(self) -> dict:
        return self._rt.state.post_step_state()

    def wait_copy(self, snap: Snapshot) -> None:
        self._rt.capture.wait_copy(snap)

    def discard(self, snap: Snapshot) -> None:
        self._rt.capture.discard(snap)

    def seal(self, snap: Snapshot, *, wait: bool = True) -> None:
        self._rt.handoff.seal(snap, wait=wait)

    def submit(self, snap: Snapshot, message: type[Persist] = Persist, *, wait_durable: bool = False,
               layout: str = "records", **fields: Any) -> None:
        self._rt.handoff.submit(snap, message, wait_durable=wait_durable, layout=layout, **fields)

    # ---- engine and metrics -------------------------------------------------------------
    def request(self, msg: Message) -> dict:
        return self._rt.handoff.client.request(msg)

    def send(self, msg: Message) -> None:
        self._rt.handoff.client.send(msg)

    def stall(self, cause: str, seconds: float) -> None:
        self._rt.metrics.add_stall(cause, seconds)

    def update_ran(self, seconds: float) -> None:
        self._rt.update_s += seconds

    def emit(self, **event: Any) -> None:
        self._rt.metrics.emit(**event)
