"""`datastates` trainer side (DataStates-LLM §V-A2, §V-A3, §V-A5): right after step t only what
the next forward changes (module buffers, RNG) is taken on the training thread; the parameters
and optimizer state, immutable until the next update, are gathered (state_dicts, skeleton,
layout) and copied into a staging slot of the reused host cache (page-locked on GPU, on a side
stream) on the copier thread while the forward/backward of step t+1 runs
(`StrategyContext.capture(lazy=True)`). The update of step t+1 waits only for what is not
copied yet. As the copy advances, each chunk of it is announced to the
engine, which writes it at once; the state's objects (skeletons, RNG, schedulers,
param_groups, tracked objects) are serialized to JSON on a thread of their own while tensors
stream, and appended by the engine after them. The engine ends the file with its header and
commits (engine.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ...storage.layout import Layout
from ..base import SnapshotStrategy
from ..context import Snapshot, StrategyContext
from . import STREAM_MB
from .messages import APPEND, Begin, Chunks, Objects, Seal
from .providers import Path, rank_state, serialize


class DataStates(SnapshotStrategy):
    name = "datastates"
    background = True

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.chunk = (STREAM_MB.integer(ctx.options) or 4) << 20
        self.providers = rank_state()
        self.serializer = ThreadPoolExecutor(1, thread_name_prefix="ckptrun-serialize")
        self.serialized: list[Future] = []
        self.paths: list[Path] = []  # the pending snapshot's objects, in skeleton order
        self.fixed = 0  # the pending snapshot's bytes at fixed file offsets (its tensors at capture)
        self.captured_at = 0.0
        self.sealed: Snapshot | None = None  # the newest snapshot handed over (its late copies may still run)

    def settings(self) -> dict:
        return {**super().settings(), "stream_mb": self.chunk >> 20}

    # ---- step t: lazy capture ------------------------------------------------------------
    def after_step(self, step: int) -> None:
        if self.ctx.due(step):
            self._capture(step)

    def _capture(self, step: int) -> None:
        self.captured_at = time.perf_counter()
        self.pending = self.ctx.capture(step, background=True, stream=self._stream, order=self._order, lazy=True)

    def _order(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ordered = self.providers.tensors(tensors)
        self.fixed = Layout.of(ordered).nbytes
        return ordered

    def _stream(self, snap: Snapshot) -> Callable[[int], None]:
        """Tell the engine the snapshot has begun and start serializing its early objects (a lazy
        capture knows its skeleton by now); return the copier's progress callback, which
        announces each `chunk` bytes copied (everything at once past the fixed part)."""
        ctx, fixed = self.ctx, self.fixed
        ctx.send(Begin(step=snap.step, slot=snap.slot, fixed=fixed))
        if snap.skeleton:
            self._objects(snap, late=False)
        sent = 0

        def progress(upto: int) -> None:
            nonlocal sent
            if upto <= sent or (upto < fixed and upto - sent < self.chunk):
                return
            chunks = []
            if sent < fixed:
                end = min(upto, fixed)
                chunks.append((sent, end - sent, sent))
            if upto > fixed:
                start = max(sent, fixed)
                chunks.append((start, upto - start, APPEND))
            sent = upto
            ctx.send(Chunks(step=snap.step, slot=snap.slot, chunks=chunks))

        return progress

    def _objects(self, snap: Snapshot, *, late: bool) -> None:
        """Serialize the snapshot's early or late objects off the training thread and send them."""
        objects = self.providers.objects(snap.skeleton, late=late)
        self.paths += [path for path, _ in objects]
        step = snap.step
        self.serialized = [f for f in self.serialized if not f.done()]
        self.serialized.append(self.serializer.submit(
            lambda: self.ctx.send(Objects(step=step, items=serialize(objects)))))

    # ---- step t+1: the update waits for the copy ------------------------------------------
    def _hand_over(self) -> None:
        if self.pending is None:
            return
        ctx, snap, self.pending = self.ctx, self.pending, None
        ctx.wait_copy(snap)  # the lazy capture's one blocking point: "snapshot done"
        snapshot_s = time.perf_counter() - self.captured_at
        if not self.paths:  # (captured the ordinary way: its skeleton came with the copy)
            self._objects(snap, late=False)
        ctx.seal(snap, wait=False)  # what settled after the step: cloned now, copied behind
        self._objects(snap, late=True)
        paths, self.paths = self.paths, []
        ctx.submit(snap, Seal, layout="file", objects=paths, snapshot_s=snapshot_s)
        self.sealed = snap

    def finish(self) -> None:
        ctx = self.ctx
        if ctx.final_checkpoint and self.pending is None and ctx.step > 0 and ctx.checkpointed_step != ctx.step:
            self._capture(ctx.step)
        self._hand_over()
        if self.sealed is not None:
            ctx.wait_copy(self.sealed)  # every chunk announced before the engine is flushed
        for f in self.serialized:
            f.result()
        self.serializer.shutdown()
