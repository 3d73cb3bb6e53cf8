"""Engine-side base for strategies that commit into a slotted region (`ckptrun.storage.region`):
`pccheck` (staging slots streamed into the region by parallel writers) and `lightcheck` (the
trainer copies straight into the mapped region). What they share lives here once:

- generations: the current `RegionWriter`, a bigger one when checkpoints outgrow its slots,
  and the files an earlier engine of this rank left (`writer_for`);
- the commit of one filled slot, in the order of DESIGN §5 (`commit_slot`): data durable ->
  index with checksums -> metadata durable -> pointer compare-and-swap -> `Durable`;
- reporting a step `Committed` once every rank's region holds it (`settle`, also from `tick`);
- retention: the newest `--keep` committed steps stay in the region; `--keep 0` moves each
  step out into an ordinary record before its slot is reused; an earlier generation is
  deleted once it holds nothing kept and no job writes into it;
- a starting worker (`restart`, at each Hello, the first one of a new engine too): the steps
  beyond the newest committed one are abandoned and retracted from the region, so that they
  hold no slot; a worker that came back as another rank (`close`): the old rank's files are
  let go of, untouched, for the engine that now holds that rank.

A subclass handles its own messages and calls `writer_for`, `commit_slot` and `settle`;
`slots_freed` is called (lock held) after retention gave slots back.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import CkptrunError
from ..ipc.messages import RecordSpec
from ..log import log
from ..storage.fsutil import json_bytes
from ..storage.layout import align
from ..storage.region import REGION_FILE, Geometry, Regions, RegionWriter
from ..storage.schema import full_name
from ..storage.store import Store, rank_index
from .handlers import EngineContext, EngineHandler

META_MIN = 256 << 10
MOVE_RETRY_S = 5.0  # a move-out whose record did not commit is tried again after this


class RegionHandler(EngineHandler):
    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.cond = threading.Condition()
        self.writer: RegionWriter | None = None
        self.old: list[RegionWriter] = []  # earlier generations still holding steps
        self.counter = 0  # taken when a checkpoint is announced, so counters follow step order
        self.awaiting: dict[int, tuple[int, float]] = {}  # step -> (bytes, snapshot time): durable here only
        self.moving: set[tuple[str, int, int]] = set()  # (file, slot, step) being moved out into a record
        # (file, slot, step) -> when its move-out may be tried again (if this rank's part did not land)
        self.retry_at: dict[tuple[str, int, int], float] = {}
        self.movers = ThreadPoolExecutor(1, thread_name_prefix="region-move")  # never blocked by slot waits
        self.adopted = False  # earlier generations of this rank looked for (once)
        self.jobs: dict[int, Any] = {}  # step -> the subclass's job in flight
        self.replacing = False  # a new worker is replacing a dead one: a job waiting for a slot gives up
        # Move-outs wait for this handler's worker to announce a checkpoint: until then a resume may
        # be deciding, and its sweep of records without a manifest must find no part being written.
        self.worker_resumed = False

    def next_counter(self) -> int:
        with self.cond:
            self.counter += 1
            return self.counter

    def announce(self) -> int:
        """The counter of a checkpoint the worker announced: it has resumed (move-outs may run)."""
        with self.cond:
            self.worker_resumed = True
        return self.next_counter()

    def tick(self) -> None:
        if self._work_left():
            self.settle()

    def _work_left(self) -> bool:
        """Steps waiting to be committed, old generations, or more complete slots than kept."""
        w = self.writer
        return bool(self.awaiting or self.old or (w is not None and len(w.steps) > max(self.ctx.keep, 1)))

    # ---- generations -------------------------------------------------------------------
    def writer_for(self, capacity: int, meta_hint: int, nslots: int, *, direct: bool) -> RegionWriter:
        """The current region (caller holds the lock), replaced by a new generation with `nslots`
        slots if its slots are too small for `capacity` data bytes and `meta_hint` index bytes.
        `direct`: no process maps the region (its data then bypasses the page cache: RegionWriter)."""
        self._adopt()
        w = self.writer
        if w is None or not w.fits(capacity, meta_hint) or w.direct != direct:
            gens = [int(REGION_FILE.fullmatch(p)[2]) for p in self._own_files()]
            geometry = Geometry(nslots, align(capacity), align(max(META_MIN, 4 * meta_hint)))
            self.writer = RegionWriter(Path(self.ctx.root), self.ctx.rank, max(gens, default=-1) + 1, geometry,
                                       direct=direct)
            if w is not None:
                self.old.append(w)
        return self.writer

    def retire_current(self, capacity: int, meta_hint: int) -> None:
        """Checkpoints no longer fit the current region: the next `writer_for` starts a new one."""
        with self.cond:
            if self.writer is not None and not self.writer.fits(capacity, meta_hint):
                self.old.append(self.writer)
                self.writer = None

    def _adopt(self) -> None:
        """Take over the region files an earlier engine of this rank left (once; lock held)."""
        if not self.adopted:
            self.adopted = True
            self.old += self._earlier_generations()

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
                log.warning(f"warning: region file {name} left as it is ({e})")
        return found

    # ---- one checkpoint ----------------------------------------------------------------
    def commit_slot(self, writer: RegionWriter, slot: int, counter: int, spec: RecordSpec, data: memoryview,
                    t0: float, indexed: Callable[[], None] | None = None) -> bool:
        """Make the filled `slot` (its bytes `data`, already written into the file) this rank's
        durable copy of `spec`'s step; `indexed()` once `data` is no longer read (it is released
        first). False if its index does not fit the slot's metadata area: the next checkpoint gets
        a new generation; the caller writes this one as an ordinary record, then releases the slot."""
        ctx, name, nbytes = self.ctx, full_name(spec.step), len(data)
        ctx.fault_hook(spec.step)("data:written")
        writer.sync()
        index = rank_index(name, ctx.rank, data, spec.tensors, spec.skeleton, spec.meta)
        index_raw = json_bytes(index)  # as a record directory's index file
        if not writer.fits(nbytes, len(index_raw)):
            self.retire_current(nbytes, len(index_raw))
            return False
        if indexed is not None:  # `data` may be a staging slot the worker reuses (and may retire) once told
            data.release()
            indexed()
        writer.write_meta(slot, counter=counter, step=spec.step, world_size=ctx.world_size, data_nbytes=nbytes,
                          index_raw=index_raw, meta=spec.meta, written_at=time.time())
        writer.publish(counter, slot, spec.step)
        ctx.durable(spec.step, name, nbytes, time.time() - t0)
        with self.cond:
            self.awaiting[spec.step] = (nbytes, spec.meta.get("snapshot_time", t0))
        return True

    # ---- a restarted worker ------------------------------------------------------------
    def restart(self) -> None:
        """The new worker resumes from the newest committed step: every step this rank holds
        beyond it is abandoned, in this engine's region and in the files an earlier engine of
        this rank left (a replaced node's new engine: before its worker writes anything, so that
        no step ever commits with a part of the dead run beside parts of the resumed one). The
        old worker's jobs end first (one still waiting for a region
        slot gives up: the slots may be held by steps a dead rank never wrote, which no newer
        commit would ever free before the new worker runs); then those steps are retracted, so
        that they hold no slot and never count beside the parts the new workers write again."""
        self._end_jobs()
        with self.cond:
            self.worker_resumed = False
        self.movers.submit(lambda: None).result()  # a move-out under way lands before the resume
        with self.cond:
            self._retract()

    def close(self) -> None:
        """Its worker came back as another rank: the old worker's jobs end and the region files
        are let go of, untouched (the engine now holding this rank adopts them)."""
        self._end_jobs()
        self.movers.shutdown(wait=True)
        with self.cond:
            for w in [self.writer, *self.old]:
                if w is not None:
                    w.close()
            self.writer, self.old = None, []

    def _end_jobs(self) -> None:
        """Wait until every job of the old worker has ended (one still waiting for a region slot
        gives up; no new job comes while the Hello is handled)."""
        with self.cond:
            self.replacing = True
        try:
            self.flush()
            with self.cond:
                while self.jobs:
                    self.cond.wait(0.05)
        finally:
            with self.cond:
                self.replacing = False

    def _retract(self) -> None:
        """Retract the steps beyond the newest committed one from every generation (lock held)."""
        self._adopt()
        committed = [m.step for m in Regions(Path(self.ctx.root)).scan()[0]]
        newest = max(committed, default=-1)
        self.awaiting = {step: v for step, v in self.awaiting.items() if step <= newest}
        for w in [self.writer, *self.old]:
            if w is not None and (gone := w.retract(newest, self.next_counter())):
                self.counter = max(self.counter, w.pointer.counter)
                log.info(f"rank {self.ctx.rank}: steps {gone} of {w.path.name} abandoned (uncommitted when the "
                         f"worker restarted; it resumes from step {max(newest, 0)})")

    # ---- commit and retention ----------------------------------------------------------
    def settle(self) -> None:
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
            self.slots_freed()

    def slots_freed(self) -> None:
        """Retention may have given slots back (lock held)."""

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
            # Under --keep 0 its other steps move out even while it holds a kept one (an earlier
            # engine's generation does, after a restart): the other ranks' slots of those steps
            # are freed only once their records commit.
            out = self.ctx.keep != 0 or all([self._moved_out(store, old, slot, step, committed)
                                             for slot, step in held if step not in kept])
            if old.users or not out or any(step in kept for _, step in held):
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
        if self.worker_resumed and key not in self.moving and time.time() >= self.retry_at.get(key, 0.0):
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
