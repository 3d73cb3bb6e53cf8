"""Engine side of `datastates` (DataStates-LLM §V-A4, §V-A5): the data movement engine. It knows
nothing of the state's kinds: it moves chunks from the staging slot (the host cache) into this
rank's file as soon as the trainer says they are there, tensors at their fixed offsets and
everything else appended to the file's log, then writes the header at the end and hands the
record to the shared commit protocol (storage/rankfile.py, the engine's `record_with`).

Per checkpoint, one `_persist` job on the engine's writer threads: open the rank file (under a
temporary name) at `Begin` -> write each `Chunks` range and `Objects` item as it arrives ->
once sealed and everything the seal names has arrived: the index (file offsets, xxh3 of every
tensor from the slot), free the staging slot, header + footer, fsync, rename, fsync the
directory -> `Durable`, then committed once every rank's file is there. A job whose worker died
before it was complete is dropped at the engine's next flush, its file removed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ...engine.handlers import EngineContext, EngineHandler
from ...errors import AlreadyCommitted
from ...ipc.messages import StrategyMessage
from ...log import log
from ...storage import rankfile
from ...storage.schema import checksum, full_name
from .messages import APPEND, Begin, Chunks, Objects, Seal

Path = tuple[str, ...]


@dataclass
class Job:
    step: int
    slot: int
    fixed: int  # slot bytes that go to the same offsets of the file
    todo: list[tuple[int, int, int, int]] = field(default_factory=list)  # (slot, offset, bytes, file offset)
    arrived: dict[Path, bytes] = field(default_factory=dict)  # objects not written yet
    received: set[Path] = field(default_factory=set)
    covered: int = 0  # the slot's bytes announced so far
    seal: Seal | None = None
    cancelled: bool = False
    slots: set[int] = field(default_factory=set)
    appended: list[tuple[int, int, int]] = field(default_factory=list)  # (slot offset, bytes, file offset)
    placed: dict[Path, dict] = field(default_factory=dict)  # object -> {offset, nbytes, xxh3} in the file
    busy_s: float = 0.0  # time spent writing (not waiting for chunks): the write time reported

    def complete(self) -> bool:
        """Everything the seal names has arrived (not necessarily written yet)."""
        return self.seal is not None and self.covered >= self.seal.nbytes and self.received >= set(self.seal.objects)

    def file_offset(self, offset: int) -> int:
        """Where the slot's byte at `offset` lies in the file."""
        if offset < self.fixed:
            return offset
        for start, n, at in self.appended:
            if start <= offset < start + n:
                return at + offset - start
        raise ValueError(f"slot offset {offset} of step {self.step} was never announced")


class DataStatesHandler(EngineHandler):
    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.cond = threading.Condition()
        self.jobs: dict[int, Job] = {}

    # ---- messages (the engine's connection thread) -------------------------------------
    def handle(self, msg: StrategyMessage) -> None:
        with self.cond:
            if isinstance(msg, Begin):
                job = self.jobs[msg.step] = Job(msg.step, msg.slot, msg.fixed, slots={msg.slot})
                self.ctx.run(self._persist, job)
                return
            job = self.jobs.get(msg.spec.step if isinstance(msg, Seal) else msg.step)
            if job is None:  # its job was dropped (cancelled); a seal's slot is free again
                if isinstance(msg, Seal):
                    self.ctx.free_slot(msg.slot)
                return
            if isinstance(msg, Chunks):
                job.todo += [(msg.slot, *c) for c in msg.chunks]
                job.slots.add(msg.slot)
                job.covered = max([job.covered, *(start + n for start, n, _ in msg.chunks)])
            elif isinstance(msg, Objects):
                job.arrived.update((tuple(p), raw) for p, raw in msg.items)
                job.received.update(tuple(p) for p, _ in msg.items)
            elif isinstance(msg, Seal):
                job.seal = msg
                job.slots.add(msg.slot)
            else:
                super().handle(msg)
            self.cond.notify_all()

    def flush(self) -> None:
        """Everything a live worker sends comes before its flush; so a job that is not complete
        now belongs to a worker that died: dropped (its staging slots are the new worker's)."""
        with self.cond:
            for job in self.jobs.values():
                if not job.complete():
                    job.cancelled = True
            self.cond.notify_all()

    # ---- one checkpoint (a writer thread) ----------------------------------------------
    def _persist(self, job: Job) -> None:
        ctx = self.ctx
        writer: rankfile.RankFileWriter | None = None
        error: Exception | None = None
        try:
            writer = ctx.store.begin_rank_file(full_name(job.step), ctx.rank, job.fixed,
                                               fault=ctx.fault_hook(job.step))
        except AlreadyCommitted:  # a re-run reaching a committed step: nothing is written
            pass
        except Exception as e:  # noqa: BLE001 - reported when the job ends, never a hang
            error = e
        while True:
            with self.cond:
                self.cond.wait_for(lambda: job.cancelled or job.todo or job.arrived or job.complete())
                if job.cancelled:
                    break
                todo, job.todo = job.todo, []
                arrived, job.arrived = job.arrived, {}
                done = job.complete()
            if writer is not None and error is None:
                t0 = time.perf_counter()
                try:
                    self._write(writer, job, todo, arrived)
                except Exception as e:  # noqa: BLE001
                    error = e
                job.busy_s += time.perf_counter() - t0
            if done:
                break
        with self.cond:
            self.jobs.pop(job.step, None)
        if job.cancelled:
            if writer is not None:
                writer.discard()
            log.info(f"datastates: step {job.step}'s checkpoint was dropped (its worker ended before sealing it)")
            return
        self._publish(job, writer, error)

    def _write(self, writer: rankfile.RankFileWriter, job: Job, todo: list, arrived: dict[Path, bytes]) -> None:
        for slot, start, n, at in todo:
            data = self.ctx.slot_view(slot)[start : start + n]
            if at == APPEND:
                job.appended.append((start, n, writer.append(data)))
            else:
                writer.put(data, at)
        for path, raw in arrived.items():
            job.placed[path] = {"offset": writer.append(raw), "nbytes": len(raw), "xxh3": checksum(raw)}

    def _publish(self, job: Job, writer: rankfile.RankFileWriter | None, error: Exception | None) -> None:
        """The index from the slot, the slot freed, the header written: committed as any record."""
        ctx, seal = self.ctx, job.seal
        tensors, t0 = {}, time.perf_counter()
        if writer is not None and error is None:
            try:
                view = ctx.slot_view(seal.slot)
                tensors = {k: {**t, "offset": job.file_offset(t["offset"]),
                               "xxh3": checksum(view[t["offset"] : t["offset"] + t["nbytes"]])}
                           for k, t in seal.spec.tensors.items()}
            except Exception as e:  # noqa: BLE001
                error = e
        for slot in job.slots:
            ctx.free_slot(slot)
        job.busy_s += time.perf_counter() - t0  # (the checksums, as a record's index has them)

        def publish() -> int:
            if writer is None and error is None:
                raise AlreadyCommitted(f"{seal.spec.record} is committed")
            if error is not None:
                if writer is not None:
                    writer.discard()
                raise error
            objects = [{"path": list(p), **job.placed[p]} for p in seal.objects]
            return writer.publish(rankfile.header(seal.spec.record, ctx.rank, tensors, objects, seal.spec.meta))[1]

        ctx.write_with(seal.spec, publish, since=time.time() - job.busy_s)
