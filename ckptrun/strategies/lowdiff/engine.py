"""Engine side of `lowdiff`: batch B consecutive diffs in host memory, write each batch as one
record (concatenated), chained to its base full checkpoint and to the previous batch.

Kept apart from the trainer side so the engine imports no torch. Diffs held here and not yet
written are lost if the engine dies (half a batch on average, as in the paper); a worker crash
loses nothing, since the engine writes its partial batch before answering the restarted worker.
"""

from __future__ import annotations

import json
import time

from ...engine.handlers import EngineContext, EngineHandler
from ...ipc.messages import RecordSpec, StrategyMessage
from ...storage.store import diff_name
from .messages import Diff, Residual

# Bases whose newest diff record is remembered: a chain only continues on the newest base or, after
# a restart, on a retained one (--keep), never on one older than this many full checkpoints.
CHAINS_KEPT = 64
# Batches written at once at most (its slots are freed as each diff arrives, so without this bound a
# disk slower than the steps grew a queue of written-out batches instead of stalling the trainer).
WRITES_QUEUED = 1


class LowDiffHandler(EngineHandler):
    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.batch: list[tuple[Diff, int]] = []  # each diff held and its bytes' length in `data`
        self.data = bytearray()  # the batch's bytes, concatenated as they arrive (one copy, written as is)
        self.chain: dict[str, str] = {}  # base record -> newest diff record based on it
        self.volatile: dict | None = None  # newest step's memory-only state (top-k residual)

    def handle(self, msg: StrategyMessage) -> None:
        if isinstance(msg, Residual):
            held = self.volatile if self.volatile and self.volatile["step"] == msg.step else None
            self.ctx.reply(msg, found=held is not None, **(held or {}))
            return
        if not isinstance(msg, Diff):
            super().handle(msg)
        spec, disk = msg.spec, msg.disk_nbytes
        if disk < msg.nbytes:
            skeleton = spec.skeleton.pop("volatile")
            tensors = {k: {**t, "offset": t["offset"] - disk} for k, t in spec.tensors.items() if t["offset"] >= disk}
            spec.tensors = {k: t for k, t in spec.tensors.items() if t["offset"] < disk}
            self.volatile = {"step": spec.step, "skeleton": skeleton, "tensors": tensors,
                             "data": self.ctx.read_slot(msg.slot, disk, msg.nbytes)}
        if self.batch and self.batch[-1][0].base != msg.base:
            self.flush()
        self.data += self.ctx.slot_view(msg.slot)[:disk]
        self.ctx.free_slot(msg.slot)
        # Held as JSON text until the batch is written: a step's skeleton (RNG states: ~1,250 ints)
        # is ~6x its JSON as objects, and thousands of them held and freed fragment the heap.
        spec.skeleton = json.dumps(spec.skeleton, separators=(",", ":"))
        self.batch.append((msg, disk))
        # A batch holding the faulted step is written now: the record is named after its last
        # step, so waiting for the batch to fill would never fire the fault.
        if len(self.batch) >= msg.batch or self.ctx.write_fault_due(spec.step):
            self.flush()

    def flush(self) -> None:
        """Write the diffs held in memory as one record."""
        if not self.batch:
            return
        batch, self.batch = self.batch, []
        data, self.data = self.data, bytearray()
        first, last = batch[0][0].spec, batch[-1][0].spec
        base = batch[0][0].base
        tensors, offset = {}, 0
        for msg, nbytes in batch:
            tensors.update({k: {**t, "offset": t["offset"] + offset} for k, t in msg.spec.tensors.items()})
            offset += nbytes
        name = diff_name(first.step, last.step)
        prev = self.chain.pop(base, None)
        self.chain[base] = name
        while len(self.chain) > CHAINS_KEPT:  # one entry per full checkpoint otherwise: oldest first
            del self.chain[next(iter(self.chain))]
        record = RecordSpec(
            record=name, kind="diff", step=last.step, first_step=first.step,
            depends_on=[base] + ([prev] if prev else []), tensors=tensors,
            skeleton={"steps": {str(m.spec.step): json.loads(m.spec.skeleton) for m, _ in batch}},
            meta={**last.meta, "first_step": first.step, "batched_at": time.time()},
        )
        self.ctx.wait_writes(WRITES_QUEUED)  # one batch written while the next fills: a slow disk stalls the trainer
        self.ctx.write(record, memoryview(data))
