"""--replicas K: each committed step's part of this rank is copied into the memory of its
partners' engines on other nodes, and a replaced node's engine takes its part back from them.

Transport: point-to-point `torch.distributed` gloo among the engine processes, in a process group
of their own (never the script's), made again at each rendezvous round from the addresses the
round's c10d job store holds. gloo was chosen over a home-made socket protocol and over RPC:
it is in every torch build, moves large byte buffers without pickling, has per-operation
timeouts, and its rendezvous through the c10d store is the job's own; NCCL would need a GPU
and cannot run in a torch-free engine's host memory.

Shipping runs on a thread of its own after a step commits, so the trainer never waits on it; a
partner that is dead or stalls past SEND_TIMEOUT_S is dropped for the rest of the round, said in
one line, and the step stays in --dir as before. Received parts are checked before they are
held (`MemoryTier.hold`). A new round starts with an exchange through the job store
(engine/round_board.py): every engine says which copies it holds of each rank, and one whose
--dir lacks its part of the newest step held asks the engine that holds it (a partner, or any
other where the rendezvous ranked the nodes anew) before its worker resumes (`mirror.fill` then
`Store` check it); then each engine lets go of its copies of ranks not its partners now.

With a snapshot strategy's --persist-every, the steps held in memory only are copied too, each
as it is held (engine/held_copies.py): an engine that holds no step of its rank (a replaced
node's) takes the newest one another engine can make whole back into a staging slot of its own, and
the ranks resume from memory at the newest step all of them hold (worker/resume.py). A survivor
the rendezvous gave a partner's rank keeps its old rank's steps for that node (`adopt`) and
holds its new rank's from its own copies.

The parts, each in a module of its own: the round's group and wire (replica_round.py), the
state they share (replica_state.py), the exchange through the job store (replica_exchange.py),
taking copies back and giving them back (replica_return.py), shipping (replica_ship.py) and
holding what arrives (replica_hold.py); the tests' faults come in through one seam
(engine/faults.py, `ReplicaFaults`). `Replicator` makes the parts and runs each round; the
engine calls the parts themselves: `returns.adopt`, `shipper` (what is written, committed or
held goes to the partners; a handler's copies, `EngineContext.replicas`), `holder`
(`held_records`, `on_held`).
"""

from __future__ import annotations

import contextlib

from ..errors import CkptrunError, CorruptCheckpoint
from ..faults import Fault
from ..ipc.events import EventLog
from ..log import log
from ..storage.store import Store
from .faults import ReplicaFaults
from .held_copies import HeldMemory, PartnerCopies
from .replica_exchange import Exchange
from .replica_hold import Holder
from .replica_return import Returns
from .replica_round import SEND_TIMEOUT_S, Round
from .replica_ship import Shipper
from .replica_state import ReplicaState, short


class Replicator:
    """This engine's side of the replicated memory tier (see the module docstring): membership
    of each round, then the exchange, the shipping and the holding."""

    def __init__(self, events: EventLog) -> None:
        self.state = ReplicaState(events)
        self.returns = Returns(self.state)
        self.exchange = Exchange(self.state, self.returns)
        self.holder = Holder(self.state)
        self.shipper = Shipper(self.state)

    def join(self, spec: dict, rank: int, world_size: int, store: Store, fault: Fault | None, *,
             node_local: bool = False, memory: HeldMemory | None = None, copies: PartnerCopies | None = None) -> None:
        """A worker's Hello in round `spec` (the job store's address and prefix, K, J, local
        ranks per node): make the round's group with every other engine, exchange copies a
        replaced node lacks, then receive partners' new copies. `node_local`: --dir is this
        node's own, so a record it lost comes back whole (manifest and this rank's part).
        `memory`: the steps this engine holds in memory; `copies`: what it keeps of partners'
        (a snapshot strategy's copies by default). Never raises: replication off for the round
        is said in one line."""
        state = self.state
        state.store, state.faults, state.node_local, state.memory = store, ReplicaFaults(fault), node_local, memory
        state.copies = copies if copies is not None else state.snapshot_copies
        if state.round is not None and state.round.key == spec["prefix"] and state.round.rank == rank:
            return  # the same round (a worker restarted alone)
        self._end_round()
        self.shipper.new_round()
        try:
            r = Round(spec, rank, world_size)
        except (CkptrunError, RuntimeError, ValueError) as e:
            log.warning(f"rank {rank}: replicas off for this round: the engines did not meet ({short(e)})")
            state.log.emit(type="replica_error", rank=rank, error=short(e))
            state.adopted = []
            return
        try:
            if self.exchange.run(r):
                self.holder.keep(r.partners)  # (once the exchange has given the others' copies back)
        except (RuntimeError, ValueError, CorruptCheckpoint, OSError) as e:
            log.warning(f"rank {rank}: copies not exchanged this round ({short(e)}); resuming from --dir")
            state.log.emit(type="replica_error", rank=rank, error=short(e))
        state.adopted = []  # (the exchange is over: what it did not give back is the records')
        with state.lock:
            state.round = r
        self.holder.start(r)

    def _end_round(self) -> None:
        """Tell the old round's partners to stop receiving (best effort: they may be dead)."""
        with self.state.lock:
            old, self.state.round = self.state.round, None
        if old is None:
            return
        for p in sorted(old.live):
            with contextlib.suppress(RuntimeError):
                old.stop(p)
        old.close()

    def close(self) -> None:
        """Stop shipping and end the round. The shipping thread is joined once the round's group
        is aborted (a send still waiting fails then): a thread left inside gloo when the process
        exits aborts it (SIGABRT), as a partner closing while a copy went to it showed."""
        self.shipper.stop()
        self._end_round()
        self.shipper.join(SEND_TIMEOUT_S)
        self.holder.withdraw()
