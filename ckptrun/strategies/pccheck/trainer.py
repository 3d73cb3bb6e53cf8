"""`pccheck` trainer side: capture after step t into a free staging slot (one of N; the trainer
stalls only when all N are in flight), copied off the training thread; each chunk of the slot
is announced to the engine as soon as it is final, so persisting starts while the rest is still
being copied (pccheck.txt Fig. 7); the next update waits only for the copy (§3.1, "the stall
between T_2 and U_2"), never for the disk."""

from __future__ import annotations

from collections.abc import Callable

from ...errors import UsageError
from ..base import SnapshotStrategy
from ..context import Snapshot, StrategyContext
from . import CHUNK_MB, CKPT_WRITERS
from .messages import Begin, Ready, Seal
from .policy import ConcurrentInterval

MIN_CHUNK, MAX_CHUNK = 1 << 20, 256 << 20


class PCcheck(SnapshotStrategy):
    name = "pccheck"
    background = True
    message = Seal

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.writers = CKPT_WRITERS.integer(ctx.options) or 2  # (auto: the default)
        chunk_mb = CHUNK_MB.integer(ctx.options)
        self.chunk = chunk_mb << 20 if chunk_mb else None
        try:  # (unset: the run's --max-overhead, whose default is PCcheck's 5% too)
            q = float(ctx.options.get("max_slowdown") or 1 + (ctx.options.get("max_overhead") or 0.05))
        except ValueError:
            q = 0.0
        if not q >= 1.0:
            raise UsageError(f"--max-slowdown is runtime with / without checkpoints, at least 1 (e.g. 1.05); "
                             f"got {ctx.options.get('max_slowdown')!r}")
        if ctx.every_auto:
            ctx.use_interval(ConcurrentInterval(ctx.max_inflight, q))

    def settings(self) -> dict:
        return {**super().settings(), "ckpt_writers": self.writers, "chunk_mb": (self.chunk or 0) >> 20 or "auto"}

    def after_step(self, step: int) -> None:
        if self.ctx.due(step):
            self.pending = self.ctx.capture(step, background=True, stream=self._stream)

    def _chunk_for(self, nbytes: int) -> int:
        return self.chunk or min(MAX_CHUNK, max(MIN_CHUNK, nbytes // 8))

    def _stream(self, snap: Snapshot) -> Callable[[int], None]:
        """Tell the engine the checkpoint has begun; return the copier's progress callback."""
        ctx = self.ctx
        chunk = self._chunk_for(ctx.staging_bytes)
        ctx.send(Begin(step=snap.step, slot=snap.slot, capacity=ctx.staging_bytes, chunk=chunk,
                       meta_hint=ctx.index_hint(), writers=self.writers, inflight=ctx.max_inflight))
        sent = 0

        def progress(upto: int) -> None:
            nonlocal sent
            if upto - sent >= chunk:
                sent = upto
                ctx.send(Ready(step=snap.step, upto=upto))

        return progress

    def submit_fields(self) -> dict:
        return {"chunk": self._chunk_for(self.ctx.staging_bytes), "writers": self.writers,
                "inflight": self.ctx.max_inflight}
