"""A new round's exchange through the job store (engine/replicate.py, engine/round_board.py):
every engine says which copies it holds of each rank, one whose --dir or memory lacks its
rank's newest step asks the engine that holds it, and the copies asked for go back point to
point (engine/replica_return.py) before the workers resume."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..log import log
from ..storage import memory_status
from .replica_return import Returns
from .replica_round import SEND_TIMEOUT_S, Round
from .replica_state import ReplicaState, steps_text
from .round_board import Board


class Exchange:
    """What each engine holds and wants, said through the round's job store, and the trade."""

    def __init__(self, state: ReplicaState, returns: Returns) -> None:
        self.state = state
        self.returns = returns

    def run(self, r: Round) -> bool:
        """Through the job store: what each engine holds of each rank, what each rank wants back
        and from whom (any engine that holds it: `Board`); then the wanted copies go back point
        to point (sends on threads, so no pair waits on the other). Steps held in memory first,
        then records. Whether every copy asked of this engine was sent."""
        sent = self._held(r)
        board = r.board("records")
        with self.state.lock:
            held = dict(self.state.held.owners)
        for owner, (name, step) in held.items():
            if owner != r.rank:
                board.post(f"for/{owner}", {"record": name, "step": step})
        board.sync("said")
        offers = [(d["step"], d["record"], d["from"]) for d in board.read(f"for/{r.rank}", ("step", "record"))]
        if r.rank in held:  # the rendezvous gave this node the rank whose copy it held
            offers.append((held[r.rank][1], held[r.rank][0], r.rank))
        return self._trade(r, board, self._wanted(r.rank, max(offers, default=None)),
                           give=lambda p, asked: self.returns.give_back(r, p),
                           take=lambda want: self.returns.take_back(r, want["holder"], want["record"])) and sent

    def _trade(self, r: Round, board: Board, want: dict, give: Callable[[int, dict], None],
               take: Callable[[dict], None], asks: tuple[str, ...] = ()) -> bool:
        """Ask `want`'s holder for it (`want`: {holder, ...}, or {}), `give` each engine what it
        asked of this one (each ask with the fields `asks` names; on threads: no pair waits on the
        other), `take` its own, then wait for the sends; whether they all ended."""
        if want and want["holder"] != r.rank:
            board.post(f"ask/{want['holder']}", want)
        board.sync("asked")
        senders = []
        for asked in board.read(f"ask/{r.rank}", asks):
            t = threading.Thread(target=give, args=(asked["from"], asked), daemon=True)
            t.start()
            senders.append(t)
        if want:
            take(want)
        for t in senders:
            t.join(SEND_TIMEOUT_S)
        return not any(t.is_alive() for t in senders)

    def _held(self, r: Round) -> bool:
        """Each engine says which held steps of each rank it can give back whole (a thin copy
        needs its own state of the same step, or the old rank's it adopted); one that holds no
        step of its rank takes the newest ones back from its own copies, where the rendezvous
        gave it a rank it held copies of, else asks the engine that holds the newest of them (a
        partner, or any other), into its memory. Whether every copy asked of it was sent."""
        state, board = self.state, r.board("held")
        own = set(state.memory.held_steps()) if state.memory is not None else set()
        with state.lock:
            whole_at = own | {c.step for c in state.adopted}
            owners = {*state.copies.owners, *(c.index.rank for c in state.adopted)} - {r.rank}
            kept = {o: state.copies.steps(o) for o in owners}
            can = {o: state.copies.whole_steps(o, whole_at) for o in owners}
            for c in state.adopted:  # (whole: kept and given back alike)
                if c.index.rank in owners:
                    for said in (kept, can):
                        said[c.index.rank] = sorted({*said[c.index.rank], c.step}, reverse=True)
            snapshots = state.copies is state.snapshot_copies
            mine = [] if state.memory is None or own else sorted({
                *state.copies.whole_steps(r.rank, whole_at),
                *(c.step for c in state.adopted if c.index.rank == r.rank)})
        if mine:
            own = set(self.returns.take_back_own(r, mine))
        for o in owners:
            board.post(f"for/{o}", {"kept": kept[o], "whole": can[o]})
        if own:
            board.post("own", {"steps": sorted(own)})
        board.sync("said")
        want = self._wanted_held(r, board) if state.memory is not None and not own else {}
        state.log.emit(type="replica_exchange", rank=r.rank, holds=sorted(own),
                       kept={str(o): v for o, v in kept.items()}, whole={str(o): v for o, v in can.items()}, wants=want)
        sent = self._trade(r, board, want, give=lambda p, asked: self.returns.give_back_held(r, p, asked["step"]),
                           take=lambda want: self.returns.take_back_held(r, want["holder"], want["step"]),
                           asks=("step",))
        with state.lock:  # (copies of its own rank, taken back or not, are of no use to this engine now)
            if snapshots and state.copies.owners.pop(r.rank, None) is not None:
                memory_status.withdraw(state.store.root, r.rank, of=memory_status.HELD_COPIES)
        return sent

    def _wanted_held(self, r: Round, board: Board) -> dict:
        """{holder, step} to ask for: the newest step of this rank another engine can give back
        whole that every surviving rank holds too; {} if none (said, where copies were kept)."""
        said = board.read(f"for/{r.rank}", ("kept", "whole"))
        held = [set(d["steps"]) for d in board.read("own", ("steps",))]  # (the surviving ranks' own steps)
        offers = [(s, d["from"]) for d in said for s in d["whole"] if all(s in h for h in held)]
        if offers:
            step, holder = max(offers)
            return {"holder": holder, "step": step}
        if copies := sorted({s for d in said for s in d["kept"]}):
            log.warning(f"rank {r.rank}: other engines hold copies of its steps {steps_text(copies)} in memory, but "
                        "no longer their own state of those steps to complete them (they ran ahead); resuming "
                        "from --dir")
        return {}

    def _wanted(self, rank: int, offer: tuple[int, str, int] | None) -> dict:
        """{holder, record} to ask for, if the newest copy partners hold is missing from --dir."""
        if offer is None:
            return {}
        step, name, holder = offer
        store = self.state.store
        if store.is_committed(name) and rank in store.ranks_present(name):
            return {}
        if not store.is_committed(name) and not self.state.node_local:
            log.warning(f"rank {rank}: rank {holder} holds step {step}, but {store.root} has no record of it "
                        "to complete; resuming from --dir")
            return {}
        return {"holder": holder, "record": name}
