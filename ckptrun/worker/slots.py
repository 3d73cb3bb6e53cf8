"""The staging slots a snapshot is copied into: free-list, back-pressure, and their size and
number within the host-memory budget (ckptrun/memory_budget.py).

Runs when a snapshot begins (`Staging.acquire`, after `ensure` made the slots big enough: the
trainer waits here while every slot is in flight) and when the engine hands a slot back
(`release`, on the engine-event thread). The slots are shared memory the engine allocates;
the worker maps them. Making them is seconds for gigabytes (the engine's files, every page
faulted in and zeroed, and on a GPU page-locked), so it happens on a set-up thread of its own
from the moment the optimizer is made (`prepare`), sized for the state known then; the first
checkpoint waits for it only if it comes first, and says so once. A restarted worker re-attaches
to the slots its engine kept (their pages stay resident in shared memory) in the same way.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..config import RunConfig
from ..ipc.client import EngineClient, EngineLost
from ..ipc.messages import Alloc, Retire
from ..ipc.staging import ENV as STAGING_ENV
from ..ipc.staging import map_slot, page_lock, page_unlock, populate
from ..log import log
from ..memory_budget import Budget, fmt
from ..storage.layout import ALIGN, align
from .metrics import WorkerMetrics

STAGING = "staging slots"  # the budget's use by the shared staging slots (memory_budget.py)
SAY_WAIT_S = 0.1  # a first checkpoint's wait for the slots' set-up that is said (every one is in the metrics)


class SlotPool:
    """Staging slots on the worker side: free-list, back-pressure and the mapped buffers.

    Slots are numbered by the engine. When state outgrows them, a larger generation is added
    and the old slots are retired as they come back, so growing never waits on a slot in use.
    """

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.free: list[int] = []
        self.retired: set[int] = set()
        self.locked: set[int] = set()  # the slots page-locked (a GPU): unlocked as they are dropped
        self.unlocked_why: str | None = None  # why a slot could not be page-locked, said once
        self.nbytes = 0
        self.cond = threading.Condition()

    def add(self, slots: list[tuple[int, str, int]], busy: Collection[int] = ()) -> list[int]:
        """Make `slots` the current generation, mapped (no page touched yet: `settle`); returns
        the old slots already free (to retire). `busy` ones are in the engine's use: free once it
        gives them back, or retired then when their size is not the generation's."""
        with self.cond:
            old_free = [i for i in self.free]
            self.retired |= set(self.buffers)
            self.free = []
            for index, path, n in slots:
                self.buffers[index], _ = map_slot(path, n)
            self.nbytes = max(n for _, _, n in slots)
            for index, _, n in slots:
                if index not in busy:
                    self.free.append(index)
                elif n != self.nbytes:
                    self.retired.add(index)
            for i in old_free:
                self.retired.discard(i)
                self._drop(i)
            self.cond.notify_all()
            return old_free

    def settle(self, slots: list[tuple[int, str, int]], pin: bool, fault_in: bool = True) -> None:
        """Fault the mapped `slots` in (`fault_in`) and, with `pin` on a GPU, page-lock them: the
        seconds a slot's first use would otherwise cost. Outside the lock (the engine-event thread
        gives slots back meanwhile); a slot retired or dropped meanwhile is left alone or unlocked."""
        pin = pin and torch.cuda.is_available()
        with self.cond:
            todo = [(i, path, self.buffers[i]) for i, path, _ in slots if i in self.buffers and i not in self.retired]
        for index, path, buf in todo:
            if fault_in:
                populate(buf.data_ptr(), buf.numel())
            why = page_lock(buf.data_ptr(), buf.numel()) if pin else None
            with self.cond:
                if pin and why is None and self.buffers.get(index) is buf:
                    self.locked.add(index)
                elif pin and why is None:  # dropped meanwhile: `buf` still holds the mapping
                    page_unlock(buf.data_ptr())
                elif why is not None and self.unlocked_why is None:
                    self.unlocked_why = why
                    log.warning(f"staging slot {path} could not be page-locked ({why}): copies from the GPU "
                                f"into it wait for the device; put {STAGING_ENV} on tmpfs (/dev/shm)")

    def retire_all(self) -> None:
        """No slot is of the current generation any more (the next `add` makes one)."""
        with self.cond:
            self.retired |= set(self.buffers)
            self.nbytes = 0

    def acquire(self, lost: threading.Event) -> int:
        with self.cond:
            self.cond.wait_for(lambda: self.free or lost.is_set())
            if lost.is_set():
                raise EngineLost("checkpoint engine went away")
            return self.free.pop(0)

    def release(self, slot: int) -> bool:
        """Return a slot; False if it belonged to a retired generation (the engine may drop it)."""
        with self.cond:
            if slot in self.retired:
                self.retired.discard(slot)
                self._drop(slot)
                return False
            self.free.append(slot)
            self.cond.notify_all()
            return True

    def _drop(self, slot: int) -> None:
        """Unmap a retired slot (no copy is running into it: it came back free)."""
        buf = self.buffers.pop(slot, None)
        if buf is not None and slot in self.locked:
            self.locked.discard(slot)
            page_unlock(buf.data_ptr())

    def close(self) -> None:
        """Unmap every slot: the worker finished, and the engine holds nothing unwritten."""
        with self.cond:
            for slot in list(self.buffers):
                self._drop(slot)
            self.free.clear()

    @property
    def inflight(self) -> int:
        return len(self.buffers) - len(self.free)


class Staging:
    """This worker's slots, sized for its snapshots and counted in its host-memory budget.
    `check()` raises if the engine went away (or a save failed under --on-save-error=fail);
    `lost` is set when the engine connection drops. `min_slots` is the strategy's (set once
    the strategy exists): the fewest slots the budget may leave it."""

    def __init__(self, cfg: RunConfig, rank: int, metrics: WorkerMetrics, check: Callable[[], None],
                 lost: threading.Event, pin: bool) -> None:
        self.cfg, self.rank, self.metrics = cfg, rank, metrics
        self.client: EngineClient  # set once connected
        self._check, self.lost, self._pin = check, lost, pin
        self.pool = SlotPool()
        self.budget = Budget(cfg.host_memory, node=cfg.host_memory_node, nlocal=cfg.host_memory_nlocal,
                             source=cfg.host_memory_source)
        self.nslots = cfg.max_inflight  # staging slots per generation: --max-inflight, or fewer by the budget
        self.min_slots = 1
        self.sizes: dict[str, int] = {}  # bytes the last submitted snapshot of each kind took
        self._least = 0  # the fewest staging bytes this run could have done with so far
        self._kept: list[tuple[int, str, int]] = []  # the engine's slots from before, not yet settled
        self._setup = ThreadPoolExecutor(1, thread_name_prefix="ckptrun-staging")
        self._jobs: list[Future] = []  # the set-up thread's work not yet waited for
        self._setup_s = 0.0  # how long the set-up thread worked
        self._ready_lock = threading.Lock()
        self._device: int | None = None  # the CUDA device the slots are page-locked for

    def start(self, slots: list[tuple[int, str, int]], busy: list[int]) -> None:
        """The slots a restarted worker's engine kept from before (its Hello reply); `busy`: in
        use by the engine (the step it holds in memory), given back later. Slots all busy (a
        replaced node's engine holds only the step partners gave back) are no generation to
        capture into: retired once given back, and `ensure` allocates one. Mapped here;
        faulted in and page-locked by `prepare`'s set-up thread (the device is known then)."""
        if slots:
            self.pool.add(slots, busy=busy)
            if not self.pool.free:
                self.pool.retire_all()
            self._kept = slots
            self._least = sum(n for _, _, n in slots)
            self._used()

    def prepare(self, need: int, device: int | None) -> None:
        """The optimizer exists: on the set-up thread, settle the slots the engine kept, and make
        slots for snapshots of `need` bytes (none with 0, or where kept ones hold them), faulted
        in and, on CUDA `device`, page-locked, before the first checkpoint is due (`ready`)."""
        self._device = device
        kept, self._kept = self._kept, []
        self._jobs.append(self._setup.submit(self._prepare, need, kept))

    def _prepare(self, need: int, kept: list[tuple[int, str, int]]) -> None:
        t0 = time.perf_counter()
        try:
            with self._on_device():
                if kept:
                    self.pool.settle(kept, self._pin)
                if need and not (self.pool.free and need <= self.pool.nbytes):
                    self._grow_ahead(need)
        finally:
            self._setup_s = time.perf_counter() - t0

    def _grow_ahead(self, need: int) -> None:
        """Slots for `need` bytes at --max-inflight, where the budget holds them: where it does
        not, the first checkpoint decides (`ensure`), from its true size."""
        size = self._size(need)
        if self.budget.limited and self.cfg.max_inflight * size > self.budget.room(STAGING) - self._in_flight():
            return
        self.pool.settle(self._grow(size, self.cfg.max_inflight), self._pin)

    def _on_device(self):
        """Page-locking on this thread registers the slots with the trainer's device (its own
        current device is the first one)."""
        if self._pin and self._device is not None:
            return torch.cuda.device(self._device)
        return contextlib.nullcontext()

    def ready(self, trainer: bool = True) -> None:
        """Wait for the set-up thread (its error, if any, raised here); the first wait says so
        once, on rank 0, where it is long enough to notice. `trainer`: waited on the training
        thread (stall, cause "setup", reported only in a step that waited)."""
        with self._ready_lock:
            jobs, self._jobs = self._jobs, []
            if not jobs:
                return
            t0 = time.perf_counter()
            waiting = not all(job.done() for job in jobs)
            for job in jobs:
                job.result()
            waited = time.perf_counter() - t0
        if trainer and waiting:
            self.metrics.add_stall("setup", waited)
        if waiting and waited >= SAY_WAIT_S and self.rank == 0:
            how = "made, faulted in and page-locked" if self._pin else "made and faulted in"
            log.info(f"rank {self.rank}: the first checkpoint waited {waited:.2f} s for its staging slots ({how} "
                     "in the background since the optimizer was made)")
        self.metrics.emit(type="staging_ready", setup_s=self._setup_s, waited_s=waited if waiting else 0.0,
                          slots=len(self.pool.buffers), nbytes=self.pool.nbytes)

    def close(self) -> None:
        """The worker finished: the set-up thread's work done (whatever came of it), every slot
        unmapped."""
        for job in self._jobs:
            job.exception()
        self._setup.shutdown()
        self.pool.close()

    def acquire(self) -> int:
        """A free slot; back-pressure (counted as stall) while none is."""
        t0 = time.perf_counter()
        slot = self.pool.acquire(self.lost)
        self.metrics.stalled_since("backpressure", t0)
        return slot

    def release(self, slot: int) -> None:
        """`slot` is free again (a retired one goes back to the engine for good)."""
        if not self.pool.release(slot):
            self.client.send(Retire(slots=[slot]))
            self._used()

    def ensure(self, need: int, trainer: bool = True) -> None:
        """Make the slots hold `need` bytes; with none yet (a fresh engine), allocate some anyway,
        so that a snapshot of unknown size has a slot to start in and grow from. The set-up
        thread's slots first (`ready`); growing here is stall of cause "setup" too (`trainer`:
        on the training thread)."""
        self.ready(trainer)
        if self.pool.buffers and need <= self.pool.nbytes:
            return
        t0 = time.perf_counter()
        self._check()
        size = self._size(need)
        self.nslots = self._within_budget(size)
        with self._on_device():  # (faulted in by the copies, as they come: a slot may never be used)
            self.pool.settle(self._grow(size, self.nslots), self._pin, fault_in=False)
        if trainer:
            self.metrics.stalled_since("setup", t0)

    @staticmethod
    def _size(need: int) -> int:
        """A slot's bytes for snapshots of `need`: room to grow."""
        return align(int(need * 1.25) + ALIGN)

    def _in_flight(self) -> int:
        """Bytes of the current generation's slots in flight (still counted once it is replaced)."""
        return self.pool.inflight * self.pool.nbytes

    def _grow(self, size: int, nslots: int) -> list[tuple[int, str, int]]:
        """A new generation of `nslots` slots of `size` bytes from the engine, mapped; returns them."""
        old = self._in_flight()  # the old generation's slots still in flight
        reply = self.client.request(Alloc(nslots=nslots, nbytes=size))
        retire = self.pool.add(reply["slots"])
        if retire:
            self.client.send(Retire(slots=retire))
        least = self.cfg.max_inflight if self.cfg.max_inflight_given else min(self.cfg.max_inflight, self.min_slots)
        self._least = max(self._least, size * least + old)
        self._used()
        return reply["slots"]

    def _used(self) -> None:
        """The slots mapped now (this generation and old ones not yet back) as the budget's use;
        the least it could do with: the fewest slots of this size, plus the old slots in flight
        when they grew."""
        with self.pool.cond:
            mapped = sum(b.numel() for b in self.pool.buffers.values())
        self.budget.set(STAGING, mapped, least=self._least)

    def _within_budget(self, size: int) -> int:
        """How many slots of `size` bytes the next generation gets: --max-inflight, fewer when the
        budget cannot hold them (an explicit --max-inflight that does not fit is refused). Slots of
        the old generation still in flight count until they come back."""
        want, least = self.cfg.max_inflight, min(self.cfg.max_inflight, self.min_slots)
        old = self._in_flight()
        room = self.budget.room(STAGING) - old
        if want * size <= room or not self.budget.limited:
            return want
        beside = f", beside {fmt(old)} of older slots still in flight" if old else ""
        if self.cfg.max_inflight_given:
            self.budget.refuse(f"--max-inflight {want}", f"staging ({want} slots of {fmt(size)}{beside})",
                               want * size + old)
        fit = max(least, room // size)
        if fit * size > room:  # other uses that can shrink (an auto batch) do so at their next decision
            room = self.budget.room_least(STAGING) - old
        if fit * size > room:
            self.budget.refuse(f"--strategy {self.cfg.strategy}",
                               f"staging (at least {least} slot{'s' if least > 1 else ''} of {fmt(size)}{beside})",
                               least * size + old)
        line = (f"host-memory budget decided: {fit} staging slot{'s' if fit > 1 else ''} of {fmt(size)} in flight "
                f"instead of --max-inflight {want} ({self.budget.describe()})")
        if self.budget.decide("max_inflight", line):
            log.info(line) if self.rank == 0 else None
            self.metrics.emit(type="budget_decided", setting="max_inflight", value=fit, reason=line)
        return fit

    def report(self, step: int) -> None:
        """Into the step's metrics: slots in flight, and the budget's use (an event when it moved)."""
        self.metrics.inflight = self.pool.inflight
        if self.budget.limited:
            if self.budget.changed:  # what uses the budget, each time it moves (not every step)
                self.metrics.emit(type="host_memory", step=step, **self.budget.report())
            self.metrics.host_memory = (self.budget.total, self.budget.used)

