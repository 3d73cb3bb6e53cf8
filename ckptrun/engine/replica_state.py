"""What the parts of the replicator (engine/replicate.py) share: the round, the copies this
engine holds for its partners, its own steps in memory, and the one lock over them; and the
small helpers each part says its errors with."""

from __future__ import annotations

import threading

from ..ipc.events import EventLog
from ..log import log
from ..storage.schema import rank_files
from ..storage.store import Store
from ..storage.tiers.memtier import MemoryTier
from .faults import ReplicaFaults
from .held_copies import HeldCopies, HeldCopy, HeldMemory, PartnerCopies
from .replica_round import Round


class ReplicaState:
    """One engine's replication state, read and changed by the exchange, the returns, the
    shipping and the holding; `lock` guards the round and the copies held."""

    def __init__(self, events: EventLog) -> None:
        self.log = events
        self.held = MemoryTier("partner memory")  # partners' parts of committed records
        self.snapshot_copies: PartnerCopies = HeldCopies()  # a snapshot strategy's partners' steps
        self.copies: PartnerCopies = self.snapshot_copies  # partners' steps held in memory only (join's `copies`)
        self.memory: HeldMemory | None = None  # this engine's own steps held in memory
        self.adopted: list[HeldCopy] = []  # this engine's steps of its worker's old rank (`adopt`)
        self.round: Round | None = None
        self.store: Store | None = None
        self.faults = ReplicaFaults()  # the tests' injected faults (engine/faults.py)
        self.node_local = False
        self.lock = threading.Lock()

    def drop(self, r: Round, p: int, e: BaseException) -> None:
        """Partner `p` is dead or stalled: no more copies go to it this round (said once)."""
        if p in r.live and self.round is r:
            r.live.discard(p)
            log.warning(f"rank {r.rank}: replicas to rank {p} stopped ({short(e)}); its steps stay in --dir "
                        "only, until the next rendezvous round")
            self.log.emit(type="replica_error", rank=r.rank, partner=p, error=short(e))


def files_of(owner: int, blobs: list[bytes]) -> dict[str, bytes]:
    """Rank `owner`'s files by name, of the [data, index] a copy's messages carry (`Round.recv`)."""
    return dict(zip(rank_files(owner), blobs, strict=True))


def steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps))


def short(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
