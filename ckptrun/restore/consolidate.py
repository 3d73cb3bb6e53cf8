"""Full tensors out of sharded state: every rank's shard of each DTensor, assembled.

A rank's state of a step holds its own shards (`storage.sharding.Sharded`); restore writes
the full tensors (`restore --format torch|safetensors`) and a resume at another world size
slices them for its own mesh (DDP's replicated state, the same on every rank, is read whole).
The shards of every rank are read and checked as any record is.
"""

from __future__ import annotations

from ..errors import CheckpointMismatch, CorruptCheckpoint
from ..log import log
from ..storage.sharding import Sharded, assemble, find
from ..storage.store import Manifest, Store
from ..storage.writeonce import remote_refs
from .recovery import Plan, read_state


def consolidate(store: Store, m: Manifest, state: dict) -> dict:
    """Give each sharded tensor of `state` (one rank's state of committed record `m`) its full
    tensor (`Sharded.full`), from the shards of all of `m`'s ranks; `state` itself is returned.
    CorruptCheckpoint when the ranks' shards do not make whole tensors."""
    wanted = find(state)
    if not wanted:
        return state
    pieces: dict[str, list[Sharded]] = {s.key: [] for s in wanted}
    for rank in range(m.world_size):
        for s in find(read_state(store, m, rank)):
            if s.key in pieces:
                pieces[s.key].append(s)
    try:
        for s in wanted:
            s.full = assemble(pieces[s.key], f"{m.name}: sharded tensor {s.key!r}")
    except ValueError as e:
        raise CorruptCheckpoint(str(e)) from None
    return state


def resharded(store: Store, plan: Plan, rank: int, world_size: int) -> dict:
    """The state rank `rank` of a run of `world_size` ranks resumes from when `plan`'s step was
    written by another number of ranks: its sharded tensors whole (the worker takes its own slice
    for its mesh), DDP's replicated tensors as every rank had them, and the rest (RNG, other
    tensors, tracked objects) of saved rank `rank % saved ranks`. CheckpointMismatch unless the
    step is a full checkpoint holding sharded or replicated state: other per-rank state (a
    single process's) has no rule to split or join it, and a replay chain (diff records)
    replays each rank's own gradients on its own shards."""
    saved = plan.base.world_size
    fix = f"launch {saved} ranks, or export it with `ckptrun restore`"
    if plan.diffs:
        raise CheckpointMismatch(f"{store.where} step {plan.step} is a replay chain written by {saved} ranks, this run "
                                 f"has {world_size}: its gradients replay on {saved} ranks' shards only; {fix}")
    state = read_state(store, plan.base, rank % saved)
    if not find(state) and not replicated(store, plan.base):
        raise CheckpointMismatch(f"{store.where} step {plan.step} was written by {saved} ranks, this run has "
                                 f"{world_size}, and it holds no sharded (DTensor) or DDP-replicated state to "
                                 f"reshard; {fix}")
    if rank == 0:
        log.warning(f"resharding step {plan.step} from {saved} to {world_size} ranks: sharded parameters and "
                    f"optimizer state are resliced, DDP's replicated ones taken whole; each rank's other state "
                    f"(RNG, per-rank tensors, tracked objects) is that of saved rank (rank mod {saved})")
    return consolidate(store, plan.base, state)


def replicated(store: Store, m: Manifest) -> bool:
    """Whether record `m` holds DDP's replicated state: some rank names tensors another rank
    wrote once for all (storage/writeonce.py)."""
    return any(remote_refs(store.read_index(m.name, r, m)["skeleton"]) for r in range(m.world_size))
