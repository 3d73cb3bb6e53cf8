"""What the engine's parts share (engine/server.py makes them, each with this): whose engine
it is (rank, world size and --keep, from its worker's Hello), its store, the round's board, the
replicator and the drain, the link to the worker and the tests' faults; and what every part
says the same way: a save error, and a --dir that is no longer the run's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..ipc.events import EventLog
from ..ipc.messages import SaveError
from ..storage.dirlock import Claim
from .faults import EngineFaults
from .worker_link import WorkerLink

if TYPE_CHECKING:
    from ..storage.store import Store
    from .drain import Drain
    from .nodecommit import Board
    from .replicate import Replicator


class EngineState:
    """One engine's shared state; the worker's Hello sets most of it (`Engine.op_hello`)."""

    def __init__(self, local_rank: int, tag: str, metrics_dir: str | None, claim: Claim | None = None) -> None:
        self.local_rank, self.tag = local_rank, tag
        self.claim = claim  # the run's lock on --dir, which the path must still name (storage/dirlock.py)
        self.log = EventLog(metrics_dir, f"engine-{local_rank}")
        self.link = WorkerLink()
        self.faults = EngineFaults(self.link)
        self.rank, self.world_size, self.keep = 0, 1, 2
        self.io_threads = 1  # a record's file writes run on this many threads (the Hello's)
        self.store: Store | None = None
        self.board: Board | None = None  # --node-local-dir: the round's commit keys (engine/nodecommit.py)
        self.replicator: Replicator | None = None  # --replicas > 1: copies in partners' memory (replicate.py)
        self.drain: Drain | None = None  # --durable: copies this rank's part of committed steps there
        self.committed_step: int | None = None

    @property
    def speaks_for_node(self) -> bool:
        """This engine logs the commits its node's --dir holds: one per node (local rank 0, global
        rank 0's on its node), whose launcher reads only its own node's metrics."""
        return self.local_rank == 0

    def save_error(self, step: int, record: str, error: str) -> None:
        """Report a failed save to the log and to the worker (dashboard, --on-save-error)."""
        self.log.emit(type="save_error", rank=self.rank, step=step, record=record, error=error)
        self.link.send(SaveError(step=step, record=record, error=error))

    def lost_dir_error(self) -> str:
        """What is wrong with --dir (`Claim.problem`), once it is no longer the run's."""
        return self.store.claim.problem() or f"checkpoint directory {self.store.root} is no longer this run's"
