"""The checkpoint-engine process: one per local rank, started by the launcher (spawn).

It owns the staging slots and the writers, so it outlives a crashed worker: whatever was handed
to it is still made durable, and the restarted worker reconnects and is answered only after the
engine has flushed (DESIGN §2). On global rank 0 it also commits records once every rank's
files are durable, and prunes old ones; with --node-local-dir the ranks' parts are in their own
nodes' --dir and the commit goes through the job store (nodecommit.py). It imports no torch on
the plain persist path.

This module holds the connection loop and the dispatch of the worker's messages (`Engine`), the
handler's view of the engine (`ServerContext`) and the process's entry point (`main`). The
engine's jobs are parts of their own, which `Engine` makes and wires: what they share
(engine_state.py), the link to the worker (worker_link.py), the staging slots
(staging_slots.py), the writer threads (writers.py), a Persist and the memory tier
(persist.py), the commit path (commit_path.py), retention (retention.py), the round's board
(board_link.py) and the tests' faults (faults.py).
"""

from __future__ import annotations

import importlib
import os
import signal
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..faults import Fault
from ..ipc.messages import (
    Alloc,
    FetchHeld,
    Hello,
    Message,
    Persist,
    RecordSpec,
    Retire,
    Shutdown,
    StrategyMessage,
)
from ..log import log
from ..storage import iowriter
from ..storage.dirlock import Claim, hold_for_engine
from ..storage.fsutil import FaultHook
from ..storage.leftovers import exit_with_owner, remove_staging, staging_path
from ..storage.store import Store
from . import drain
from .arena import HeapTrimmer, one_arena
from .board_link import BoardLink
from .commit_path import COMMIT_BACKOFF_S, COMMIT_TRIES, CommitPath
from .engine_state import EngineState
from .handlers import EngineContext, EngineHandler, engine_handler
from .persist import HeldSlots, Persister
from .staging_slots import StagingSlots
from .writers import Writers

if TYPE_CHECKING:
    from .handlers import Replicas
    from .held_copies import HeldCopy


class Engine:
    """One local rank's engine: it serves one worker connection after another, each message by
    its `op_*` method, and runs the commit loop; its parts do the work (module docstring)."""

    def __init__(self, local_rank: int, tag: str, metrics_dir: str | None, claim: Claim | None = None) -> None:
        self.state = state = EngineState(local_rank, tag, metrics_dir, claim)
        self.serving: Connection | None = None  # the connection `serve` reads
        self.dir_lost = False  # said once: --dir is no longer the directory the run locked
        self.io_engine: str | None = None  # the file writer running (storage/iowriter.py)
        self.writers = Writers()
        self.slots = StagingSlots(tag, local_rank, state.link)
        self.board_link = BoardLink(state)
        self.commits = CommitPath(state, self.board_link, lambda: len(self.writers.inflight))
        self.persister = Persister(state, self.slots, self.commits)
        self.handler: EngineHandler | None = None
        self.strategy: str | None = None
        self.stopping = threading.Event()
        state.log.emit(type="engine", local_rank=local_rank, pid=os.getpid())

    def flush(self, restart: bool = False) -> None:
        """Wait until every job has ended; `restart`: a new worker replaces a dead one, whose
        jobs the handler may give up (`EngineHandler.restart`)."""
        if self.handler is not None:
            (self.handler.restart if restart else self.handler.flush)()
        self.writers.wait(fewer_than=1)

    # ---- the connection loop -------------------------------------------------------------
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
        self.state.link.detach()
        conn.close()

    def op_hello(self, msg: Hello) -> None:
        # Events of the old worker's jobs ending here (a staging slot freed, a step durable) are
        # not the new worker's, so it hears events only from here on: it gets every slot in the
        # reply, and a SlotFree before it would hand out a slot twice, or one this Hello drops.
        state, memory = self.state, self.persister.memory
        adopt = msg.rank != state.rank and msg.strategy == self.strategy and state.replicator is not None
        given_up = self._give_up_handler(adopt) if self.handler is not None and msg.rank != state.rank else []
        self.flush(restart=True)
        if msg.rank != state.rank or msg.strategy != self.strategy:  # what is held is another worker's
            if adopt:  # (the node that has its old rank now may take it back from here)
                state.replicator.returns.adopt(state.rank, HeldSlots(self.persister), given_up)
            memory.drop()
        memory.keep = 1 if msg.replication is None else 2
        self.persister.step_time.reset()
        state.link.attach(self.serving)
        state.rank, state.world_size, state.keep = msg.rank, msg.world_size, msg.keep
        state.store = Store(msg.dir, claim=state.claim)
        state.faults.set(Fault.parse(msg.fault) if msg.fault else None)
        if state.drain is None:
            state.drain = drain.from_config(state.store, state.log, state.faults.upload_hook, state.rank)
        else:  # the worker may have come back as another rank
            state.drain.rank = state.rank
        self.writers.start(msg.writers)
        state.io_threads = max(1, msg.io_threads)
        if (io_engine := iowriter.select(msg.io_engine)) != self.io_engine:  # said once
            self.io_engine = io_engine
            state.log.emit(type="io_engine", rank=msg.rank, engine=io_engine)
        if self.strategy != msg.strategy:  # a restarted worker keeps what the handler holds
            self.strategy, self.handler = msg.strategy, engine_handler(msg.engine_handler, ServerContext(self))
            self.handler.restart()  # what an earlier engine (a replaced node's) left uncommitted goes too
        self.board_link.join(msg.node_local, self.commits.forget_pending)
        if state.drain is not None:
            state.drain.board = state.board
        if msg.replication is not None:
            self._replicate(msg)
        self.slots.keep_newest(memory.holds)
        # The slot held in memory goes to the worker too, in use: the engine gives it back once
        # a newer step replaces it (the restarted worker may resume from it first).
        held = [i for i in self.slots.slots if memory.holds(i)]
        state.link.reply(msg, pid=os.getpid(), slots=self.slots.listed(sorted(self.slots.slots)), busy=held,
                         committed_step=state.committed_step)

    def _replicate(self, msg: Hello) -> None:
        """Meet the partners' engines of this rendezvous round (before the worker is answered: a
        replaced node's parts come back first). torch is needed only here, only with --replicas
        (imported from the engine's start: `main`'s `preload`)."""
        from .replicate import Replicator

        state = self.state
        if state.replicator is None:
            state.replicator = Replicator(state.log)
            state.replicator.holder.on_held = lambda step: self.board_link.tell(lambda b: b.hold(state.rank, step))
        memory, copies = self.handler.replication() or (HeldSlots(self.persister), None)
        state.replicator.join(msg.replication, msg.rank, msg.world_size, state.store, state.faults.fault,
                              node_local=msg.node_local is not None, memory=memory, copies=copies)

    def _give_up_handler(self, adopt: bool) -> list[HeldCopy]:
        """The worker came back as another rank: the handler's state is its old rank's, which the
        engine of the node now holding that rank adopts. Its jobs end, it lets go of that state
        (`EngineHandler.close`), and the Hello (whose flush waits for the old worker's writes,
        still under the old rank) makes a new one for the new rank. With `adopt` (--replicas),
        what it held is cut first for the next round (`EngineHandler.give_up`), and returned."""
        state, given_up = self.state, []
        if adopt:
            try:
                given_up = self.handler.give_up(state.rank)
            except Exception as e:  # noqa: BLE001 - let go of unkept: the ranks resume from the records
                log.warning(f"rank {state.rank}: what the engine held of this rank is not kept for the node that has "
                            f"it now ({type(e).__name__}: {e}); it resumes from --dir")
        self.handler.close()
        self.strategy, self.handler = None, None
        self.persister.withdraw()
        state.log.emit(type="rank_changed", rank=state.rank)
        return given_up

    def op_alloc(self, msg: Alloc) -> None:
        """Add a generation of staging slots; the worker retires the old ones as they free up."""
        self.state.link.reply(msg, slots=self.slots.listed(self.slots.new(msg.nslots, msg.nbytes)))

    def op_retire(self, msg: Retire) -> None:
        self.slots.retire(msg.slots)

    def op_flush(self, msg: Message) -> None:
        self.flush()
        self.state.link.reply(msg)

    def op_commit_pending(self, msg: Message) -> None:
        state, commits = self.state, self.commits
        self.flush()
        # (on a node-local --dir only rank 0 commits; the others publish what it committed)
        commits.commit_ready() if state.rank == 0 or state.board is None else commits.watch_commits()
        state.link.reply(msg, committed_step=state.committed_step, held=self._held(), pending=len(commits.pending))

    def _held(self) -> list[tuple[int, int]]:
        """(step, bytes) of each state held in memory, newest first: the handler's (a replica),
        else a snapshot strategy's slots."""
        return (self.handler.held() if self.handler is not None else []) or self.persister.memory.held()

    def op_fetch_held(self, msg: FetchHeld) -> None:
        """A restarted worker resumes from the state held in memory (no disk read)."""
        link = self.state.link
        try:
            if self.handler is not None and self.handler.held():
                link.reply(msg, **self.handler.fetch(msg.step))
            else:
                link.reply(msg, **self.persister.memory.fetch(msg.step, lambda slot: self.slots.slots[slot].path))
        except Exception as e:  # any failure: the worker falls back to the committed records
            link.reply(msg, error=f"{type(e).__name__}: {e}")

    def op_bye(self, msg: Message) -> None:
        """A worker's clean goodbye; its writes go on as queued, and events about them (a late
        commit, a step moved out of a region) are no longer sent: the worker is closing."""
        self.state.link.detach()

    def op_persist(self, msg: Persist) -> None:
        self.writers.submit(self.persister.persist, msg)

    def op_strategy(self, msg: StrategyMessage) -> None:
        if self.handler is None:
            raise RuntimeError(f"engine got {type(msg).__name__} with no strategy handler")
        self.handler.handle(msg)

    # ---- the commit loop -----------------------------------------------------------------
    def commit_loop(self) -> None:
        """Retry pending commits that wait on other ranks' files or on a back-off (rank 0), or
        watch for them (other ranks); give freed heap pages back when the RSS grew (arena.py)."""
        state, commits = self.state, self.commits
        trimmer = HeapTrimmer()
        while not self.stopping.wait(0.05):
            self._watch_dir()
            if trimmed := trimmer.maybe_trim():  # the metrics say when and what it gave back
                state.log.emit(type="heap_trim", rank=state.rank, rss_before=trimmed[0], rss_after=trimmed[1])
            if self.handler is not None and state.store is not None:
                try:
                    self.handler.tick()
                except Exception:  # noqa: BLE001 - a handler's bug must not stop commits
                    traceback.print_exc()
            if commits.pending and state.store is not None:
                try:
                    commits.commit_ready() if state.rank == 0 else commits.watch_commits()
                except OSError as e:
                    state.log.emit(type="save_error", rank=state.rank, step=-1, record="", error=f"commit: {e}")

    def _watch_dir(self) -> None:
        """Say once, in one line (the node's first engine), that --dir is no longer the directory
        the run locked; every write, commit and retention there fails from then on (Store)."""
        state = self.state
        if self.dir_lost or state.store is None or state.store.owned():
            return
        self.dir_lost = True
        if state.speaks_for_node:
            log.error(f"{state.lost_dir_error()}: this run writes nothing more there, and each save fails from now "
                      "on (--on-save-error=fail stops it); start it again to checkpoint where --dir points")

    def close(self) -> None:
        state = self.state
        self.flush()
        if state.store is not None:
            self.persister.withdraw()
        if state.store is not None and state.rank == 0:
            self.commits.settle(timeout=COMMIT_BACKOFF_S * 2 ** COMMIT_TRIES)
        elif state.store is not None and state.board is None and self.commits.pending:
            self.commits.watch_commits()  # a last look: what rank 0 committed since, its node's metrics count
        if state.drain is not None:
            state.drain.close()
        if state.replicator is not None:
            state.replicator.close()
        self.slots.close()
        self.writers.shutdown()


class ServerContext(EngineContext):
    """The engine as its handler sees it (`EngineContext`: the call order is documented there)."""

    def __init__(self, engine: Engine) -> None:
        self._engine, self._state = engine, engine.state

    def read_slot(self, slot: int, start: int, stop: int) -> bytes:
        return bytes(self._engine.slots.view(slot)[start:stop])

    def slot_view(self, slot: int) -> memoryview:
        return self._engine.slots.view(slot)

    @property
    def root(self) -> str:
        return str(self._state.store.root)

    @property
    def rank(self) -> int:
        return self._state.rank

    @property
    def world_size(self) -> int:
        return self._state.world_size

    @property
    def keep(self) -> int:
        return self._state.keep

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        self._engine.writers.submit(fn, *args)

    def write_with(self, spec: RecordSpec, write: Callable[[], int], since: float | None = None) -> int:
        return self._engine.commits.record_with(spec, write, since)

    @property
    def store(self) -> Store:
        return self._state.store

    def write_now(self, spec: RecordSpec, data: memoryview) -> int:
        return self._engine.commits.write_part(spec, data)

    def fault_hook(self, step: int) -> FaultHook:
        return self._state.faults.write_hook(step)

    def durable(self, step: int, record: str, nbytes: int, write_s: float) -> None:
        self._engine.commits.durable(step, record, nbytes, write_s)

    def committed(self, step: int, record: str, nbytes: int = 0, snapshot_time: float | None = None) -> None:
        self._engine.commits.committed(step, record, nbytes=nbytes, kind="full", snapshot_time=snapshot_time)

    def save_error(self, step: int, record: str, error: str) -> None:
        self._state.save_error(step, record, error)

    def in_memory(self, step: int, nbytes: int) -> None:
        self._engine.persister.in_memory(step, nbytes)

    def shared_file(self, name: str) -> Path:
        return staging_path(self._state.tag, self._state.local_rank, name)

    @property
    def replicas(self) -> Replicas | None:
        replicator = self._state.replicator
        return replicator.shipper if replicator is not None else None

    def write_fault_due(self, step: int) -> bool:
        return self._state.faults.write_due(step)

    def free_slot(self, slot: int) -> None:
        self._engine.slots.give_back([slot])

    def wait_writes(self, limit: int) -> None:
        self._engine.writers.wait(fewer_than=limit)

    def write(self, spec: RecordSpec, data: memoryview) -> Future:
        return self._engine.writers.submit(self._engine.commits.write_part, spec, data)

    def reply(self, request: Message, **body: Any) -> None:
        self._state.link.reply(request, **body)

    def emit(self, **event: Any) -> None:
        self._state.log.emit(**event)


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
