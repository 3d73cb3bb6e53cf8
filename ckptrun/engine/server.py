"""The checkpoint-engine process: one per local rank, started by the launcher (spawn).

It owns the staging slots and the writers, so it outlives a crashed worker: whatever was handed
to it is still made durable, and the restarted worker reconnects and is answered only after the
engine has flushed (DESIGN §2). On global rank 0 it also commits records once every rank's
files are durable, and prunes old ones. It imports no torch on the plain persist path.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

from ..faults import Fault
from ..leftovers import exit_with_owner, remove_staging, staging_path
from ..staging import EngineSlot
from ..store import Store, rank_files
from .handlers import engine_handler


class EventLog:
    """Engine-side metrics (`engine-<local_rank>.jsonl`), one JSON object per line."""

    def __init__(self, metrics_dir: str | None, local_rank: int) -> None:
        self._f = None
        if metrics_dir:
            Path(metrics_dir).mkdir(parents=True, exist_ok=True)
            self._f = open(Path(metrics_dir) / f"engine-{local_rank}.jsonl", "a", buffering=1)
        self._lock = threading.Lock()

    def emit(self, **event: Any) -> None:
        if self._f:
            with self._lock:
                self._f.write(json.dumps({"t": time.time(), **event}) + "\n")


class Engine:
    def __init__(self, local_rank: int, tag: str, metrics_dir: str | None) -> None:
        self.local_rank, self.tag = local_rank, tag
        self.log = EventLog(metrics_dir, local_rank)
        self.conn: Connection | None = None
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
        self.pending: dict[str, dict] = {}
        self._pending_lock = threading.Lock()
        self.committed_step: int | None = None
        self.stopping = threading.Event()
        self.log.emit(type="engine", local_rank=local_rank, pid=os.getpid())

    # ---- plumbing ----------------------------------------------------------------------
    def send(self, msg: dict) -> None:
        """Send an event to the connected worker; a gone worker is not an error."""
        with self._send_lock:
            if self.conn is None:
                return
            try:
                self.conn.send(msg)
            except (OSError, EOFError, ValueError):
                self.conn = None

    def reply(self, req: dict, **fields: Any) -> None:
        self.send({"op": "reply", "id": req["id"], **fields})

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

    def flush(self) -> None:
        if self.handler is not None:
            self.handler.flush()
        while True:
            with self._inflight_lock:
                futs = list(self.inflight)
            if not futs:
                return
            for f in futs:
                f.exception()

    # ---- messages ----------------------------------------------------------------------
    def serve(self, conn: Connection) -> None:
        self.conn = conn
        while not self.stopping.is_set():
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            op = msg.get("op")
            if op == "shutdown":
                self.stopping.set()
                break
            getattr(self, f"op_{op}", self.op_strategy)(msg)
        with self._send_lock:
            self.conn = None
        conn.close()

    def op_hello(self, msg: dict) -> None:
        self.flush()
        self.rank, self.world_size, self.keep = msg["rank"], msg["world_size"], msg["keep"]
        self.store = Store(msg["dir"])
        self.fault = Fault.parse(msg["fault"]) if msg.get("fault") else None
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max(1, msg.get("writers", 2)), thread_name_prefix="writer")
        self.io_threads = max(1, msg.get("io_threads", 1))
        if self.strategy != msg["strategy"]:  # a restarted worker keeps what the handler holds
            self.strategy, self.handler = msg["strategy"], engine_handler(msg["strategy"], self)
        newest = max((s.nbytes for s in self.slots.values()), default=0)
        for i in [i for i, s in self.slots.items() if s.nbytes < newest]:
            self.slots.pop(i).close()
        self.reply(msg, pid=os.getpid(), slots=self._slot_list(sorted(self.slots)),
                   committed_step=self.committed_step)

    def op_alloc(self, msg: dict) -> None:
        """Add a generation of staging slots; the worker retires the old ones as they free up."""
        first = max(self.slots, default=-1) + 1
        for i in range(first, first + msg["nslots"]):
            self.slots[i] = EngineSlot(staging_path(self.tag, self.local_rank, i), msg["nbytes"])
        self.reply(msg, slots=self._slot_list(range(first, first + msg["nslots"])))

    def op_retire(self, msg: dict) -> None:
        for i in msg["slots"]:
            slot = self.slots.pop(i, None)
            if slot is not None:
                slot.close()

    def _slot_list(self, indices) -> list[tuple[int, str, int]]:
        return [(i, str(self.slots[i].path), self.slots[i].nbytes) for i in indices]

    def op_flush(self, msg: dict) -> None:
        self.flush()
        self.reply(msg)

    def op_commit_pending(self, msg: dict) -> None:
        self.flush()
        self.commit_ready()
        self.reply(msg, committed_step=self.committed_step)

    def op_bye(self, msg: dict) -> None:
        """A worker's clean goodbye; its writes go on as queued."""

    def op_persist(self, msg: dict) -> None:
        self.submit(self._persist, msg)

    def op_strategy(self, msg: dict) -> None:
        if self.handler is None:
            raise RuntimeError(f"engine got {msg.get('op')!r} with no strategy handler")
        self.handler.handle(msg)

    # ---- persisting --------------------------------------------------------------------
    def _fault_hook(self, step: int):
        fault = self.fault
        if fault is None or fault.step != step or fault.phase != "write":
            return lambda point: None

        def hook(point: str) -> None:
            if point != "data:written":
                return
            self.fault = None
            if fault.target == "kill-engine":
                os._exit(137)
            conn = self.conn
            self.send({"op": "fault_kill"})
            deadline = time.time() + 10
            while self.conn is conn and conn is not None and time.time() < deadline:
                time.sleep(0.01)

        return hook

    def write_record(self, msg: dict, data: memoryview) -> int:
        """Persist this rank's part of a record and hand it to the committer (rank 0)."""
        t0 = time.time()
        try:
            n = self.store.write_rank(msg["record"], self.rank, data, msg["tensors"], msg["skeleton"],
                                      msg["meta"], fault=self._fault_hook(msg["step"]),
                                      threads=self.io_threads)
        except OSError as e:
            self._discard_rank_files(msg["record"])
            self.log.emit(type="save_error", rank=self.rank, step=msg["step"], error=str(e))
            self.send({"op": "save_error", "step": msg["step"], "record": msg["record"], "error": str(e)})
            return 0
        write_s = time.time() - t0
        self.log.emit(type="write", rank=self.rank, step=msg["step"], bytes=n, write_s=write_s,
                      queue_depth=len(self.inflight))
        self.send({"op": "durable", "step": msg["step"], "record": msg["record"], "bytes": n,
                   "write_s": write_s})
        with self._pending_lock:
            self.pending[msg["record"]] = msg
        if self.rank == 0:
            self.commit_ready()
        return n

    def _persist(self, msg: dict) -> None:
        slot = msg["slot"]
        try:
            self.write_record(msg, self.slots[slot].view[: msg["nbytes"]])
        finally:
            self.send({"op": "slot_free", "slot": slot})

    def _discard_rank_files(self, record: str) -> None:
        for f in rank_files(self.rank):
            (self.store.root / record / f).unlink(missing_ok=True)

    # ---- committing (global rank 0) ----------------------------------------------------
    def commit_ready(self) -> None:
        """Commit, in step order, every pending record whose ranks and dependencies are durable."""
        with self._pending_lock:
            todo = sorted(self.pending.values(), key=lambda m: m["step"])
            committed = {m.name for m in self.store.manifests(warn=False)} if todo else set()
            for msg in todo:
                if any(d not in committed for d in msg.get("depends_on", [])):
                    continue
                m = self.store.try_commit(msg["record"], kind=msg["kind"], step=msg["step"],
                                          first_step=msg.get("first_step", msg["step"]),
                                          world_size=self.world_size, depends_on=msg.get("depends_on"),
                                          meta=msg["meta"])
                if m is None:
                    continue
                del self.pending[msg["record"]]
                committed.add(m.name)
                self.committed_step = max(self.committed_step or 0, m.step)
                self.log.emit(type="commit", step=m.step, bytes=m.bytes, kind=m.kind, ranks=m.world_size,
                              lag_s=time.time() - msg["meta"].get("snapshot_time", time.time()))
                self.send({"op": "committed", "step": m.step, "record": m.name})
            if todo and self.keep >= 0:
                self.store.prune(self.keep)

    def watch_commits(self) -> None:
        """Other ranks: tell the worker when rank 0 has committed a record we wrote."""
        with self._pending_lock:
            done = [m for name, m in self.pending.items() if (self.store.root / name / "MANIFEST.json").exists()]
            gone = [name for name in self.pending if not (self.store.root / name).exists()]  # pruned already
            for name in [m["record"] for m in done] + gone:
                del self.pending[name]
        for m in sorted(done, key=lambda m: m["step"]):
            self.send({"op": "committed", "step": m["step"], "record": m["record"]})

    def commit_loop(self) -> None:
        """Retry pending commits that wait on other ranks' files (rank 0), or watch for them."""
        while not self.stopping.wait(0.05):
            if self.pending and self.store is not None:
                try:
                    self.commit_ready() if self.rank == 0 else self.watch_commits()
                except OSError as e:
                    self.log.emit(type="save_error", rank=self.rank, step=-1, error=f"commit: {e}")

    def close(self) -> None:
        self.flush()
        if self.store is not None and self.rank == 0:
            self.commit_ready()
        for s in self.slots.values():
            s.close()
        if self.pool:
            self.pool.shutdown()


def main(address: str, authkey: bytes, local_rank: int, tag: str, metrics_dir: str | None,
         owner_pid: int | None = None, pdeathsig: bool = False) -> None:
    """Engine process entry point: serve one worker connection after another until shutdown, or
    until the launcher `owner_pid` dies (then without its staging files)."""
    if owner_pid is not None:
        exit_with_owner(owner_pid, lambda: remove_staging(tag, local_rank), pdeathsig=pdeathsig,
                        name=f"checkpoint engine of local rank {local_rank}")
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    engine = Engine(local_rank, tag, metrics_dir)
    threading.Thread(target=engine.commit_loop, daemon=True).start()
    try:
        while not engine.stopping.is_set():
            engine.serve(listener.accept())
    finally:
        engine.close()
        listener.close()
