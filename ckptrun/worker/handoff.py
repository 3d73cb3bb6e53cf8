"""Hand-off: a captured snapshot sealed and given to the engine, and what the engine says back.

Runs at the next step's start or at the end (`seal` adds the state that settled after step t,
then `submit` sends the slot), at the script's end (`drain`), and on the engine-event thread
(`on_event`: slots coming back, steps durable or failed, the connection lost). A `sync`-like
submit waits here until its step is durable; the other waits (a free slot) are in
ckptrun/worker/slots.py.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from .. import faults
from ..config import RunConfig
from ..errors import CkptrunError
from ..faults import Fault
from ..ipc.client import EngineClient, EngineLost
from ..ipc.messages import (
    Committed,
    ConnectionLost,
    Durable,
    FaultKill,
    Flush,
    InMemory,
    Message,
    Persist,
    RecordSpec,
    SaveError,
    SlotFree,
)
from ..log import log
from ..storage.store import full_name
from ..storage.tree import flatten
from .capture import Capture, Snapshot
from .decisions import Retuner
from .metrics import WorkerMetrics
from .state import TrainingState


class Handoff:
    """Seals `capture`'s snapshots with `state`'s late state (`attach`) and hands them to the
    engine over `client`; `retuner` hears of every snapshot handed over and every write made
    durable."""

    def __init__(self, cfg: RunConfig, rank: int, world_size: int, metrics: WorkerMetrics, retuner: Retuner,
                 fault: Fault | None) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.client: EngineClient  # set once connected (the connection's events come to `on_event`)
        self.metrics, self.retuner, self.fault = metrics, retuner, fault
        self.lost = threading.Event()
        # Steps a submit waits to see durable (or failed): an entry is dropped when its step's
        # Durable/SaveError arrives (the waiter holds the Event), so this holds at most the
        # checkpoints waited for, never one entry per step of the run.
        self.durable: dict[int, threading.Event] = {}
        self.save_errors: list[str] = []
        self._index_bytes = 0  # about the JSON index bytes of a full snapshot (the first one's)

    def attach(self, state: TrainingState, capture: Capture) -> None:
        """What `seal` reads and waits on, and whose slots come back (made after this: they
        check the engine through it)."""
        self.state, self.capture = state, capture

    # ---- engine events (receiver thread) -----------------------------------------------
    def on_event(self, msg: Message) -> None:
        if isinstance(msg, SlotFree):
            self.capture.staging.release(msg.slot)
        elif isinstance(msg, Durable):  # this rank's bytes are on disk; the step counts once committed
            self._settled(msg.step)
            self.retuner.observe_write(msg.nbytes, msg.write_s)
        elif isinstance(msg, Committed):
            self.metrics.last_durable_step = max(self.metrics.last_durable_step or 0, msg.step)
            self.metrics.emit(type="persist_done", step=msg.step)
        elif isinstance(msg, InMemory):
            self.metrics.last_memory_step = msg.step
        elif isinstance(msg, SaveError):
            self.save_errors.append(f"step {msg.step}: {msg.error}")
            log.warning(f"rank {self.rank}: checkpoint of step {msg.step} failed: {msg.error}; "
                        "training goes on, the last committed step stays valid")
            self._settled(msg.step)
        elif isinstance(msg, FaultKill):
            faults.die()
        elif isinstance(msg, ConnectionLost):
            self.lost.set()
            pool = self.capture.staging.pool
            with pool.cond:
                pool.cond.notify_all()
            for ev in list(self.durable.values()):
                ev.set()

    def _settled(self, step: int) -> None:
        """Wake whoever waits for `step` to be durable and forget it (a Durable of a step nobody
        submitted through `submit`, e.g. a handler's own record, finds nothing)."""
        ev = self.durable.pop(step, None)
        if ev is not None:
            ev.set()

    def check(self) -> None:
        """Raise if the engine went away, or a save failed and --on-save-error=fail."""
        if self.lost.is_set():
            raise EngineLost("checkpoint engine went away")
        if self.save_errors and self.cfg.on_save_error == "fail":
            raise CkptrunError(f"checkpoint failed ({self.save_errors[0]}) and --on-save-error=fail")

    # ---- seal, submit, drain -----------------------------------------------------------
    def seal(self, snap: Snapshot, *, wait: bool = True) -> None:
        """Add the state that settles after the step: schedulers, scaler, tracked objects, and
        the optimizer's param_groups (a scheduler has set their lr by now); then wait for the
        copies, unless `wait` is False (the late tensors are cloned now and copied after the
        snapshot's earlier copies; the strategy then learns of the end through `progress`)."""
        if wait:
            self.capture.add(snap, self.state.late_state())
            self.capture.wait_copy(snap)
        else:
            skeleton, tensors = flatten(self.state.late_state(), snap.prefix)
            self.capture.append(snap, skeleton, {k: t.detach().clone() for k, t in tensors.items()}, background=True)
        if "optimizers" in snap.skeleton:
            for name, groups in snap.skeleton.pop("param_groups").items():
                snap.skeleton["optimizers"][name]["param_groups"] = groups

    def record_meta(self, snap: Snapshot) -> dict:
        meta = {"step": snap.step, "rank": self.rank, "world_size": self.world_size,
                "strategy": self.cfg.strategy, "snapshot_time": snap.time, "snapshot_done_at": snap.done_at,
                "optimizers": self.state.optimizer_info}
        return {**meta, "shared": snap.shared} if snap.shared else meta

    def submit(self, snap: Snapshot, message: type[Persist] = Persist, *, wait_durable: bool = False,
               layout: str = "records", **fields: Any) -> None:
        """Hand a sealed slot to the engine: by default `Persist` it as the full checkpoint of its
        step; a strategy's own `message` (a Persist subclass with `fields`) goes to its engine-side
        handler."""
        self.check()
        killed_mid_write = bool(self.fault and self.fault.target == "kill" and self.fault.phase == "write"
                                and self.fault.step == snap.step and not wait_durable)
        # Only a step someone waits for is registered (before it is sent, so its Durable finds it):
        # a handler may never report some steps durable one by one (lowdiff's batched diffs).
        done = self.durable.setdefault(snap.step, threading.Event()) if wait_durable or killed_mid_write else None
        spec = RecordSpec(record=full_name(snap.step), kind="full", step=snap.step,
                          skeleton=snap.skeleton if layout == "records" else {},
                          tensors={s.key: s.to_json() for s in snap.layout.specs}, meta=self.record_meta(snap),
                          layout=layout)
        self.client.send(message(slot=snap.slot, nbytes=snap.nbytes, spec=spec, **fields))
        # A stream callback usually refers to its snapshot (its step, its slot): a cycle that only
        # the rare full garbage collection frees, with the step's state in it. The copies still
        # queued hold the callback themselves.
        snap.progress = None
        self.metrics.bytes += snap.nbytes
        self.capture.staging.sizes[snap.kind] = snap.nbytes
        if snap.kind == "full" and not self._index_bytes:
            self._index_bytes = 200 * len(snap.layout.specs) + len(json.dumps(snap.skeleton, default=str))
        self.retuner.observe_snapshot(snap.kind, fields.get("disk_nbytes", snap.nbytes))  # what is written
        if killed_mid_write:
            done.wait()  # the engine kills us mid-write (fault_kill) before this returns
        if wait_durable:
            t0 = time.perf_counter()
            done.wait()
            self.metrics.stalled_since("sync_write", t0)
            self.check()

    def index_hint(self) -> int:
        """About the bytes of a full checkpoint's JSON index: its tensors' entries and the
        skeleton of the last full snapshot (sizes a region's metadata area)."""
        return self._index_bytes or 64 << 10

    def drain(self) -> None:
        """Wait until the engine holds nothing of ours unwritten."""
        if not self.lost.is_set():
            self.client.request(Flush())
