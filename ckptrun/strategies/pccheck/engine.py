"""Engine side of `pccheck`: up to N checkpoints persist at once into a preallocated slotted
region (`ckptrun.storage.region`), each one chunk by chunk as its staging slot fills, by
`writers` threads writing their own byte ranges (pwrite), committed by moving the region's
pointer forward (pccheck.txt §3.1, §4.1; the commit order of DESIGN §5, not the released code's).

Per checkpoint (one `_persist` job on the engine's writer threads): take a free region slot
(never the pointer's; waits while all are in use, which holds the staging slot and so
back-pressures the trainer) -> invalidate its old metadata -> write each chunk as `Ready` says
it is final -> at `Seal`, the tail -> data durable -> metadata (step, sizes, checksums)
durable -> pointer compare-and-swap on the checkpoint's counter, durable -> `Durable` to the
worker. A step is committed for the run once every rank's region holds it (`Regions.scan`, the
readers' own rule); then the worker hears `Committed`. Retention keeps the newest `--keep`
committed steps in the region; `--keep 0` moves each step out into an ordinary record before
its slot is reused. A new engine (after the old one died) starts a new generation file; older
generations are deleted once the new one holds `--keep` committed steps (moved out first
under `--keep 0`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ...engine.handlers import EngineContext
from ...engine.region_handler import RegionHandler
from ...ipc.messages import StrategyMessage
from ...log import log
from ...storage.region import RegionWriter
from ...storage.schema import full_name
from .messages import Begin, Ready, Seal

MAX_JOBS = 64


@dataclass
class Job:
    step: int
    slot: int  # the staging slot
    capacity: int
    meta_hint: int
    chunk: int
    writers: int
    inflight: int
    t0: float = field(default_factory=time.time)
    ready: int = 0
    seal: Seal | None = None
    cancelled: bool = False
    freed: bool = False  # its (sealed) staging slot was handed back
    counter: int = 0  # taken when the checkpoint is announced, so counters follow step order


class PCcheckHandler(RegionHandler):
    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.io = ThreadPoolExecutor(MAX_JOBS, thread_name_prefix="pccheck-io")

    # ---- messages (the engine's connection thread) -------------------------------------
    def handle(self, msg: StrategyMessage) -> None:
        with self.cond:
            if isinstance(msg, Begin):
                job = Job(msg.step, msg.slot, msg.capacity, msg.meta_hint, msg.chunk, msg.writers, msg.inflight)
                self._start(job)
            elif isinstance(msg, Ready):
                job = self.jobs.get(msg.step)
                if job is not None:
                    job.ready = max(job.ready, msg.upto)
            elif isinstance(msg, Seal):
                job = self.jobs.get(msg.spec.step)
                if job is None:  # sealed at once (the final checkpoint): the whole slot is ready
                    job = Job(msg.spec.step, msg.slot, msg.nbytes, 0, msg.chunk, msg.writers, msg.inflight)
                    self._start(job)
                job.seal = msg
            else:
                super().handle(msg)
            self.cond.notify_all()

    def _start(self, job: Job) -> None:
        job.counter = self.announce()
        self.jobs[job.step] = job
        self.ctx.run(self._persist, job)

    def flush(self) -> None:
        """Before a new worker (or at the end): a job whose worker died before sealing it will
        never be sealed; its region slot returns unused and its staging slot is the new worker's."""
        with self.cond:
            for job in self.jobs.values():
                if job.seal is None:
                    job.cancelled = True
            self.cond.notify_all()

    # ---- one checkpoint (a writer thread) ----------------------------------------------
    def _persist(self, job: Job) -> None:
        ctx = self.ctx
        writer = slot = used = None
        failed = False
        try:
            taken = self._take_slot(job)
            if taken is None:  # cancelled while waiting for a region slot
                return
            writer, slot = taken
            used = writer
            writer.invalidate(slot)
            written, pending = 0, []
            while True:
                with self.cond:
                    self.cond.wait_for(lambda done=written: job.cancelled or job.seal is not None
                                       or job.ready - done >= job.chunk)
                    seal, ready = job.seal, job.ready
                if job.cancelled:
                    self._drain(pending)
                    writer.release(slot)
                    return
                if seal is not None and seal.slot != job.slot:  # the snapshot moved to a larger staging slot
                    self._drain(pending)
                    ctx.free_slot(job.slot)
                    job.slot = seal.slot
                end = seal.nbytes if seal is not None else ready
                if end > writer.geometry.slot_bytes:
                    self._drain(pending)
                    writer.release(slot)
                    writer = slot = None
                    self._outgrown(job, seal)
                    return
                pending += self._write(writer, slot, job, written, end)
                written = max(written, end)
                if seal is not None:
                    break
            self._drain(pending)
            data = ctx.slot_view(job.slot)[: seal.nbytes]
            if not self.commit_slot(writer, slot, job.counter, seal.spec, data, job.t0, lambda: self._free(job)):
                writer.release(slot)
                writer = slot = None
                self._outgrown(job, seal)
        except Exception as e:  # noqa: BLE001 - any failure is a save error: reported, never a hang
            failed = True
            if writer is not None and slot is not None and writer.steps.get(slot) is None:
                writer.release(slot)
            ctx.save_error(job.step, full_name(job.step), f"write: {e}")
        finally:
            with self.cond:
                self.jobs.pop(job.step, None)  # a Seal arriving later starts a job of its own
                if used is not None:
                    used.users -= 1
                self.cond.notify_all()
            if failed and job.seal is not None:
                self._free(job)
        self.settle()

    def _free(self, job: Job) -> None:
        with self.cond:
            if job.freed:
                return
            job.freed = True
        self.ctx.free_slot(job.slot)

    def _write(self, writer: RegionWriter, slot: int, job: Job, start: int, end: int) -> list[Future]:
        """Bytes [start, end) of the staging slot, cut into `writers` ranges written in parallel."""
        view = self.ctx.slot_view(job.slot)
        n = max(1, job.writers)
        step = -(-(end - start) // n)
        return [self.io.submit(writer.write, slot, a, view[a : min(end, a + step)])
                for a in range(start, end, max(1, step))]

    @staticmethod
    def _drain(pending: list[Future]) -> None:
        for f in pending:
            f.result()
        pending.clear()

    def _take_slot(self, job: Job) -> tuple[RegionWriter, int] | None:
        """(writer, free region slot) for `job`: slots for N checkpoints in flight plus the
        `--keep` newest committed ones (one more while a new one commits); a new generation if
        they are too small for it (the staging slots grew). None if cancelled meanwhile, or if
        none is free while a new worker replaces a dead one (`RegionHandler.restart`)."""
        with self.cond:
            writer = self.writer_for(job.capacity, job.meta_hint, job.inflight + max(self.ctx.keep, 1) + 1,
                                     direct=True)  # (the trainer copies into staging slots, never into the region)
            writer.users += 1
        while not job.cancelled:
            slot = writer.acquire(timeout=0.1)
            if slot is not None:
                return writer, slot
            self.settle()  # a step may have become committed elsewhere: retention frees slots
            if self.replacing:
                log.info(f"pccheck: step {job.step} given up (no free region slot while the worker restarts)")
                break
        with self.cond:
            writer.users -= 1
        return None

    def _outgrown(self, job: Job, seal: Seal | None) -> None:
        """The checkpoint does not fit the region's slots: the next one gets a larger generation;
        this one is written as an ordinary record (nothing is lost)."""
        job.capacity = max(job.capacity, seal.nbytes if seal else 0)
        self.retire_current(job.capacity, job.meta_hint)
        while seal is None:
            with self.cond:
                self.cond.wait_for(lambda: job.seal is not None or job.cancelled)
                if job.cancelled:
                    return
                seal = job.seal
        if seal.slot != job.slot:  # the snapshot moved to a larger staging slot
            self.ctx.free_slot(job.slot)
            job.slot = seal.slot
        log.info(f"pccheck: step {job.step} outgrew the region's slots; written as an ordinary record")
        self.ctx.write_now(seal.spec, self.ctx.slot_view(seal.slot)[: seal.nbytes])
        self._free(job)
