"""The checkpoint-engine process: one per local rank, started by the launcher (spawn).

It owns the staging slots and the writers, so it outlives a crashed worker: whatever was handed
to it is still made durable, and the restarted worker reconnects and is answered only after the
engine has flushed (DESIGN §2). On global rank 0 it also commits records once every rank's
files are durable, and prunes old ones; with --node-local-dir the ranks' parts are in their own
nodes' --dir and the commit goes through the job store (nodecommit.py). It imports no torch on
the plain persist path.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import AlreadyCommitted, CorruptCheckpoint
from ..faults import Fault
from ..ipc.events import EventLog
from ..ipc.messages import (
    Alloc,
    Committed,
    Durable,
    FaultKill,
    FetchHeld,
    Hello,
    InMemory,
    Message,
    Persist,
    RecordSpec,
    Reply,
    Retire,
    SaveError,
    Shutdown,
    SlotFree,
    StrategyMessage,
)
from ..ipc.staging import EngineSlot
from ..log import log
from ..storage import iowriter, memory_status
from ..storage.dirlock import Claim, hold_for_engine
from ..storage.fsutil import FaultHook, _no_fault
from ..storage.layout import align
from ..storage.leftovers import exit_with_owner, remove_staging, staging_path
from ..storage.store import Manifest, Store, WrittenPart
from . import drain
from .arena import HeapTrimmer, one_arena
from .handlers import EngineContext, engine_handler
from .held import HeldSnapshot
from .nodecommit import Board
from .step_clock import StepClock

if TYPE_CHECKING:
    from .held_copies import HeldCopy
    from .replicate import Replicator

COMMIT_TRIES = 6  # a commit that fails this often is abandoned (reported; the previous step stays)
COMMIT_BACKOFF_S = 0.1  # first retry delay; doubles each time
FAILED_KEPT = 1024  # failed records remembered (to abandon what depends on them)


class Engine:
    def __init__(self, local_rank: int, tag: str, metrics_dir: str | None, claim: Claim | None = None) -> None:
        self.local_rank, self.tag = local_rank, tag
        self.claim = claim  # the run's lock on --dir, which the path must still name (storage/dirlock.py)
        self.dir_lost = False  # said once: --dir is no longer the directory the run locked
        self.log = EventLog(metrics_dir, f"engine-{local_rank}")
        self.conn: Connection | None = None  # the worker events go to, once its Hello is answered
        self.serving: Connection | None = None  # the connection `serve` reads
        self._send_lock = threading.Lock()
        self.slots: dict[int, EngineSlot] = {}
        self.inflight: set[Future] = set()
        self._inflight_lock = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None
        self.store: Store | None = None
        self.rank = 0
        self.world_size = 1
        self.keep = 2
        self.fault: Fault | None = None
        self.handler = None
        self.strategy: str | None = None
        self.pending: dict[str, RecordSpec] = {}  # written by this rank, not yet committed
        self.failed: dict[str, str] = {}  # records that will never commit -> why
        self._retries: dict[str, tuple[int, float]] = {}  # record -> (failed commits, next try)
        self._enospc_left = 0
        self._pending_lock = threading.RLock()
        self.committed_step: int | None = None
        self.io_engine: str | None = None  # the file writer running (storage/iowriter.py)
        self.holds_memory = False  # a handler said it holds a step in memory (memory_status)
        self.memory = HeldSnapshot()  # a snapshot strategy's newest step, held in its slot (--persist-every)
        self.step_time = StepClock()  # of the steps held (--replicas: their copies wait one step's time)
        self.stopping = threading.Event()
        self.drain: drain.Drain | None = None  # --durable: copies this rank's part of committed steps there
        self.replicator = None  # --replicas > 1: this rank's copies in partners' memory (engine/replicate.py)
        self.board: Board | None = None  # --node-local-dir: the round's commit keys (engine/nodecommit.py)
        self.log.emit(type="engine", local_rank=local_rank, pid=os.getpid())

    # ---- plumbing ----------------------------------------------------------------------
    def send(self, msg: Message) -> None:
        """Send an event to the connected worker; a gone worker is not an error."""
        with self._send_lock:
            if self.conn is None:
                return
            try:
                self.conn.send(msg)
            except (OSError, EOFError, ValueError):
                self.conn = None

    def reply(self, req: Message, **fields: Any) -> None:
        self.send(Reply(id=req.id, body=fields))

    def submit(self, fn, *args) -> Future:
        fut = self.pool.submit(fn, *args)
        with self._inflight_lock:
            self.inflight.add(fut)
        fut.add_done_callback(lambda f: self._done(f))
        return fut

    def _done(self, fut: Future) -> None:
        with self._inflight_lock:
            self.inflight.discard(fut)
        if fut.exception() is not None:
            traceback.print_exception(fut.exception())

    def flush(self, restart: bool = False) -> None:
        """Wait until every job has ended; `restart`: a new worker replaces a dead one, whose
        jobs the handler may give up (`EngineHandler.restart`)."""
        if self.handler is not None:
            (self.handler.restart if restart else self.handler.flush)()
        self.wait_jobs(fewer_than=1)

    def wait_jobs(self, fewer_than: int) -> None:
        """Block until fewer than `fewer_than` submitted jobs are queued or running."""
        while True:
            with self._inflight_lock:
                futs = list(self.inflight)
            if len(futs) < fewer_than:
                return
            wait(futs, return_when=FIRST_COMPLETED)

    # ---- messages ----------------------------------------------------------------------
    def serve(self, conn: Connection) -> None:
        """One worker's messages, in order; its first is its Hello (events reach it from then)."""
        self.serving = conn
        while not self.stopping.is_set():
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, Shutdown):
                self.stopping.set()
                break
            getattr(self, f"op_{msg.op.value}")(msg)
        with self._send_lock:
            self.conn = None
        conn.close()

    def op_hello(self, msg: Hello) -> None:
        # Events of the old worker's jobs ending here (a staging slot freed, a step durable) are
        # not the new worker's, so it hears events only from here on: it gets every slot in the
        # reply, and a SlotFree before it would hand out a slot twice, or one this Hello drops.
        adopt = msg.rank != self.rank and msg.strategy == self.strategy and self.replicator is not None
        given_up = self._give_up_handler(adopt) if self.handler is not None and msg.rank != self.rank else []
        self.flush(restart=True)
        if msg.rank != self.rank or msg.strategy != self.strategy:  # what is held is another worker's
            if adopt:  # (the node that has its old rank now may take it back from here)
                self.replicator.adopt(self.rank, HeldSlots(self), given_up)
            self.memory.drop()
        self.memory.keep = 1 if msg.replication is None else 2
        self.step_time.reset()
        with self._send_lock:
            self.conn = self.serving
        self.rank, self.world_size, self.keep = msg.rank, msg.world_size, msg.keep
        self.store = Store(msg.dir, claim=self.claim)
        self.fault = Fault.parse(msg.fault) if msg.fault else None
        if self.drain is None:
            self.drain = drain.from_config(self.store, self.log, self._upload_fault, self.rank)
        else:  # the worker may have come back as another rank
            self.drain.rank = self.rank
        self._enospc_left = self.fault.times if self.fault and self.fault.target == "enospc" else 0
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max(1, msg.writers), thread_name_prefix="writer")
        self.io_threads = max(1, msg.io_threads)
        if (io_engine := iowriter.select(msg.io_engine)) != self.io_engine:  # said once
            self.io_engine = io_engine
            self.log.emit(type="io_engine", rank=msg.rank, engine=io_engine)
        if self.strategy != msg.strategy:  # a restarted worker keeps what the handler holds
            self.strategy, self.handler = msg.strategy, engine_handler(msg.engine_handler, ServerContext(self))
            self.handler.restart()  # what an earlier engine (a replaced node's) left uncommitted goes too
        self._join_board(msg.node_local)
        if self.drain is not None:
            self.drain.board = self.board
        if msg.replication is not None:
            self._replicate(msg)
        newest = max((s.nbytes for s in self.slots.values()), default=0)
        for i in [i for i, s in self.slots.items() if s.nbytes < newest and not self.memory.holds(i)]:
            self.slots.pop(i).close()
        # The slot held in memory goes to the worker too, in use: the engine gives it back once
        # a newer step replaces it (the restarted worker may resume from it first).
        held = [i for i in self.slots if self.memory.holds(i)]
        self.reply(msg, pid=os.getpid(), slots=self._slot_list(sorted(self.slots)), busy=held,
                   committed_step=self.committed_step)

    def _replicate(self, msg: Hello) -> None:
        """Meet the partners' engines of this rendezvous round (before the worker is answered: a
        replaced node's parts come back first). torch is needed only here, only with --replicas
        (imported from the engine's start: `main`'s `preload`)."""
        from .replicate import Replicator

        if self.replicator is None:
            self.replicator = Replicator(self.log)
            self.replicator.on_held = lambda step: self._on_board(lambda b: b.hold(self.rank, step))
        memory, copies = self.handler.replication() or (HeldSlots(self), None)
        self.replicator.join(msg.replication, msg.rank, msg.world_size, self.store, self.fault,
                             node_local=msg.node_local is not None, memory=memory, copies=copies)

    def _join_board(self, spec: dict | None) -> None:
        """--node-local-dir: meet the round's commit keys (a new round: new keys; what the old
        round left uncommitted is written again by the re-run, or, below a step resumed from
        memory, never: it is no longer waited for)."""
        if spec is None or (self.board is not None and self.board.key == spec["prefix"]):
            return
        with self._pending_lock:
            self.pending.clear()
            self._retries.clear()
        try:
            self.board = Board.connect(spec)
        except (RuntimeError, ValueError) as e:  # no commit this round: the previous step stays
            self.board = None
            self.save_error(-1, "", f"the job store is not reachable ({e}); nothing commits this round")

    def _give_up_handler(self, adopt: bool) -> list[HeldCopy]:
        """The worker came back as another rank: the handler's state is its old rank's, which the
        engine of the node now holding that rank adopts. Its jobs end, it lets go of that state
        (`EngineHandler.close`), and the Hello (whose flush waits for the old worker's writes,
        still under the old rank) makes a new one for the new rank. With `adopt` (--replicas),
        what it held is cut first for the next round (`EngineHandler.give_up`), and returned."""
        given_up = []
        if adopt:
            try:
                given_up = self.handler.give_up(self.rank)
            except Exception as e:  # noqa: BLE001 - let go of unkept: the ranks resume from the records
                log.warning(f"rank {self.rank}: what the engine held of this rank is not kept for the node that has it "
                            f"now ({type(e).__name__}: {e}); it resumes from --dir")
        self.handler.close()
        self.strategy, self.handler = None, None
        self._withdraw_memory()
        self.log.emit(type="rank_changed", rank=self.rank)
        return given_up

    def op_alloc(self, msg: Alloc) -> None:
        """Add a generation of staging slots; the worker retires the old ones as they free up."""
        self.reply(msg, slots=self._slot_list(self.new_slots(msg.nslots, msg.nbytes)))

    def new_slots(self, n: int, nbytes: int) -> range:
        """Make `n` staging slots of `nbytes` each; their indices."""
        first = max(self.slots, default=-1) + 1
        for i in range(first, first + n):
            self.slots[i] = EngineSlot(staging_path(self.tag, self.local_rank, i), nbytes)
        return range(first, first + n)

    def op_retire(self, msg: Retire) -> None:
        for i in msg.slots:
            slot = self.slots.pop(i, None)
            if slot is not None:
                slot.close()

    def _slot_list(self, indices) -> list[tuple[int, str, int]]:
        return [(i, str(self.slots[i].path), self.slots[i].nbytes) for i in indices]

    def op_flush(self, msg: Message) -> None:
        self.flush()
        self.reply(msg)

    def op_commit_pending(self, msg: Message) -> None:
        self.flush()
        # (on a node-local --dir only rank 0 commits; the others publish what it committed)
        self.commit_ready() if self.rank == 0 or self.board is None else self.watch_commits()
        self.reply(msg, committed_step=self.committed_step, held=self._held(), pending=len(self.pending))

    def _held(self) -> list[tuple[int, int]]:
        """(step, bytes) of each state held in memory, newest first: the handler's (a replica),
        else a snapshot strategy's slots."""
        return (self.handler.held() if self.handler is not None else []) or self.memory.held()

    def op_fetch_held(self, msg: FetchHeld) -> None:
        """A restarted worker resumes from the state held in memory (no disk read)."""
        try:
            if self.handler is not None and self.handler.held():
                self.reply(msg, **self.handler.fetch(msg.step))
            else:
                self.reply(msg, **self.memory.fetch(msg.step, lambda slot: self.slots[slot].path))
        except Exception as e:  # any failure: the worker falls back to the committed records
            self.reply(msg, error=f"{type(e).__name__}: {e}")

    def op_bye(self, msg: Message) -> None:
        """A worker's clean goodbye; its writes go on as queued, and events about them (a late
        commit, a step moved out of a region) are no longer sent: the worker is closing."""
        with self._send_lock:
            self.conn = None

    def op_persist(self, msg: Persist) -> None:
        self.submit(self._persist, msg)

    def op_strategy(self, msg: StrategyMessage) -> None:
        if self.handler is None:
            raise RuntimeError(f"engine got {type(msg).__name__} with no strategy handler")
        self.handler.handle(msg)

    # ---- persisting --------------------------------------------------------------------
    def _fault_hook(self, step: int) -> FaultHook:
        """The injected fault (tests) for the writes of a record of `step`, if one applies."""
        fault = self.fault
        if fault is None or fault.phase != "write":
            return _no_fault
        if fault.target == "enospc":
            return self._enospc_hook(fault) if step >= fault.step else _no_fault
        if fault.step != step:
            return _no_fault

        def hook(point: str) -> None:
            if point != "data:written":
                return
            self.fault = None
            if fault.target == "kill-engine":
                os._exit(137)
            conn = self.conn
            self.send(FaultKill())
            deadline = time.time() + 10
            while self.conn is conn and conn is not None and time.time() < deadline:
                time.sleep(0.01)

        return hook

    def _upload_fault(self, step: int) -> FaultHook:
        """The injected engine kill (tests) at a point of the durable upload of `step` or later
        (`kill-engine:step=N:phase=upload:at=part|commit|committed`)."""
        fault = self.fault
        if fault is None or fault.target != "kill-engine" or fault.phase != "upload" or step < fault.step:
            return _no_fault
        return lambda point: os._exit(137) if point == fault.at else None

    def _enospc_hook(self, fault: Fault) -> FaultHook:
        def hook(point: str) -> None:
            with self._pending_lock:
                if point != fault.at or self._enospc_left <= 0:
                    return
                self._enospc_left -= 1
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected at {point})")

        return hook

    def write_record(self, spec: RecordSpec, data: memoryview) -> int:
        """Persist this rank's part of a record and hand it to the committer (rank 0); with
        --replicas, the replicator cuts its copy from `data` while the slot still holds it."""
        def write() -> WrittenPart:
            part = self.store.write_rank(spec.record, self.rank, data, spec.tensors, spec.skeleton, spec.meta,
                                         fault=self._fault_hook(spec.step), threads=self.io_threads)
            if self.replicator is not None:
                self.replicator.written(spec.record, self.rank, part.index, data)
            return part

        return self.record_with(spec, write)

    def record_with(self, spec: RecordSpec, write: Callable[[], int | WrittenPart], since: float | None = None) -> int:
        """Persist this rank's part of record `spec` by `write()` (the bytes written, or the part
        written, which spares reading its index back; it raises AlreadyCommitted, touching
        nothing, when the record is committed already) and hand it to the committer (rank 0). A
        failure is a save error. `since`: when the writing began."""
        t0 = time.time() if since is None else since
        name, step = spec.record, spec.step
        try:
            written = write()
        except AlreadyCommitted:
            # A re-run reaching a step that is committed already (the same state, by exactness):
            # nothing to write, and the committed record is left exactly as it is.
            self.log.emit(type="skip", rank=self.rank, step=step, record=name)
            self.send(Durable(step=step, record=name, nbytes=0, write_s=0.0))
            self.send(Committed(step=step, record=name))
            return 0
        except Exception as e:  # noqa: BLE001 - any failure is a save error: reported, never a hang
            with self._pending_lock:
                self._mark_failed(name, f"rank {self.rank} failed to write it ({e})")
            if self.rank == 0:  # the committer itself: the record goes now
                self.store.abandon(name)
            else:
                self.store.mark_failed(name, self.rank)
                self._on_board(lambda b: b.fail(name, f"rank {self.rank} failed to write it"))
            self.save_error(step, name, f"write: {e}")
            return 0
        if isinstance(written, WrittenPart):
            n, summary = written.nbytes, written.summary
        else:
            n, summary = written, lambda: self.store.part_summary(name, self.rank, spec.layout)
        self.durable(step, name, n, time.time() - t0)
        with self._pending_lock:
            self.pending[name] = spec
        self._on_board(lambda b: b.report(name, self.rank, summary()))
        if self.rank == 0:
            self.commit_ready()
        return n

    def _on_board(self, tell: Callable[[Board], None]) -> None:
        """`tell` the round's board (--node-local-dir) something; a board gone with its round
        (its host, rank 0's worker, died) is logged as a save error: what it said does not commit."""
        if self.board is None:
            return
        try:
            tell(self.board)
        except (RuntimeError, OSError) as e:
            self.log.emit(type="save_error", rank=self.rank, step=-1, record="", error=f"job store: {e}")

    def durable(self, step: int, record: str, nbytes: int, write_s: float) -> None:
        """This rank's part of `record` is on disk: logged, and the worker told."""
        self.log.emit(type="write", rank=self.rank, step=step, bytes=nbytes, write_s=write_s,
                      queue_depth=len(self.inflight))
        self.send(Durable(step=step, record=record, nbytes=nbytes, write_s=write_s))

    def committed(self, step: int, record: str, *, nbytes: int, kind: str, snapshot_time: float | None) -> None:
        """`record` is committed in this rank's --dir: the worker told, and logged by each node's
        first engine (`speaks_for_node`), so that every node's summary counts its own --dir."""
        if not self.store.owned():  # (a region slot committed in the file of a --dir deleted since)
            self.save_error(step, record, f"not committed: {self._lost_dir_error()}")
            return
        self.committed_step = max(self.committed_step or 0, step)
        if self.replicator is not None:
            self.replicator.offer(record, step)
        if self.speaks_for_node:
            self.log.emit(type="commit", step=step, bytes=nbytes, kind=kind, ranks=self.world_size,
                          lag_s=time.time() - (snapshot_time or time.time()))
        self.send(Committed(step=step, record=record))

    @property
    def speaks_for_node(self) -> bool:
        """This engine logs the commits its node's --dir holds: one per node (local rank 0, global
        rank 0's on its node), whose launcher reads only its own node's metrics."""
        return self.local_rank == 0

    def in_memory(self, step: int, nbytes: int) -> None:
        self.send(InMemory(step=step))
        self.publish_memory(step, nbytes)

    def publish_memory(self, step: int, nbytes: int) -> None:
        """`ls` shows the step this rank's engine holds in memory (of its own --dir only)."""
        try:
            self.store.check_owned()
            memory_status.publish(self.store.root, self.rank, step, nbytes)
        except OSError as e:  # only `ls` misses it
            self.log.emit(type="warning", rank=self.rank, error=f"in-memory status: {e}")
        self.holds_memory = True

    def _withdraw_memory(self) -> None:
        """`ls` no longer shows a step this engine holds (a file named by rank alone: in --dir
        only while it is the run's own, never another run's)."""
        if self.holds_memory and self.store.owned():
            memory_status.withdraw(self.store.root, self.rank)
        self.holds_memory = False

    def save_error(self, step: int, record: str, error: str) -> None:
        """Report a failed save to the log and to the worker (dashboard, --on-save-error)."""
        self.log.emit(type="save_error", rank=self.rank, step=step, record=record, error=error)
        self.send(SaveError(step=step, record=record, error=error))

    def _persist(self, msg: Persist) -> None:
        """Write the slot as its record; with `hold` (the memory tier), keep it as the newest
        state in memory (replacing the one held before at once), written only when `write` says
        so, or when a crash-matrix write fault is due at its step (engine/held.py)."""
        write = msg.write or self.write_fault_due(msg.spec.step)
        if msg.hold:
            if self.replicator is not None:  # (the writer thread waits, so the next slot comes later)
                self.replicator.wait_held_shipped(self.step_time.since(msg.spec.meta.get("snapshot_time") or 0.0))
            held, back = self.memory.hold(msg.slot, msg.spec, msg.nbytes, writing=write)
            if held:
                self.in_memory(msg.spec.step, msg.nbytes)
                if self.replicator is not None:
                    self.replicator.offer_held(msg.spec.step)
            self.give_back(back)
        if write:
            try:
                self.write_record(msg.spec, self.slots[msg.slot].view[: msg.nbytes])
            finally:
                self.give_back(self.memory.written(msg.slot) if msg.hold else [msg.slot])
        elif not msg.hold:  # (neither written nor held: nothing keeps the slot)
            self.give_back([msg.slot])

    def give_back(self, slots: list[int]) -> None:
        for slot in slots:
            self.send(SlotFree(slot=slot))

    def write_fault_due(self, step: int) -> bool:
        """Is the crash-matrix fault a write-phase fault at `step` (`EngineContext.write_fault_due`)?"""
        fault = self.fault
        return fault is not None and fault.phase == "write" and fault.step == step

    # ---- committing (global rank 0) ----------------------------------------------------
    def commit_ready(self) -> None:
        """Commit, in step order, every pending record whose ranks and dependencies are durable.

        A record that a rank failed to write, or that depends on one, is abandoned (its
        uncommitted files removed, the worker told); a failed commit is retried with back-off,
        COMMIT_TRIES times, then abandoned the same way."""
        with self._pending_lock:
            todo = sorted(self.pending.values(), key=lambda spec: spec.step)
            committed = {m.name for m in self.store.manifests(warn=False)} if todo else set()
            for spec in todo:
                name = spec.record
                reason = self._failure(name, spec.depends_on)
                if reason:
                    self._abandon(spec, reason)
                    continue
                if any(d not in committed for d in spec.depends_on) or not self._retry_due(name):
                    continue
                parts = self.board.reported(name, self.world_size) if self.board is not None else None
                if self.board is not None and parts is None:
                    continue  # a node's part is not reported yet
                try:
                    m = self.store.try_commit(name, kind=spec.kind, step=spec.step,
                                              first_step=spec.step if spec.first_step is None else spec.first_step,
                                              world_size=self.world_size, depends_on=spec.depends_on or None,
                                              meta=spec.meta, fault=self._fault_hook(spec.step),
                                              layout=spec.layout, parts=parts)
                except (OSError, ValueError) as e:  # ValueError: the schema rejects what a writer sent
                    self._commit_failed(spec, e)
                    continue
                if m is None:
                    continue
                self._on_board(lambda b, m=m: self._announce(b, m))
                del self.pending[name]
                self._retries.pop(name, None)
                committed.add(m.name)
                self.committed(m.step, m.name, nbytes=m.bytes, kind=m.kind,
                               snapshot_time=spec.meta.get("snapshot_time"))
            if todo:
                self.retain()

    def _announce(self, board: Board, m: Manifest) -> None:
        """Rank 0 committed `m` in its own --dir: the other nodes publish it now."""
        board.announce(m.name, json.dumps(m.to_json()).encode())
        board.ack(self.rank, m.step)

    def retain(self) -> None:
        """--keep on this node's --dir, after a commit. With --node-local-dir, only the steps
        every node has committed (and, with --replicas, every engine holds partner copies of)
        count, and the records whose copies this engine holds stay (the other node resumes
        beside them)."""
        if self.keep < 0:
            return
        try:
            upto, held = None, frozenset()
            if self.board is not None:
                upto = self.board.safe_step(self.world_size, replicated=self.replicator is not None)
                held = frozenset(self.replicator.held_records()) if self.replicator is not None else held
            if self.drain:
                self.drain.retain_local(self.keep, protect=held, upto=upto)
            else:
                self.store.prune(self.keep, protect=held, upto=upto)
        except (OSError, RuntimeError) as e:  # retention failing never fails a commit; it runs again next time
            self.log.emit(type="save_error", rank=self.rank, step=-1, record="", error=f"prune: {e}")

    def _failure(self, name: str, depends_on: list[str]) -> str | None:
        """Why record `name` can never commit, if it cannot (caller holds the pending lock)."""
        if name in self.failed:
            return self.failed[name]
        ranks = self.store.failed_ranks(name)
        if ranks:
            return f"rank {ranks[0]} failed to write it"
        if self.board is not None and (reason := self.board.failed(name)):
            return reason
        bad = next((d for d in depends_on if d in self.failed), None)
        return f"it depends on {bad}, which was not saved" if bad else None

    def _mark_failed(self, name: str, reason: str) -> None:
        """Remember that `name` will never commit (its dependents are abandoned too); only the
        newest FAILED_KEPT, since a dependent is always recent (bounded memory in a long run)."""
        self.failed[name] = reason
        while len(self.failed) > FAILED_KEPT:
            del self.failed[next(iter(self.failed))]

    def _abandon(self, spec: RecordSpec, reason: str) -> None:
        name = spec.record
        self._mark_failed(name, reason)
        del self.pending[name]
        self._retries.pop(name, None)
        self.store.abandon(name)
        self._on_board(lambda b: b.fail(name, reason))
        self.save_error(spec.step, name, f"not committed: {reason}")

    def _retry_due(self, name: str) -> bool:
        return time.monotonic() >= self._retries.get(name, (0, 0.0))[1]

    def _commit_failed(self, spec: RecordSpec, err: Exception) -> None:
        name = spec.record
        tries = self._retries.get(name, (0, 0.0))[0] + 1
        self.log.emit(type="commit_retry", rank=self.rank, step=spec.step, record=name, tries=tries,
                      error=str(err))
        if tries >= COMMIT_TRIES:
            self._abandon(spec, f"commit failed {tries} times ({err})")
            return
        delay = COMMIT_BACKOFF_S * 2 ** (tries - 1)
        self._retries[name] = (tries, time.monotonic() + delay)
        self.save_error(spec.step, name, f"commit failed ({err}); retrying in {delay:.1f} s "
                                           f"(try {tries} of {COMMIT_TRIES})")

    def watch_commits(self) -> None:
        """Other ranks: tell the worker (and the node's metrics) when rank 0 has committed a
        record we wrote."""
        if self.board is not None:
            self._adopt_commits()
        with self._pending_lock:
            done = [spec for name, spec in self.pending.items() if self.store.is_committed(name)]
            gone = [name for name in self.pending if not (self.store.root / name).exists()]  # pruned/abandoned
            for name in [spec.record for spec in done] + gone:
                del self.pending[name]
        for spec in sorted(done, key=lambda spec: spec.step):
            nbytes = self._record_bytes(spec.record) if self.speaks_for_node else 0
            self.committed(spec.step, spec.record, nbytes=nbytes, kind=spec.kind,
                           snapshot_time=spec.meta.get("snapshot_time"))

    def _record_bytes(self, name: str) -> int:
        """The bytes committed record `name` holds, every rank's (its manifest's count; 0 unread)."""
        try:
            return self.store.manifest(name).bytes
        except (OSError, CorruptCheckpoint):
            return 0

    def _adopt_commits(self) -> None:
        """--node-local-dir, other ranks: publish in this node's --dir the manifest rank 0
        announced for each pending record (it pins the part written here), then acknowledge the
        newest; a record rank 0 gave up goes here too. Retention on this node follows (its
        local rank 0's engine)."""
        board, newest = self.board, None
        with self._pending_lock:
            for name, spec in sorted(self.pending.items(), key=lambda kv: kv[1].step):
                try:
                    raw = board.announced(name)
                    if raw is None:
                        if reason := board.failed(name):
                            self.store.abandon(name)
                            del self.pending[name]
                            self.save_error(spec.step, name, f"not committed: {reason}")
                        continue
                    newest = self.store.adopt_manifest(name, raw, [self.rank]).step
                except CorruptCheckpoint as e:  # never: rank 0 commits what this engine reported
                    self.store.abandon(name)
                    del self.pending[name]
                    self.save_error(spec.step, name, f"not committed here: {e}")
                except OSError:
                    continue  # its part is gone here (swept, set aside): `watch_commits` drops it
        if newest is not None:
            self._on_board(lambda b: b.ack(self.rank, newest))
            if self.local_rank == 0:
                self.retain()

    def commit_loop(self) -> None:
        """Retry pending commits that wait on other ranks' files or on a back-off (rank 0), or
        watch for them (other ranks); give freed heap pages back when the RSS grew (arena.py)."""
        trimmer = HeapTrimmer()
        while not self.stopping.wait(0.05):
            self._watch_dir()
            if trimmed := trimmer.maybe_trim():  # the metrics say when and what it gave back
                self.log.emit(type="heap_trim", rank=self.rank, rss_before=trimmed[0], rss_after=trimmed[1])
            if self.handler is not None and self.store is not None:
                try:
                    self.handler.tick()
                except Exception:  # noqa: BLE001 - a handler's bug must not stop commits
                    traceback.print_exc()
            if self.pending and self.store is not None:
                try:
                    self.commit_ready() if self.rank == 0 else self.watch_commits()
                except OSError as e:
                    self.log.emit(type="save_error", rank=self.rank, step=-1, record="", error=f"commit: {e}")

    def _watch_dir(self) -> None:
        """Say once, in one line (the node's first engine), that --dir is no longer the directory
        the run locked; every write, commit and retention there fails from then on (Store)."""
        if self.dir_lost or self.store is None or self.store.owned():
            return
        self.dir_lost = True
        if self.speaks_for_node:
            log.error(f"{self._lost_dir_error()}: this run writes nothing more there, and each save fails from now "
                      "on (--on-save-error=fail stops it); start it again to checkpoint where --dir points")

    def _lost_dir_error(self) -> str:
        """What is wrong with --dir (`Claim.problem`), once it is no longer the run's."""
        return self.store.claim.problem() or f"checkpoint directory {self.store.root} is no longer this run's"

    def settle(self, timeout: float) -> None:
        """Rank 0 at shutdown: commit what can be committed, waiting out retry back-offs."""
        deadline = time.monotonic() + timeout
        self.commit_ready()
        while self._retries and time.monotonic() < deadline:
            time.sleep(COMMIT_BACKOFF_S)
            self.commit_ready()

    def close(self) -> None:
        self.flush()
        if self.store is not None:
            self._withdraw_memory()
        if self.store is not None and self.rank == 0:
            self.settle(timeout=COMMIT_BACKOFF_S * 2 ** COMMIT_TRIES)
        elif self.store is not None and self.board is None and self.pending:
            self.watch_commits()  # a last look: what rank 0 committed since, its node's metrics count
        if self.drain is not None:
            self.drain.close()
        if self.replicator is not None:
            self.replicator.close()
        for s in self.slots.values():
            s.close()
        if self.pool:
            self.pool.shutdown()


class ServerContext(EngineContext):
    """The engine as its handler sees it (`EngineContext`: the call order is documented there)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def read_slot(self, slot: int, start: int, stop: int) -> bytes:
        return bytes(self._engine.slots[slot].view[start:stop])

    def slot_view(self, slot: int) -> memoryview:
        return self._engine.slots[slot].view

    @property
    def root(self) -> str:
        return str(self._engine.store.root)

    @property
    def rank(self) -> int:
        return self._engine.rank

    @property
    def world_size(self) -> int:
        return self._engine.world_size

    @property
    def keep(self) -> int:
        return self._engine.keep

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        self._engine.submit(fn, *args)

    def write_with(self, spec: RecordSpec, write: Callable[[], int], since: float | None = None) -> int:
        return self._engine.record_with(spec, write, since)

    @property
    def store(self) -> Store:
        return self._engine.store

    def write_now(self, spec: RecordSpec, data: memoryview) -> int:
        return self._engine.write_record(spec, data)

    def fault_hook(self, step: int) -> FaultHook:
        return self._engine._fault_hook(step)

    def durable(self, step: int, record: str, nbytes: int, write_s: float) -> None:
        self._engine.durable(step, record, nbytes, write_s)

    def committed(self, step: int, record: str, nbytes: int = 0, snapshot_time: float | None = None) -> None:
        self._engine.committed(step, record, nbytes=nbytes, kind="full", snapshot_time=snapshot_time)

    def save_error(self, step: int, record: str, error: str) -> None:
        self._engine.save_error(step, record, error)

    def in_memory(self, step: int, nbytes: int) -> None:
        self._engine.in_memory(step, nbytes)

    def shared_file(self, name: str) -> Path:
        return staging_path(self._engine.tag, self._engine.local_rank, name)

    @property
    def replicas(self) -> Replicator | None:
        return self._engine.replicator

    def write_fault_due(self, step: int) -> bool:
        return self._engine.write_fault_due(step)

    def free_slot(self, slot: int) -> None:
        self._engine.send(SlotFree(slot=slot))

    def wait_writes(self, limit: int) -> None:
        self._engine.wait_jobs(fewer_than=limit)

    def write(self, spec: RecordSpec, data: memoryview) -> Future:
        return self._engine.submit(self._engine.write_record, spec, data)

    def reply(self, request: Message, **body: Any) -> None:
        self._engine.reply(request, **body)

    def emit(self, **event: Any) -> None:
        self._engine.log.emit(**event)


class HeldSlots:
    """The steps a snapshot strategy's engine holds in its staging slots, as the replicator reads
    them (to copy them to partners, or to make a partner's copy whole) and refills them (a
    replaced node's engine, from a partner's copy): `replicate.HeldMemory`."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def held_steps(self) -> list[int]:
        return [step for step, _ in self._engine.memory.held()]

    @contextlib.contextmanager
    def pinned(self, step: int) -> Iterator[tuple[RecordSpec, memoryview] | None]:
        """The spec and bytes of `step`, if held; its slot goes back to the worker (if replaced
        meanwhile) only once this is done with it."""
        e = self._engine
        got = e.memory.pin(step)
        if got is None:
            yield None
            return
        slot, spec, nbytes = got
        view = e.slots[slot].view[:nbytes]
        try:
            yield spec, view
        finally:
            view.release()
            e.give_back(e.memory.unpin(slot))

    def install(self, spec: RecordSpec, data: bytes | bytearray) -> None:
        """Hold `data`, the state of `spec` a partner gave back, in a new staging slot (before the
        worker's Hello is answered: the reply hands it over, in use)."""
        e = self._engine
        (i,) = e.new_slots(1, align(len(data)))
        e.slots[i].view[: len(data)] = data
        _, back = e.memory.hold(i, spec, len(data))
        e.give_back(back)  # (none: it asked, holding no step)
        e.publish_memory(spec.step, len(data))


def _import_all(modules: tuple[str, ...]) -> None:
    """Best effort, each on its own: a module that fails here fails again, and is reported,
    where it is used; the others are still imported ahead."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001
            continue


def main(address: str, authkey: bytes, local_rank: int, tag: str, metrics_dir: str | None,
         engines_lock: str, owner_pid: int | None = None, pdeathsig: bool = False,
         preload: tuple[str, ...] = ()) -> None:
    """Engine process entry point: serve one worker connection after another until shutdown, or
    until the launcher `owner_pid` dies (then without its staging files).

    Signals meant for the training (Ctrl-C on the terminal's process group, a scheduler's
    SIGTERM to the whole job) are the launcher's to handle: it shuts the engines down after the
    workers have handed over their last step, so the engine ignores them. It holds its share of
    the directory lock for as long as it lives. One malloc arena, set before any thread starts
    (`arena.py`: per-thread arenas kept freed blocks, and the engine's RSS rose over a run).

    `preload`: the modules the worker's Hello will make the engine import (its strategy's
    handler; torch.distributed to meet the round with --replicas or --node-local-dir), imported
    on a thread of their own from the start, beside the worker's own imports: a handler that
    imports torch otherwise kept a new worker waiting for its Hello 1.7 s here (every run's
    start, and a replaced node's recovery)."""
    one_arena()
    if preload:
        threading.Thread(target=_import_all, args=(preload,), daemon=True, name="ckptrun-preload").start()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if owner_pid is not None:
        exit_with_owner(owner_pid, lambda: remove_staging(tag, local_rank), pdeathsig=pdeathsig,
                        name=f"checkpoint engine of local rank {local_rank}")
    claim = hold_for_engine(engines_lock)
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    engine = Engine(local_rank, tag, metrics_dir, claim)
    threading.Thread(target=engine.commit_loop, daemon=True).start()
    try:
        while not engine.stopping.is_set():
            engine.serve(listener.accept())
    finally:
        engine.close()
        listener.close()
