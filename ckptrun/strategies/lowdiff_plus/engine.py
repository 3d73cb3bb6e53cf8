"""Engine side of `lowdiff+`: the CPU replica (§VI-B, Insight 2: incremental merging).

The replica is a full state (parameters, optimizer state, buffers, RNG, schedulers, ...) in this
process's memory, started from a real full snapshot (`Base`) and stepped forward by each step's
`Grads` (replica.py). On CPU training the replica is bit-exact. It is written to disk as an
ordinary full record when the trainer says the step is due (`persist`): copied into one persist
buffer, allocated once, then written by the engine's writer threads while the next steps are
applied. The replica's tensors live in one shared-memory file (`Arena`, re-laid out when the set
of tensors changes, e.g. when Adam creates its moments at the first step): a worker restarted
after a crash maps it and loads from it (`fetch`): no disk read and no copy in the engine.

With --replicas, each step's diff is copied out of its slot and shipped to the partners, who
step their copies of this replica with it (copies.py), after the whole replica once per round;
under DDP both go thin, without the replicated state and gradients, which a partner checks
against its own replica and diffs (perrank.py).
A diff is then applied only once every copy this engine keeps of its partners' replicas has one
of that step too (replica.py, `KeptBack`): the replica and the copy of a lost node's can stand
at one common step, which the ranks of the next round resume from, whichever of them lagged
(engine/held.py holds two snapshots for the same reason).

The handler's parts: the DDP facts a base gives (facts.py), persisting the replica
(persist.py), and what the worker and the replicator ask of it (served.py); the handler itself
keeps the replica's update and what it ships to the partners.

Call order: Base first (or after a failed update), then Grads of consecutive steps; a Base of
the replica's own step replaces it (a re-base).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...engine.handlers import EngineContext, EngineHandler, Replicas
from ...engine.held_copies import HeldCopy, cut, thinned
from ...engine.step_clock import StepClock
from ...ipc.messages import RecordSpec, StrategyMessage
from ...restore.recovery import optimizer_classes
from ...restore.replay import warm_up_in_background
from ...storage.layout import Layout
from ...storage.store import full_name
from .copies import PartnerReplicas
from .facts import BaseFacts
from .messages import Base, Grads
from .perrank import update_print
from .persist import ReplicaWriter
from .replica import KEPT_BACK, Arena, KeptBack, SteppedReplica, tree_of
from .served import ServedReplica

RESYNC_EVERY = 100  # --replicas under DDP: steps between the thin replica's shipments (`_stepped`)


class LowDiffPlusHandler(EngineHandler):
    """The replica's update from each step's message, and its copies shipped to partners."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        torch.set_num_threads(1)  # the update runs beside training: one core (paper §VII-B)
        classes = optimizer_classes()
        self.own = KeptBack(SteppedReplica(classes, self._arena), owned=False,  # (diffs kept back only with
                            done=self._done)  # --replicas)
        self.spare: list[bytearray] = []  # buffers of own diffs applied, to cut the next ones into
        self.copies = PartnerReplicas(classes, lambda owner, layout: self._arena(layout, f"copy{owner}."),
                                      self.own.newest, self._state_at)
        self.generation = 0
        self.step_time = StepClock()  # of the steps' snapshots (--replicas: their copies wait one step's time)
        self.facts = BaseFacts()
        self.writer = ReplicaWriter(ctx)
        self.served = ServedReplica(ctx, self.own, self.copies, self.facts, self.writer, self.step_time,
                                    self._stood, self._based)

    def handle(self, msg: StrategyMessage) -> None:
        if not isinstance(msg, Base | Grads):
            super().handle(msg)
        step = msg.spec.step
        try:
            (self._rebase if isinstance(msg, Base) else self._apply)(msg)
        except Exception as e:  # noqa: BLE001 - reported; the trainer sends a full snapshot again
            self.own.stepped.replica = None
            self._forget()
            self.ctx.save_error(step, full_name(step), f"replica update failed ({type(e).__name__}: {e}); "
                                                       "re-basing from a full snapshot")
            return
        finally:
            self.ctx.free_slot(msg.slot)
        self.ctx.in_memory(step, self.own.stepped.arena.nbytes)
        fault = self.ctx.write_fault_due(step)
        if msg.persist or fault:
            self.writer.due.add(step)
        now = fault or isinstance(msg, Base) or self.ctx.replicas is None or msg.final  # (else: kept back)
        self.own.apply(float("inf") if now else self.copies.newest(), self._stepped)
        self.writer.stood(self.own.stepped.step, self.own.stepped, self.facts)

    def _stepped(self, step: int) -> None:
        """`_stood`, for a diff applied as training goes: at every RESYNC_EVERY-th step, under
        the short-cut, the replica ships again (thin) with the diffs kept back after it, and
        each partner takes its own replica's xxh3 at that step (`_stood`): a copy a partner
        dropped (a re-base on one rank only, a backlog dropped) comes back within that many
        steps, checked, with no word from the partner."""
        self._stood(step)
        if self.ctx.replicas is not None and self.thin and step % RESYNC_EVERY == 0:
            self._offer_whole(self.ctx.replicas)

    def _stood(self, step: int) -> None:
        """The replica stands at `step`: written if it is due; partners' thin copies checked
        against it (copies.py, `own_at`)."""
        self.writer.stood(step, self.own.stepped, self.facts)
        if self.ctx.replicas is not None and self.thin:
            self.copies.own_at(step, lambda: self.own.stepped.sums(self._replicated_keys()),
                               keep=step % RESYNC_EVERY == 0)

    def _state_at(self, step: int) -> dict | None:
        """The replica's full state, if it stands at `step`."""
        return self.own.stepped.replica.full_state() if self.own.stepped.step == step else None

    def _forget(self) -> None:
        """Drop the diffs kept back and the writes due (the replica starts anew)."""
        self.own.clear()
        self.writer.due.clear()
        self.step_time.reset()
        self.copies.forget_own()

    def _based(self, replicated: list[int], shared: list[int], exact: bool) -> None:
        """Take a base's DDP facts (`thin` is known once the replica holds the base)."""
        self.facts.replicated, self.facts.shared, self.facts.exact = replicated, shared, exact
        self._forget()

    @property
    def thin(self) -> bool:
        """Every optimizer parameter is data-parallel: the short-cut of perrank.py applies."""
        return self.facts.thin(self.own.stepped.replica)

    def _replicated_keys(self) -> list[str]:
        return self.facts.replicated_keys(self.own.stepped.replica)

    def _arena(self, layout: Layout, prefix: str = "") -> Arena:
        self.generation += 1
        arena = Arena(self.ctx.shared_file(f"{prefix}replica{self.generation}"), layout)
        if not prefix:
            self.ctx.emit(type="replica", rank=self.ctx.rank, nbytes=layout.nbytes)
        return arena

    def _slot_tree(self, slot: int, spec: RecordSpec) -> dict:
        return tree_of(spec, torch.frombuffer(self.ctx.slot_view(slot), dtype=torch.uint8))

    def _rebase(self, msg: Base) -> None:
        """Start the replica from a full snapshot (the slot's bytes, then moved into an arena)."""
        self._based(msg.replicated, msg.shared, msg.exact)
        self.own.stepped.rebase(msg.spec, self._slot_tree(msg.slot, msg.spec), msg.exact, real=True)
        if (replicas := self.ctx.replicas) is not None:
            self._expect()
            replicas.offer_copy(self._whole())

    def _apply(self, msg: Grads) -> None:
        """Step the replica with one step's gradients and hyper-parameters; with --replicas,
        ship them, keep them back and apply those the partners' copies have caught up with."""
        replicas = self.ctx.replicas
        if replicas is None:
            self.own.stepped.apply(msg.spec, self._slot_tree(msg.slot, msg.spec))
            return
        meta = self.facts.diff_meta(msg.spec, self.own.stepped.replica)
        spec = dataclasses.replace(msg.spec, kind="diff", meta=meta)  # (the trainer's names a record)
        view = self.ctx.slot_view(msg.slot)[: _extent(spec)]
        diff = cut(self.ctx.rank, spec, view, thin=False, into=self._spare(len(view)))
        self.copies.own_diff(spec.step, update_print(diff.index))
        if new_round := replicas.full_due():
            self._expect()
        self.own.add(msg.spec, diff)
        if new_round:  # (new partners)
            self._offer_whole(replicas)
        else:
            replicas.offer_copy(thinned(diff))
        # The copies keep up with the steps, or no partner's copy of this replica can stand at a
        # step the survivors' replicas still can: wait for the one before this one to have left,
        # one step's time at most (the trainer waits for this slot only if it has none spare).
        replicas.wait_shipped(1, self.step_time.since(msg.spec.meta["snapshot_time"]))

    def _offer_whole(self, replicas: Replicas) -> None:
        """Ship the replica whole (thin under the short-cut), then the diffs kept back after it."""
        replicas.offer_copy(self._whole())
        for _, kept in self.own.diffs:
            replicas.offer_copy(thinned(kept))

    def _spare(self, nbytes: int) -> bytearray | None:
        """A buffer of `nbytes` an own diff was cut into before (a new one faults its pages in:
        11 ms a step of the engine's 17 MB diffs on the bench's model, against 3.5 ms reused)."""
        while self.spare:
            buf = self.spare.pop()
            if len(buf) == nbytes:
                return buf
        return None

    def _done(self, diff: HeldCopy) -> None:
        """An own diff is applied or dropped: its buffer is used again if only the kept-back
        diffs held it (its index names shared tensors: partners got other bytes, `thinned`)."""
        if getattr(diff.index.meta, "shared", None) and len(self.spare) <= KEPT_BACK \
                and isinstance(diff.data, bytearray):
            self.spare.append(diff.data)

    def _expect(self) -> None:
        """Partners' thin whole replicas may come now: the replica's shared xxh3 are taken at
        the next few steps, from this one (copies.py, `expect`)."""
        if self.thin:
            self.copies.expect()
            self._stood(self.own.stepped.step)

    def _whole(self) -> HeldCopy:
        """The replica whole, for partners to step their copies of it from (thin: without the
        state every data-parallel rank holds alike)."""
        meta = self.facts.made()
        if self.thin:
            meta["shared"] = self._replicated_keys()
        return self.own.stepped.copy(self.ctx.rank, meta, thin=self.thin)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        """Its worker came back as another rank: the replica is the old rank's state. Dropped (a
        new handler starts from the new rank's records), and the copies of its partners' too."""
        self.restart()
        self._forget()
        self.own.stepped.drop()
        self.copies.close()

    # ---- what the worker and the replicator ask of the replica: served.py ---------------
    def give_up(self, rank: int) -> list[HeldCopy]:
        return self.served.give_up(rank)

    def held(self) -> list[tuple[int, int]]:
        return self.served.held()

    def fetch(self, step: int | None = None) -> dict:
        return self.served.fetch(step)

    def replication(self) -> tuple[Any, PartnerReplicas]:
        return self.served, self.copies


# At the engine's start (its `preload` imports this module): a replaced node's engine builds an
# optimizer for the replica a partner gives back before its worker's hello is answered, and a
# cold one took 1.9 s there.
warm_up_in_background()


def _extent(spec: RecordSpec) -> int:
    """The bytes of a slot that `spec`'s tensors lie in."""
    return max((t["offset"] + t["nbytes"] for t in spec.tensors.values()), default=0)
