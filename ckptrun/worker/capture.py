"""Capture: the state of step t built (ckptrun/worker/state.py) and copied into a slot.

Runs when a strategy asks, mostly right after optimizer step t (`capture`, or `begin` and `add`
for a strategy's own state, `reserve` and `put` for state final piece by piece in backward),
and before the next update touches what a background copy still reads (`wait_copy`). Tensors
the next forward changes (module buffers) are copied at once; the rest, with `background`, by
the copiers (ckptrun/worker/copier.py) while the next forward/backward runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..storage.layout import Layout, TensorSpec
from ..storage.tree import flatten
from .copier import CopyThread, CpuCopier, CudaCopier
from .metrics import WorkerMetrics
from .slots import Staging
from .state import TrainingState


@dataclass
class Snapshot:
    """State of one step on its way into a staging slot (what a strategy reads of it:
    `ckptrun.strategies.context.Snapshot`)."""

    step: int
    slot: int
    skeleton: dict
    layout: Layout
    time: float
    copy: Future | None = None
    event: Any = None  # CUDA event marking the end of the device-to-host copy
    nbytes: int = 0
    prefix: str = ""  # tensor-key prefix, so several snapshots can share one record
    kind: str = "full"  # snapshots of one kind have about the same size (slot sizing)
    # Streamed: the engine reads the slot while it fills (`progress`), so only the engine frees it.
    progress: Callable[[int], None] | None = None
    buf: Any = None  # where it is copied when not a staging slot (`capture(into=...)`; slot is then -1)
    done_at: float | None = None  # when its post-step state was seen complete in the slot ("snapshot done")
    retry: tuple | None = None  # a lazy capture to finish on the training thread (`wait_copy`)
    shared: list[str] = field(default_factory=list)  # keys every data-parallel rank holds alike (`shared_keys`)


Stream = Callable[[Snapshot], Callable[[int], None]]
Order = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class Capture:
    """Builds snapshots of `state` in `staging`'s slots. `checkpointed_step`: the newest step
    committed already (set on resume) or captured by this run."""

    def __init__(self, state: TrainingState, staging: Staging, metrics: WorkerMetrics, cuda: bool) -> None:
        self.state, self.staging, self.metrics, self._cuda = state, staging, metrics, cuda
        self.thread = CopyThread()
        self.cpu, self.gpu = CpuCopier(self.thread), CudaCopier(self.thread)
        self.checkpointed_step: int | None = None

    def begin(self, step: int, kind: str = "full", need: int = 0, prefix: str = "") -> Snapshot:
        """Take a free staging slot for `step` (back-pressure: wait while none is free), big
        enough for `need` bytes and for what the last snapshot of this `kind` took; a snapshot
        that still outgrows it moves to a larger slot."""
        self.staging.ensure(max(need, self.staging.sizes.get(kind, 0)))
        slot = self.staging.acquire()
        return Snapshot(step, slot, {}, Layout((), 0), time.time(), prefix=prefix, kind=kind)

    def capture(self, step: int, *, background: bool, stream: Stream | None = None,
                into: Callable[[int], torch.Tensor | None] | None = None, order: Order | None = None,
                lazy: bool = False, whole: bool = False) -> Snapshot:
        """Copy the post-step state of `step` (parameters, optimizer state, buffers, RNG) into a
        free slot; `seal` adds what settles later. `stream(snap)` (called once the slot is taken)
        returns a callback told each time the slot's first N bytes are final, so the engine can
        persist them while the rest is still being copied (a chunked pipeline). `order` puts the
        tensors in the order they are laid out and copied; `into(nbytes)` gives the buffer to
        copy them into instead of a staging slot (None: a staging slot after all). `lazy` (with
        `background`, without `into`): see `_capture_lazily`. `whole`: replicated tensors too,
        even where another rank writes them (an engine keeping the state leaves them out itself)."""
        if lazy and background and into is None and self.state.can_be_lazy():
            return self._capture_lazily(step, stream, order)
        flat = flatten(self.state.early_state())
        skeleton, tensors = flat if whole else self.state.write_once(*flat)
        if order is not None:
            tensors = order(tensors)
        need = Layout.of(tensors).nbytes
        t0 = time.perf_counter()
        buf = into(need) if into is not None else None
        if buf is not None:
            self.metrics.stalled_since("backpressure", t0)
            snap = Snapshot(step, -1, {}, Layout((), 0), time.time(), kind="full", buf=buf)
        else:
            snap = self.begin(step, "full", need)
        if stream is not None:
            snap.progress = stream(snap)
        self.append(snap, skeleton, tensors, background=background)
        self.metrics.last_snapshot_step = self.checkpointed_step = step
        return snap

    def _capture_lazily(self, step: int, stream: Stream | None, order: Order | None) -> Snapshot:
        """DataStates-LLM's lazy capture: only what the next forward changes (buffers, RNG) is taken
        on the training thread; the parameters and optimizer state, immutable until the next
        update, are gathered (state_dicts, skeleton, layout, a staging slot) and copied on the
        copier thread while the forward/backward runs. `wait_copy` is where the update waits."""
        snap = Snapshot(step, -1, {}, Layout((), 0), time.time(), kind="full")
        taken = self.state.volatile_now()
        if self._cuda and torch.cuda.is_initialized():  # where the trainer's stream has step t's state, and its device
            taken["ready"] = torch.cuda.Event()
            taken["ready"].record()
            taken["device"] = torch.cuda.current_device()
        snap.copy = self.thread.submit(self._fill, snap, taken, stream, order, True)
        self.metrics.last_snapshot_step = self.checkpointed_step = step
        return snap

    def _fill(self, snap: Snapshot, taken: dict, stream: Stream | None, order: Order | None,
              off_thread: bool) -> None:
        """Gather and copy a lazy snapshot. Read off the training thread, a module dict that the
        forward changes meanwhile (a buffer registered on the fly) fails the read: it is then
        done again at `wait_copy`, before the update (the state is still the step's then)."""
        try:
            skeleton, tensors = self.state.write_once(*flatten(self.state.early_state(taken)))
        except RuntimeError:
            if not off_thread:
                raise
            snap.retry = (taken, stream, order)
            return
        if order is not None:
            tensors = order(tensors)
        layout = Layout.of(tensors)
        self.staging.ensure(max(layout.nbytes, self.staging.sizes.get(snap.kind, 0)), trainer=not off_thread)
        snap.slot = self.staging.pool.acquire(self.staging.lost)  # (no free slot: the update waits at `wait_copy`)
        snap.skeleton, snap.layout, snap.nbytes = skeleton, layout, layout.nbytes
        snap.shared = self.state.shared_keys(tensors)
        if stream is not None:
            snap.progress = stream(snap)
        if any(t.is_cuda for t in tensors.values()):
            with torch.cuda.device(taken["device"]):  # (this thread's own current device is not the trainer's)
                snap.event = self.gpu.start(self.buffer(snap), layout, tensors, snap.progress, after=taken["ready"])
        else:
            self.cpu.copy(self.buffer(snap), layout, tensors, snap.progress)

    def add(self, snap: Snapshot, state: dict, *, background: bool = False, write_once: bool = False) -> None:
        """Append `state` to the slot. With `background`, tensors other than module buffers
        (which the next forward changes) are copied off the training thread (a side stream on GPU).
        With `write_once`, replicated tensors another rank writes are left out (`TrainingState.
        write_once`; which rank writes which turns with the step)."""
        flat = flatten(state, snap.prefix)
        self.append(snap, *(self.state.write_once(*flat, rotate=snap.step) if write_once else flat),
                     background=background)

    def append(self, snap: Snapshot, skeleton: Any, tensors: dict[str, torch.Tensor], *, background: bool) -> None:
        """Lay `tensors` out after what the snapshot holds and copy them. A background append
        queues behind the snapshot's earlier copies (one FIFO copier: progress stays in order);
        a synchronous one waits for them first."""
        layout = Layout.of(tensors, start=snap.layout.nbytes)
        if layout.nbytes > self.buffer(snap).numel():
            self.wait_copy(snap)
            self._move_to_larger_slot(snap, layout.nbytes)
        elif not background:
            self.wait_copy(snap)
        buf = self.buffer(snap)
        now = {k: t for k, t in tensors.items() if not background or t.data_ptr() in self.state.volatile}
        self.cpu.copy(buf, layout, now)
        later = {k: t for k, t in tensors.items() if k not in now}
        if later and any(t.is_cuda for t in later.values()):
            snap.event = self.gpu.start(buf, layout, later, snap.progress)
        elif later:
            snap.copy = self.cpu.start(buf, layout, later, snap.progress)
        elif snap.progress is not None and background:  # after the copies still queued
            snap.copy = self.thread.submit(snap.progress, layout.nbytes)
        elif snap.progress is not None:
            snap.progress(layout.nbytes)
        snap.skeleton.update(skeleton)
        snap.shared += self.state.shared_keys(tensors)
        snap.layout = snap.layout + layout
        snap.nbytes = snap.layout.nbytes

    def reserve(self, snap: Snapshot, skeleton: dict, like: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
        """Lay out places for tensors shaped like `like` after what `snap` holds (`skeleton`
        names them), to be filled later by `put`; returns each key's place."""
        layout = Layout.of(like, start=snap.layout.nbytes)
        if layout.nbytes > self.buffer(snap).numel():
            self.wait_copy(snap)
            self._move_to_larger_slot(snap, layout.nbytes)
        snap.skeleton.update(skeleton)
        snap.layout = snap.layout + layout
        snap.nbytes = snap.layout.nbytes
        return {spec.key: spec for spec in layout.specs}

    def put(self, snap: Snapshot, places: list[tuple[TensorSpec, torch.Tensor]]) -> None:
        """Copy each tensor into its reserved place off the training thread (one job), after the
        copies queued before it (so a later `put` of the same place wins)."""
        if not places:
            return
        specs = tuple(spec for spec, _ in places)
        layout = Layout(specs, max(spec.offset + spec.nbytes for spec in specs))
        tensors = {spec.key: t for spec, t in places}
        if any(t.is_cuda for t in tensors.values()):
            snap.event = self.gpu.start(self.buffer(snap), layout, tensors)
        else:
            snap.copy = self.cpu.start(self.buffer(snap), layout, tensors)

    def buffer(self, snap: Snapshot) -> torch.Tensor:
        return snap.buf if snap.buf is not None else self.staging.pool.buffers[snap.slot]

    def _move_to_larger_slot(self, snap: Snapshot, need: int) -> None:
        """The state outgrew its slot (or the strategy's buffer) mid-snapshot: carry what is
        written into a bigger staging slot."""
        self.staging.ensure(need)
        slot = self.staging.acquire()
        old, old_buf = snap.slot, self.buffer(snap)
        self.staging.pool.buffers[slot][: snap.layout.nbytes].copy_(old_buf[: snap.layout.nbytes])
        snap.slot, snap.buf = slot, None
        if old >= 0 and snap.progress is None:
            self.staging.release(old)

    def wait_copies(self) -> None:
        """Block until every background copy started so far is done: the newest one is the last
        to finish (one FIFO copier thread; on GPU, one side stream)."""
        self.cpu.wait_all()
        self.gpu.wait_all()

    def wait_copy(self, snap: Snapshot) -> None:
        """Block until the slot holds `snap`'s post-step state (the next update may then run).
        The first time, that is "snapshot done": recorded, apart from "persist done" (committed)."""
        if snap.copy is not None:
            snap.copy.result()
            snap.copy = None
        if snap.retry is not None:
            args, snap.retry = snap.retry, None
            self._fill(snap, *args, off_thread=False)
        if snap.event is not None:
            snap.event.synchronize()
            snap.event = None
        if snap.done_at is None:
            snap.done_at = time.time()
            self.metrics.last_snapshot_done = max(self.metrics.last_snapshot_done or 0, snap.step)
            self.metrics.emit(type="snapshot_done", step=snap.step, snapshot_s=snap.done_at - snap.time)

    def discard(self, snap: Snapshot) -> None:
        """Give up a snapshot that will not be submitted: its slot goes back to the pool."""
        self.wait_copy(snap)
        if snap.slot >= 0:
            self.staging.release(snap.slot)
