"""Persisting lowdiff+'s replica (engine.py): the steps the trainer said are due are written,
once the replica stands at them, as ordinary full records, from one persist buffer allocated
once and written by the engine's writer threads while the next steps are applied."""

from __future__ import annotations

import threading

import torch

from ...engine.handlers import EngineContext
from ...ipc.messages import RecordSpec
from ...storage import writeonce
from ...storage.layout import Layout, view
from ...storage.store import full_name
from .facts import BaseFacts
from .replica import SteppedReplica


class ReplicaWriter:
    """The replica's steps due on disk, and the one buffer they are written from."""

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx
        self.due: set[int] = set()  # steps to write once the replica stands at them (--replicas: deferred)
        self.buf: torch.Tensor | None = None  # one buffer, reused by every write
        self.idle = threading.Event()  # no write of the buffer in flight
        self.idle.set()

    def stood(self, step: int, stepped: SteppedReplica, facts: BaseFacts) -> None:
        """The replica stands at `step`: written if it is due."""
        if step in self.due:
            self.due.discard(step)
            self._persist(stepped, facts)

    def flush(self) -> None:
        """Wait for the write in flight, if any."""
        self.idle.wait()

    def _persist(self, stepped: SteppedReplica, facts: BaseFacts) -> None:
        """Copy the arena into the persist buffer (waiting for the previous write) and queue its
        write as the full record of the replica's step; under DDP, without the replicated tensors
        another rank writes (storage/writeonce.py)."""
        r, arena = stepped.replica, stepped.arena
        self.idle.wait()
        skeleton, layout, tensors = r.skeleton, arena.layout, None
        aliases = r.meta["optimizers"]["optimizer"]["params"]
        state = r.full_state() if facts.replicated or facts.shared else {}  # (read only under DDP)
        if facts.replicated:
            skeleton, tensors = writeonce.split_state(state, facts.replicated, aliases, self.ctx.rank,
                                                      self.ctx.world_size)
            layout = Layout.of(tensors)
        if self.buf is None or self.buf.numel() < layout.nbytes:
            self.buf = torch.empty(layout.nbytes, dtype=torch.uint8)
            self.ctx.emit(type="replica_buffer", rank=self.ctx.rank, nbytes=layout.nbytes)
        with torch.no_grad():
            if tensors is None:
                self.buf[: layout.nbytes].copy_(arena.buf)
            else:
                for s in layout.specs:
                    view(self.buf, s).copy_(tensors[s.key])
        meta = {**writeonce.with_shared_keys(r.meta, state, facts.shared, aliases), "step": r.step,
                "snapshot_time": r.time}
        spec = RecordSpec(record=full_name(r.step), kind="full", step=r.step, skeleton=skeleton,
                          tensors={s.key: s.to_json() for s in layout.specs}, meta=meta)
        self.idle.clear()
        self.ctx.run(self._write, spec, memoryview(self.buf.numpy())[: layout.nbytes])

    def _write(self, spec: RecordSpec, data: memoryview) -> None:
        try:
            self.ctx.write_now(spec, data)
        finally:
            self.idle.set()
