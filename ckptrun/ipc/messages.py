"""The worker-engine protocol: one enum of message kinds, one dataclass per message.

Messages cross the boundary pickled, over the authenticated connection between the processes
of one run (never read from a checkpoint directory). A worker `request`s (and waits for the
`Reply` carrying its `id`) or `send`s; the engine pushes events back.

Call order, worker to engine: `Hello` (reply: pid, slots, committed_step) first on every
connection; `CommitPending` (reply: committed_step, held: the steps held in memory) before the resume decision, then
`FetchHeld` (reply: the shared-memory file holding it, and its layout) if it resumes from the
state the engine holds in memory; `Alloc` (reply:
slots) whenever the slots are too small; per checkpoint a `Persist`, or a strategy's own message
(a `StrategyMessage` subclass, handed to the strategy's engine-side handler); `Retire` for slots
of an older generation once they are free; `Flush` (reply) and `Bye` at the end. Engine to
worker: `SlotFree` once a slot's bytes are taken, `Durable` once this rank's files are on disk,
`Committed` once the record is committed, `InMemory` once the engine's memory holds a step's
full state (a strategy keeping a replica), `SaveError` for any failure, `FaultKill` (fault
injection). The client reports a dropped connection as `ConnectionLost`; the launcher sends
`Shutdown`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar


class Op(str, Enum):
    HELLO = "hello"
    COMMIT_PENDING = "commit_pending"
    ALLOC = "alloc"
    PERSIST = "persist"
    STRATEGY = "strategy"
    RETIRE = "retire"
    FLUSH = "flush"
    BYE = "bye"
    SHUTDOWN = "shutdown"
    REPLY = "reply"
    SLOT_FREE = "slot_free"
    DURABLE = "durable"
    COMMITTED = "committed"
    SAVE_ERROR = "save_error"
    FAULT_KILL = "fault_kill"
    ENGINE_LOST = "engine_lost"
    FETCH_HELD = "fetch_held"
    IN_MEMORY = "in_memory"


@dataclass(kw_only=True)
class Message:
    op: ClassVar[Op]
    id: int = 0  # set by EngineClient.request; the Reply carries it back


# ---- worker -> engine --------------------------------------------------------------------
@dataclass(kw_only=True)
class Hello(Message):
    op: ClassVar[Op] = Op.HELLO
    rank: int
    world_size: int
    restart_count: int
    dir: str
    keep: int
    strategy: str
    engine_handler: str | None = None  # "module:Class" of the strategy's engine side (the registry's)
    writers: int
    io_threads: int
    fault: str | None = None
    io_engine: str = "auto"  # the engine's file writer: auto | native | python (storage/iowriter.py)
    # --replicas > 1: the attempt's job store (addr, port, prefix), replicas, jump and local ranks
    # per node (engine/replicate.py); None: no copies in partners' memory
    replication: dict | None = None
    # --node-local-dir: the attempt's job store (addr, port, prefix) through which the engines
    # commit steps (engine/nodecommit.py); None: --dir is one directory every rank writes into
    node_local: dict | None = None


@dataclass(kw_only=True)
class CommitPending(Message):
    op: ClassVar[Op] = Op.COMMIT_PENDING


@dataclass(kw_only=True)
class Alloc(Message):
    op: ClassVar[Op] = Op.ALLOC
    nslots: int
    nbytes: int


@dataclass(kw_only=True)
class RecordSpec:
    """What the engine writes and commits for one rank's part of a record, besides its bytes."""

    record: str
    kind: str
    step: int
    skeleton: dict
    tensors: dict
    meta: dict
    first_step: int | None = None  # a record covering several steps (a batch of diffs)
    depends_on: list[str] = field(default_factory=list)
    layout: str = "records"  # or "file": one self-describing file per rank (storage/rankfile.py)


@dataclass(kw_only=True)
class Persist(Message):
    """Write the slot's first `nbytes` as record `spec`, then free the slot. The memory tier
    (`--persist-every`): with `hold`, the engine keeps the slot as the rank's newest state in
    memory (freeing the one it held before) and writes it only with `write`."""

    op: ClassVar[Op] = Op.PERSIST
    slot: int
    nbytes: int
    spec: RecordSpec
    hold: bool = False
    write: bool = True


@dataclass(kw_only=True)
class BuildsFull(Persist):
    """A strategy's message from which its engine-side handler builds full records itself (a
    replica, rolled-forward blocks). `replicated`: the positions of the optimizer's parameters
    that DDP keeps identical on every rank; their tensors and the optimizer state over them are
    written by one rank each (storage/writeonce.py `split_state`). `shared`: such positions whose
    tensors every rank writes, named in the record's index instead (`writeonce.shared_keys`)."""

    replicated: list[int] = field(default_factory=list)
    shared: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class StrategyMessage(Message):
    """Base of a strategy's own messages (defined in its module): the engine hands them to the
    strategy's engine-side handler."""

    op: ClassVar[Op] = Op.STRATEGY


@dataclass(kw_only=True)
class FetchHeld(Message):
    """Where the state of `step` the engine holds in memory (one of `CommitPending`'s held;
    None: the newest) is (reply: a shared-memory file, the skeleton and each tensor's place in it)."""

    op: ClassVar[Op] = Op.FETCH_HELD
    step: int | None = None


@dataclass(kw_only=True)
class Retire(Message):
    op: ClassVar[Op] = Op.RETIRE
    slots: list[int]


@dataclass(kw_only=True)
class Flush(Message):
    op: ClassVar[Op] = Op.FLUSH


@dataclass(kw_only=True)
class Bye(Message):
    op: ClassVar[Op] = Op.BYE


@dataclass(kw_only=True)
class Shutdown(Message):
    op: ClassVar[Op] = Op.SHUTDOWN


# ---- engine -> worker --------------------------------------------------------------------
@dataclass(kw_only=True)
class Reply(Message):
    op: ClassVar[Op] = Op.REPLY
    body: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class SlotFree(Message):
    op: ClassVar[Op] = Op.SLOT_FREE
    slot: int


@dataclass(kw_only=True)
class Durable(Message):
    op: ClassVar[Op] = Op.DURABLE
    step: int
    record: str
    nbytes: int
    write_s: float


@dataclass(kw_only=True)
class Committed(Message):
    op: ClassVar[Op] = Op.COMMITTED
    step: int
    record: str


@dataclass(kw_only=True)
class InMemory(Message):
    """The engine's memory holds the full state of `step` (it survives a worker crash, not the engine's)."""

    op: ClassVar[Op] = Op.IN_MEMORY
    step: int


@dataclass(kw_only=True)
class SaveError(Message):
    op: ClassVar[Op] = Op.SAVE_ERROR
    step: int
    record: str
    error: str


@dataclass(kw_only=True)
class FaultKill(Message):
    op: ClassVar[Op] = Op.FAULT_KILL


@dataclass(kw_only=True)
class ConnectionLost(Message):
    op: ClassVar[Op] = Op.ENGINE_LOST
