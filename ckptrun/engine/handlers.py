"""Engine-side halves of strategies: where a strategy's own messages are handled.

A strategy that keeps state inside the engine (a CPU replica updated every step, gradient
batches held in host memory, a double-buffered persistent region) names a handler class in the
registry; the worker passes that import path in its `Hello`, and the engine imports nothing
else. A handler sees the engine only through its `EngineContext`, which this module defines and
the engine implements (as `StrategyContext` is to a strategy's trainer side): handlers and the
server meet here, and neither imports the other.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..ipc.messages import Message, RecordSpec, StrategyMessage

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ..storage.fsutil import FaultHook
    from ..storage.store import Store
    from .held_copies import HeldCopy, HeldMemory, PartnerCopies


class EngineContext(ABC):
    """The one surface an engine-side handler may use; the engine (`server.ServerContext`)
    implements it, so a handler never sees the engine itself.

    Call order for a message naming a staging slot: `read_slot` (copy the bytes out), then
    `free_slot` at once (the worker reuses the slot; it waits for it under back-pressure), then
    `write` a record (queued on the writer threads; the worker hears `Durable`, then `Committed`
    from the commit protocol, or `SaveError`). A request is answered with `reply`.

    A handler with its own layout (a region of slots) instead runs its jobs with `run` (the
    engine's flush waits for them), reads the staging slot in place (`slot_view`), and reports
    `durable`, then `committed` (which also answers a restarted worker's resume question), or
    `save_error`, itself; `write_now` moves a step into an ordinary record synchronously.
    """

    @abstractmethod
    def read_slot(self, slot: int, start: int, stop: int) -> bytes:
        """A copy of bytes [start, stop) of staging slot `slot`."""

    @abstractmethod
    def slot_view(self, slot: int) -> memoryview:
        """The staging slot's bytes in place (valid until `free_slot`)."""

    @property
    @abstractmethod
    def root(self) -> str:
        """The run's checkpoint directory."""

    @property
    @abstractmethod
    def rank(self) -> int:
        """This engine's global rank (the worker's, from its Hello)."""

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @property
    @abstractmethod
    def keep(self) -> int:
        """Full checkpoints retained (--keep; 0 keeps all)."""

    @property
    @abstractmethod
    def store(self) -> Store: ...

    @abstractmethod
    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run a job on the engine's writer threads; `flush` waits for it."""

    @abstractmethod
    def write_with(self, spec: RecordSpec, write: Callable[[], int], since: float | None = None) -> int:
        """Persist this rank's part of record `spec` by `write()` in the caller's thread (the
        bytes written; raise `AlreadyCommitted` when `Store` says the record is committed), then
        committed as any record: the handler writes its own layout, the engine reports and commits."""

    @abstractmethod
    def write_now(self, spec: RecordSpec, data: memoryview) -> int:
        """Persist this rank's part of record `spec` in the caller's thread (then committed as any)."""

    @abstractmethod
    def fault_hook(self, step: int) -> FaultHook:
        """The crash-matrix fault for writes of `step` (call it with "data:written" after the data)."""

    @abstractmethod
    def durable(self, step: int, record: str, nbytes: int, write_s: float) -> None:
        """This rank's part of `record` is on disk: logged, and the worker told."""

    @abstractmethod
    def committed(self, step: int, record: str, nbytes: int = 0, snapshot_time: float | None = None) -> None:
        """`step` is committed for the whole run (every rank holds it durably)."""

    @abstractmethod
    def save_error(self, step: int, record: str, error: str) -> None:
        """A failed save: logged, and the worker told (dashboard, --on-save-error)."""

    @abstractmethod
    def in_memory(self, step: int, nbytes: int) -> None:
        """The handler's memory holds the full state of `step` (`nbytes`): the worker's metrics
        and `ckptrun ls` show it."""

    @abstractmethod
    def shared_file(self, name: str) -> Path:
        """A path in shared memory for a file this handler creates, named after the run so that
        the launcher removes it once the run is gone, like the staging slots."""

    @abstractmethod
    def write_fault_due(self, step: int) -> bool:
        """Is the crash-matrix fault a write-phase fault at `step`? A handler that writes only
        some steps must then write that one now: the fault fires inside its write, and a worker
        killed "while step K is written" waits for that write."""

    @abstractmethod
    def free_slot(self, slot: int) -> None:
        """Give staging slot `slot` back to the worker."""

    @abstractmethod
    def wait_writes(self, limit: int) -> None:
        """Block until fewer than `limit` writes are queued or running: a handler that copies a
        checkpoint out of its slot and frees the slot at once bounds what it holds this way (the
        trainer then waits for a free slot: back-pressure, not a growing queue)."""

    @abstractmethod
    def write(self, spec: RecordSpec, data: memoryview) -> Future:
        """Persist this rank's part of record `spec` and hand it to the committer; the future is
        done once `data` has been written (the caller may reuse its buffer then)."""

    @abstractmethod
    def reply(self, request: Message, **body: Any) -> None:
        """Answer the worker's `request`."""

    @abstractmethod
    def emit(self, **event: Any) -> None:
        """Append an event to the engine's metrics log."""

    @property
    @abstractmethod
    def replicas(self) -> Replicas | None:
        """--replicas: where a handler that keeps its state itself ships copies of it to the
        partners (its `replication` keeps theirs); None without."""


class Replicas(Protocol):
    """What a handler sees of the engine's replicator (engine/replicate.py)."""

    def offer_copy(self, copy: HeldCopy) -> None:
        """Ship `copy` to the partners, after those offered before it."""

    def wait_shipped(self, most: int, timeout: float) -> bool:
        """Wait until at most `most` copies offered are not sent yet, `timeout` s at most."""

    def full_due(self) -> bool:
        """Must the next copy offered be whole (new partners, or copies dropped)?"""


class EngineHandler:
    """Default: the strategy sends only the shared messages (Persist, Flush, ...)."""

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx

    def handle(self, msg: StrategyMessage) -> None:
        raise RuntimeError(f"strategy has no engine-side handler for {type(msg).__name__}")

    def flush(self) -> None:
        """Hand everything held in memory to the writers (before a flush or a new worker); a job
        waiting for a message that will not come (its worker died) must end here."""

    def restart(self) -> None:
        """A worker starts (its Hello; a new engine's first one too): it resumes from a committed
        step, so whatever an old worker or engine left in flight is abandoned; every job of the
        old worker must end here. By default that is `flush`."""
        self.flush()

    def give_up(self, rank: int) -> list[HeldCopy]:
        """With --replicas, before `close`: what of the state it holds (its old `rank`'s, and
        partners' copies it keeps itself) the next round may give back, cut whole and checked
        (`Returns.adopt`): the node that has `rank` now takes its part back, and this engine
        holds the copy of the rank its worker has now as its own. By default nothing."""
        return []

    def close(self) -> None:
        """The engine gives this handler up: its worker came back as another rank (the rendezvous
        ranked the nodes anew), and what the handler holds (region files, a replica) is its old
        rank's, which another engine now serves. Every job of the old worker ends here, as in
        `restart`, and the handler lets go of that state without changing it again. By default
        that is `restart`."""
        self.restart()

    def tick(self) -> None:
        """Called every few tens of milliseconds by the engine (e.g. to watch other ranks)."""

    def held(self) -> list[tuple[int, int]]:
        """(step, bytes) of each full state this handler holds in memory (a CPU replica), newest
        first: a restarted worker may resume from one without reading the disk (`fetch`)."""
        return []

    def fetch(self, step: int | None = None) -> dict:
        """Where the held state of `step` (None: the newest) is: {"step", "path" (a shared-memory
        file), "skeleton", "tensors" (key -> TensorSpec JSON, offsets into the file), "exact"}.
        The handler does not change that file until the worker's next message."""
        raise RuntimeError("this strategy holds no state in memory")

    def replication(self) -> tuple[HeldMemory, PartnerCopies] | None:
        """--replicas: a handler that holds its state in memory itself gives the replicator what
        it holds (`HeldMemory`) and what keeps its partners' copies; None: the engine's own
        (a snapshot strategy's slots, `HeldCopies`)."""
        return None


def engine_handler(spec: str | None, ctx: EngineContext) -> EngineHandler:
    """The handler class at `spec` ("module:Class", from the registry via the worker's Hello)."""
    if spec is None:
        return EngineHandler(ctx)
    module, _, cls = spec.partition(":")
    return getattr(importlib.import_module(module), cls)(ctx)
