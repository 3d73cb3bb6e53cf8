"""Engine side of `lightcheck`: hands out the slots of this rank's region file that the trainer
copies into, and commits each one once it is full (lightcheck.txt §III-D, with the crash
consistency DESIGN §5 adds: per-slot state, sequence number and checksums; the newest complete
slot is never overwritten).

Per checkpoint: `Take` -> a free slot (never the pointer's, and released ones were invalidated
durably before they were freed), its sequence number taken in step order; the reply waits while
every slot is in flight or kept, which back-pressures the trainer -> `Seal` and `Ready` (every
byte copied into the mapped file) -> on a writer thread, `commit_slot`: data durable (fdatasync
of the file covers pages written through the trainer's mapping), index with checksums read from
the slot, metadata durable, pointer moved -> `Durable`; `Committed` once every rank holds it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ...engine.handlers import EngineContext
from ...engine.region_handler import RegionHandler
from ...ipc.messages import StrategyMessage
from ...log import log
from ...storage.region import RegionWriter
from ...storage.schema import full_name
from .messages import Ready, Seal, Take


@dataclass
class Job:
    step: int
    writer: RegionWriter
    slot: int
    counter: int
    t0: float = field(default_factory=time.time)
    seal: Seal | None = None
    ready: bool = False
    started: bool = False


class LightCheckHandler(RegionHandler):
    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.waiting: list[Take] = []  # takes answered once a slot is free, in order

    # ---- messages (the engine's connection thread) -------------------------------------
    def handle(self, msg: StrategyMessage) -> None:
        with self.cond:
            if isinstance(msg, Take):
                self.waiting.append(msg)
                self._grant()
            elif isinstance(msg, Ready | Seal):
                step = msg.step if isinstance(msg, Ready) else msg.spec.step
                job = self.jobs.get(step)
                if job is None:
                    raise RuntimeError(f"lightcheck: {type(msg).__name__} of step {step}, which took no slot")
                if isinstance(msg, Ready):
                    job.ready = True
                else:
                    job.seal = msg
                if job.ready and job.seal is not None and not job.started:
                    job.started = True
                    self.ctx.run(self._persist, job)
            else:
                super().handle(msg)

    def _grant(self) -> None:
        """Answer waiting takes while free slots last (lock held)."""
        while self.waiting:
            take = self.waiting[0]
            writer = self.writer_for(take.capacity, take.meta_hint, take.inflight + max(self.ctx.keep, 1),
                                     direct=not take.mapped)
            slot = writer.acquire(timeout=0)
            if slot is None:
                return
            self.waiting.pop(0)
            writer.users += 1
            self.jobs[take.step] = Job(take.step, writer, slot, self.announce())
            g = writer.geometry
            self.ctx.reply(take, file=writer.path.name, file_bytes=g.file_bytes, data_at0=g.data_at(0),
                           data_at=g.data_at(slot), slot_bytes=g.slot_bytes)

    def slots_freed(self) -> None:
        self._grant()

    def flush(self) -> None:
        """Before a new worker (or at the end): a slot whose worker died before it was sealed
        and filled will never be; it goes back unused (its half-copied bytes never counted)."""
        with self.cond:
            self.waiting.clear()
            for job in [j for j in self.jobs.values() if not j.started]:
                del self.jobs[job.step]
                self._give_back(job)
            self._grant()

    def _give_back(self, job: Job) -> None:
        """Release a slot that holds no committed step (lock held); the pointer's stays."""
        w = job.writer
        if not (w.pointer.counter and w.pointer.slot == job.slot):
            w.invalidate(job.slot)
            w.release(job.slot)
        w.users -= 1

    # ---- one checkpoint (a writer thread) ----------------------------------------------
    def _persist(self, job: Job) -> None:
        """Commit the job's region slot; bytes in a staging slot (--copy-to host) are written into
        it first. A checkpoint that does not fit the slot becomes an ordinary record."""
        ctx, seal, writer = self.ctx, job.seal, job.writer
        staged = seal.slot >= 0
        freed = not staged  # the staging slot goes back to the worker once, whatever happens

        def free() -> None:
            nonlocal freed
            if not freed:
                freed = True
                ctx.free_slot(seal.slot)

        committed, data = False, None
        try:
            data = ctx.slot_view(seal.slot)[: seal.nbytes] if staged else writer.view(job.slot)[: seal.nbytes]
            if seal.nbytes <= writer.geometry.slot_bytes:
                if staged:
                    writer.write(job.slot, 0, data)
                committed = self.commit_slot(writer, job.slot, job.counter, seal.spec, data, job.t0,
                                             free if staged else None)
            else:  # outgrew the region slot mid-snapshot (the runtime moved it to a staging slot)
                self.retire_current(seal.nbytes, 0)
            if not committed:
                log.info(f"lightcheck: step {job.step} did not fit the region's slots; written as an ordinary record")
                ctx.write_now(seal.spec, data)
            data.release()
            free()
        except Exception as e:  # noqa: BLE001 - any failure is a save error: reported, never a hang
            ctx.save_error(job.step, full_name(job.step), f"write: {e}")
            if data is not None:
                data.release()  # before the worker may retire the staging slot
            free()  # else the worker would wait for that staging slot forever
        finally:
            with self.cond:
                self.jobs.pop(job.step, None)
                if committed:
                    job.writer.users -= 1
                else:
                    self._give_back(job)
                self._grant()
        self.settle()
