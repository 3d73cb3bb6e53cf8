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

import json
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ...engine.handlers import EngineContext, EngineHandler
from ...errors import CkptrunError
from ...ipc.messages import RecordSpec, StrategyMessage
from ...log import log
from ...storage.layout import align
from ...storage.region import REGION_FILE, Geometry, Regions, RegionWriter
from ...storage.schema import full_name
from ...storage.store import Store, rank_index
from .messages import Begin, Ready, Seal

MAX_JOBS = 64
META_MIN = 256 << 10
MOVE_RETRY_S = 5.0  # a move-out whose record did not commit is tried again after this


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


class PCcheckHandler(EngineHandler):
    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.cond = threading.Condition()
        self.jobs: dict[int, Job] = {}
        self.writer: RegionWriter | None = None
        self.old: list[RegionWriter] = []  # earlier generations still holding steps
        self.counter = 0
        self.io = ThreadPoolExecutor(MAX_JOBS, thread_name_prefix="pccheck-io")
        self.awaiting: dict[int, tuple[int, float]] = {}  # step -> (bytes, snapshot time): durable here only
        self.moving: set[tuple[str, int, int]] = set()  # (file, slot, step) being moved out into a record
        # (file, slot, step) -> when its move-out may be tried again (if this rank's part did not land)
        self.retry_at: dict[tuple[str, int, int], float] = {}
        self.movers = ThreadPoolExecutor(1, thread_name_prefix="pccheck-move")  # never blocked by slot waits
        self.adopted = False  # earlier generations of this rank looked for (once)

    # ---- messages (the engine's connection thread) -------------------------------------
    def handle(self, msg: StrategyMessage) -> None:
        with self.cond:
            if isinstance(msg, Begin):
                job = Job(msg.step, msg.slot, msg.capacity, msg.meta_hint, msg.chunk, msg.writers, msg.inflight)
                self.counter += 1
                job.counter = self.counter
                self.jobs[msg.step] = job
                self.ctx.run(self._persist, job)
            elif isinstance(msg, Ready):
                job = self.jobs.get(msg.step)
                if job is not None:
                    job.ready = max(job.ready, msg.upto)
            elif isinstance(msg, Seal):
                job = self.jobs.get(msg.spec.step)
                if job is None:  # sealed at once (the final checkpoint): the whole slot is ready
                    job = Job(msg.spec.step, msg.slot, msg.nbytes, 0, msg.chunk, msg.writers, msg.inflight)
                    self.counter += 1
                    job.counter = self.counter
                    self.jobs[job.step] = job
                    self.ctx.run(self._persist, job)
                job.seal = msg
            else:
                super().handle(msg)
            self.cond.notify_all()

    def flush(self) -> None:
        """Before a new worker (or at the end): a job whose worker died before sealing it will
        never be sealed; its region slot returns unused and its staging slot is the new worker's."""
        with self.cond:
            for job in self.jobs.values():
                if job.seal is None:
                    job.cancelled = True
            self.cond.notify_all()

    def tick(self) -> None:
        if self._work_left():
            self._settle()

    def _work_left(self) -> bool:
        """Steps waiting to be committed, old generations, or more complete slots than kept."""
        w = self.writer
        return bool(self.awaiting or self.old or (w is not None and len(w.steps) > max(self.ctx.keep, 1)))

    # ---- one checkpoint (a writer thread) ----------------------------------------------
    def _persist(self, job: Job) -> None:
        ctx, name = self.ctx, full_name(job.step)
        writer = slot = used = None
        failed = False
        try:
            taken = self._take_slot(job)
            if taken is None:  # cancelled while waiting for a region slot
                return
            writer, slot, counter = taken
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
            ctx.fault_hook(job.step)("data:written")
            writer.sync()
            spec = seal.spec
            index = rank_index(name, ctx.rank, ctx.slot_view(job.slot)[: seal.nbytes], spec.tensors, spec.skeleton,
                               spec.meta)
            index_raw = json.dumps(index, indent=1).encode()  # as a record directory's index file
            if not writer.fits(seal.nbytes, len(index_raw)):
                writer.release(slot)
                writer = slot = None
                self._outgrown(job, seal, index_raw)
                return
            self._free(job)
            writer.write_meta(slot, counter=counter, step=job.step, world_size=ctx.world_size,
                              data_nbytes=seal.nbytes, index_raw=index_raw, meta=spec.meta, written_at=time.time())
            writer.publish(counter, slot, job.step)
            ctx.durable(job.step, name, seal.nbytes, time.time() - job.t0)
            with self.cond:
                self.awaiting[job.step] = (seal.nbytes, spec.meta.get("snapshot_time", job.t0))
        except Exception as e:  # noqa: BLE001 - any failure is a save error: reported, never a hang
            failed = True
            if writer is not None and slot is not None and writer.steps.get(slot) is None:
                writer.release(slot)
            ctx.save_error(job.step, name, f"write: {e}")
        finally:
            with self.cond:
                self.jobs.pop(job.step, None)  # a Seal arriving later starts a job of its own
                if used is not None:
                    used.users -= 1
                self.cond.notify_all()
            if failed and job.seal is not None:
                self._free(job)
        self._settle()

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

    def _take_slot(self, job: Job) -> tuple[RegionWriter, int, int] | None:
        """(writer, free region slot, counter) for `job`; a new generation if the slots are too
        small for it (the staging slots grew) or none exists yet. None if cancelled meanwhile."""
        with self.cond:
            w = self.writer
            if not self.adopted:
                self.adopted = True
                self.old += self._earlier_generations()
            if w is None or not w.fits(job.capacity, job.meta_hint):
                self.writer = self._new_generation(job)
                if w is not None:
                    self.old.append(w)
            writer, counter = self.writer, job.counter  # (jobs may start out of step order)
            writer.users += 1
        slot = None
        while slot is None:
            if job.cancelled:
                return None
            slot = writer.acquire(timeout=0.1)
            if slot is None:
                self._settle()  # a step may have become committed elsewhere: retention frees slots
        return writer, slot, counter

    def _own_files(self) -> list[str]:
        return [p for p in Regions(Path(self.ctx.root)).files() if int(REGION_FILE.fullmatch(p)[1]) == self.ctx.rank]

    def _earlier_generations(self) -> list[RegionWriter]:
        """This rank's region files left by an earlier engine (it died, or an earlier run): their
        committed steps stay readable until the new generation holds `--keep` of its own."""
        found = []
        for name in self._own_files():
            try:
                found.append(RegionWriter.existing(Path(self.ctx.root), name))
            except (OSError, ValueError, CkptrunError) as e:
                log.warning(f"warning: pccheck: region file {name} left as it is ({e})")
        return found

    def _new_generation(self, job: Job) -> RegionWriter:
        """Slots for N checkpoints in flight plus the `--keep` newest committed ones (one more
        while a new one commits)."""
        gens = [int(REGION_FILE.fullmatch(p)[2]) for p in self._own_files()]
        nslots = job.inflight + max(self.ctx.keep, 1) + 1
        geometry = Geometry(nslots, align(job.capacity), align(max(META_MIN, 4 * job.meta_hint)))
        return RegionWriter(Path(self.ctx.root), self.ctx.rank, max(gens, default=-1) + 1, geometry)

    def _outgrown(self, job: Job, seal: Seal | None, index_raw: bytes | None = None) -> None:
        """The checkpoint does not fit the region's slots: the next one gets a larger generation;
        this one is written as an ordinary record (nothing is lost)."""
        with self.cond:
            job.capacity = max(job.capacity, seal.nbytes if seal else 0)
            job.meta_hint = max(job.meta_hint, len(index_raw or b""))
            if self.writer is not None and not self.writer.fits(job.capacity, job.meta_hint):
                self.old.append(self.writer)
                self.writer = None
        while seal is None:
            with self.cond:
                self.cond.wait_for(lambda: job.seal is not None or job.cancelled)
                if job.cancelled:
                    return
                seal = job.seal
        log.info(f"pccheck: step {job.step} outgrew the region's slots; written as an ordinary record")
        self.ctx.write_now(seal.spec, self.ctx.slot_view(seal.slot)[: seal.nbytes])
        self.ctx.free_slot(seal.slot)

    # ---- commit and retention ----------------------------------------------------------
    def _settle(self) -> None:
        """Report steps every rank holds as committed; give slots back beyond retention."""
        with self.cond:
            if not self._work_left():
                return
            committed = sorted(m.step for m in Regions(Path(self.ctx.root)).scan()[0])
            newest = committed[-1] if committed else -1
            for step in sorted(self.awaiting):
                if step in committed:
                    nbytes, snap_t = self.awaiting.pop(step)
                    self.ctx.committed(step, full_name(step), nbytes, snap_t)
                elif step < newest:  # another rank never saved it: it will not commit
                    del self.awaiting[step]
            self._retain(committed)

    def _retain(self, committed: list[int]) -> None:
        """Free region slots beyond retention (caller holds the lock): the pointer's slot, slots
        of steps newer than the newest committed one (in flight or waiting for other ranks) and
        the newest `--keep` committed steps stay; under `--keep 0` a step leaves only once its
        ordinary record is committed. An earlier generation is deleted once no job uses it and
        it holds nothing kept."""
        newest = committed[-1] if committed else -1
        kept = set(committed[-max(self.ctx.keep, 1):])
        store = Store(Path(self.ctx.root))
        w = self.writer
        if w is not None:
            for slot, step in list(w.steps.items()):
                if step > newest or step in kept or (w.pointer.counter and slot == w.pointer.slot):
                    continue
                if self.ctx.keep == 0 and not self._moved_out(store, w, slot, step, committed):
                    continue
                w.release(slot)
        for old in list(self.old):
            held = [(slot, step) for slot, step in old.steps.items() if step <= newest]
            if old.users or any(step in kept for _, step in held):
                continue
            if self.ctx.keep == 0 and not all([self._moved_out(store, old, slot, step, committed)
                                               for slot, step in held]):
                continue
            self.old.remove(old)
            old.close()
            old.path.unlink(missing_ok=True)

    def _moved_out(self, store: Store, writer: RegionWriter, slot: int, step: int, committed: list[int]) -> bool:
        """`--keep 0`: may this slot's step leave the region? Yes once its ordinary record is
        committed, or if no rank ever committed it; otherwise its move-out is started (again)."""
        name = full_name(step)
        if store.is_committed(name):
            return True
        present = store.ranks_present(name)
        if step not in committed and not present:
            return True  # not every rank saved it and nobody is moving it out: nothing to keep
        if self.ctx.rank in present:
            return False  # this rank's part is out; the other ranks' parts are on their way
        key = (writer.path.name, slot, step)
        if key not in self.moving and time.time() >= self.retry_at.get(key, 0.0):
            self.moving.add(key)
            self.movers.submit(self._move_out, writer, slot, step)
        return False

    def _move_out(self, writer: RegionWriter, slot: int, step: int) -> None:
        """Copy this rank's part of a committed step out of its slot into an ordinary record (the
        engine's commit protocol then commits it; the slot is freed by `_retain` after that)."""
        key = (writer.path.name, slot, step)
        try:
            found = writer.read_meta(slot)
            if found is not None and found[0]["step"] == step:
                index = json.loads(found[1])
                data = os.pread(writer.fd, index["data_nbytes"], writer.geometry.data_at(slot))
                spec = RecordSpec(record=full_name(step), kind="full", step=step, skeleton=index["skeleton"],
                                  tensors=index["tensors"], meta=index["meta"])
                self.ctx.write_now(spec, memoryview(data))
        except Exception as e:  # noqa: BLE001 - reported; the step stays in the region
            self.ctx.save_error(step, full_name(step), f"moving out of the region: {e}")
        finally:
            with self.cond:
                self.moving.discard(key)
                self.retry_at = {k: t for k, t in self.retry_at.items() if t > time.time()}
                self.retry_at[key] = time.time() + MOVE_RETRY_S
