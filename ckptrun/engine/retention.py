"""--keep on this node's --dir, after a commit (DESIGN §3.2: old checkpoints are pruned only
after a newer one is committed). With --node-local-dir only the steps every node has committed
(and, with --replicas, every engine holds partner copies of) count, and the records whose
copies this engine holds stay (the other node resumes beside them). With --durable the drain
decides, since a step not yet uploaded must stay (engine/drain.py)."""

from __future__ import annotations

from .engine_state import EngineState


def retain(state: EngineState) -> None:
    """Prune this node's --dir to --keep; a failure is logged and retried at the next commit,
    never a failed commit."""
    if state.keep < 0:
        return
    try:
        upto, held = None, frozenset()
        if state.board is not None:
            upto = state.board.safe_step(state.world_size, replicated=state.replicator is not None)
            held = frozenset(state.replicator.holder.held_records()) if state.replicator is not None else held
        if state.drain:
            state.drain.retain_local(state.keep, protect=held, upto=upto)
        else:
            state.store.prune(state.keep, protect=held, upto=upto)
    except (OSError, RuntimeError) as e:  # retention failing never fails a commit; it runs again next time
        state.log.emit(type="save_error", rank=state.rank, step=-1, record="", error=f"prune: {e}")
