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

Call order: Base first (or after a failed update), then Grads of consecutive steps; a Base of
the replica's own step replaces it (a re-base).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ...engine.handlers import EngineContext, EngineHandler, Replicas
from ...engine.held_copies import HeldCopy, cut, thinned
from ...engine.step_clock import StepClock
from ...errors import CorruptCheckpoint
from ...ipc.messages import RecordSpec, StrategyMessage
from ...log import log
from ...restore.recovery import optimizer_classes
from ...restore.replay import warm_up_in_background
from ...storage import writeonce
from ...storage.layout import Layout, view
from ...storage.store import full_name
from ...storage.tree import TENSOR
from .copies import REPLICA_META, PartnerReplicas, replica_meta
from .messages import Base, Grads
from .perrank import update_print
from .replica import KEPT_BACK, Arena, KeptBack, SteppedReplica, tree_of

RESYNC_EVERY = 100  # --replicas under DDP: steps between the thin replica's shipments (`_stepped`)


class LowDiffPlusHandler(EngineHandler):
    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        torch.set_num_threads(1)  # the update runs beside training: one core (paper §VII-B)
        classes = optimizer_classes()
        self.own = KeptBack(SteppedReplica(classes, self._arena), owned=False,  # (diffs kept back only with
                            done=self._done)  # --replicas)
        self.spare: list[bytearray] = []  # buffers of own diffs applied, to cut the next ones into
        self.pin_lock = threading.Lock()  # `pinned`: one partner's give-back at a time
        self.copies = PartnerReplicas(classes, lambda owner, layout: self._arena(layout, f"copy{owner}."),
                                      self.own.newest, self._state_at)
        self.generation = 0
        self.step_time = StepClock()  # of the steps' snapshots (--replicas: their copies wait one step's time)
        self.due: set[int] = set()  # steps to write once the replica stands at them (--replicas: deferred)
        self.exact = True  # (Base.exact)
        self.persist_buf: torch.Tensor | None = None  # one buffer, reused by every write
        self.replicated: list[int] = []  # (Base.replicated: what one rank writes under DDP)
        self.shared: list[int] = []  # (Base.shared: what every rank writes, named in the index)
        self.idle = threading.Event()  # no write of the persist buffer in flight
        self.idle.set()

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
            self.due.add(step)
        now = fault or isinstance(msg, Base) or self.ctx.replicas is None or msg.final  # (else: kept back)
        self.own.apply(float("inf") if now else self.copies.newest(), self._stepped)
        self._written(self.own.stepped.step)

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
        self._written(step)
        if self.ctx.replicas is not None and self.thin:
            self.copies.own_at(step, lambda: self.own.stepped.sums(self._replicated_keys()),
                               keep=step % RESYNC_EVERY == 0)

    def _written(self, step: int) -> None:
        """The replica stands at `step`: written if it is due."""
        if step in self.due:
            self.due.discard(step)
            self._persist()

    def _state_at(self, step: int) -> dict | None:
        """The replica's full state, if it stands at `step`."""
        return self.own.stepped.replica.full_state() if self.own.stepped.step == step else None

    def _forget(self) -> None:
        """Drop the diffs kept back and the writes due (the replica starts anew)."""
        self.own.clear()
        self.due.clear()
        self.step_time.reset()
        self.copies.forget_own()

    def _based(self, replicated: list[int], shared: list[int], exact: bool) -> None:
        """Take a base's DDP facts; `thin`: every optimizer parameter is data-parallel (the
        short-cut of perrank.py applies), known once the replica holds the base."""
        self.replicated, self.shared, self.exact = replicated, shared, exact
        self._forget()

    @property
    def thin(self) -> bool:
        r = self.own.stepped.replica
        return r is not None and bool(self.shared) and \
            sorted(self.shared) == list(range(len(r.meta["optimizers"]["optimizer"]["params"])))

    def _replicated_keys(self) -> list[str]:
        """The keys of the replica's tensors every data-parallel rank holds alike."""
        r = self.own.stepped.replica
        return writeonce.shared_keys(r.full_state(), self.shared, r.meta["optimizers"]["optimizer"]["params"])

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
        spec = dataclasses.replace(msg.spec, kind="diff", meta=self._diff_meta(msg.spec))  # (the trainer's
        view = self.ctx.slot_view(msg.slot)[: _extent(spec)]  # names a record)
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

    def _diff_meta(self, spec: RecordSpec) -> dict:
        """A diff's index meta: under the short-cut its gradients named shared (left out of what
        partners get: theirs are the same)."""
        if not self.thin:
            return spec.meta
        return {**spec.meta, "shared": [g[TENSOR] for g in spec.skeleton["grads"] if g is not None]}

    def _expect(self) -> None:
        """Partners' thin whole replicas may come now: the replica's shared xxh3 are taken at
        the next few steps, from this one (copies.py, `expect`)."""
        if self.thin:
            self.copies.expect()
            self._stood(self.own.stepped.step)

    def _whole(self) -> HeldCopy:
        """The replica whole, for partners to step their copies of it from (thin: without the
        state every data-parallel rank holds alike)."""
        meta = self._made()
        if self.thin:
            meta["shared"] = self._replicated_keys()
        return self.own.stepped.copy(self.ctx.rank, meta, thin=self.thin)

    def _made(self) -> dict:
        """A whole replica's index meta: how its Base made it (REPLICA_META)."""
        return {REPLICA_META: {"exact": self.exact, "replicated": self.replicated, "shared": self.shared}}

    def _persist(self) -> None:
        """Copy the arena into the persist buffer (waiting for the previous write) and queue its
        write as the full record of the replica's step; under DDP, without the replicated tensors
        another rank writes (storage/writeonce.py)."""
        r, arena = self.own.stepped.replica, self.own.stepped.arena
        self.idle.wait()
        skeleton, layout, tensors = r.skeleton, arena.layout, None
        aliases = r.meta["optimizers"]["optimizer"]["params"]
        state = r.full_state() if self.replicated or self.shared else {}  # (read only under DDP)
        if self.replicated:
            skeleton, tensors = writeonce.split_state(state, self.replicated, aliases, self.ctx.rank,
                                                      self.ctx.world_size)
            layout = Layout.of(tensors)
        if self.persist_buf is None or self.persist_buf.numel() < layout.nbytes:
            self.persist_buf = torch.empty(layout.nbytes, dtype=torch.uint8)
            self.ctx.emit(type="replica_buffer", rank=self.ctx.rank, nbytes=layout.nbytes)
        with torch.no_grad():
            if tensors is None:
                self.persist_buf[: layout.nbytes].copy_(arena.buf)
            else:
                for s in layout.specs:
                    view(self.persist_buf, s).copy_(tensors[s.key])
        meta = {**writeonce.with_shared_keys(r.meta, state, self.shared, aliases), "step": r.step,
                "snapshot_time": r.time}
        spec = RecordSpec(record=full_name(r.step), kind="full", step=r.step, skeleton=skeleton,
                          tensors={s.key: s.to_json() for s in layout.specs}, meta=meta)
        self.idle.clear()
        self.ctx.run(self._write, spec, memoryview(self.persist_buf.numpy())[: layout.nbytes])

    def _write(self, spec: RecordSpec, data: memoryview) -> None:
        try:
            self.ctx.write_now(spec, data)
        finally:
            self.idle.set()

    def flush(self) -> None:
        self.idle.wait()

    def close(self) -> None:
        """Its worker came back as another rank: the replica is the old rank's state. Dropped (a
        new handler starts from the new rank's records), and the copies of its partners' too."""
        self.restart()
        self._forget()
        self.own.stepped.drop()
        self.copies.close()

    def give_up(self, rank: int) -> list[HeldCopy]:
        """The replica and each partner's copy, stood at the newest step all of them can stand
        at and cut whole: the ranks of the next round resume from memory at that one step. A
        copy that fails its checks is left out (its rank resumes from its records), said in one
        line; nothing where they share no step."""
        with self.pin_lock:
            common = set(self.own.steps())
            for owner in list(self.copies.owners):
                common &= set(self.copies.whole_steps(owner, common))
            if not common:
                return []
            step = max(common)
            self._stand_at(step)
            cuts = [self.own.stepped.copy(rank, self._made())]
            for owner in list(self.copies.owners):
                try:
                    cuts.append(self.copies.whole(owner, step, None))
                except CorruptCheckpoint as e:
                    log.warning(f"rank {rank}: its copy of rank {owner}'s replica at step {step} is left behind ({e})")
            return cuts

    def held(self) -> list[tuple[int, int]]:
        return [(s, self.own.stepped.arena.nbytes) for s in self.own.steps()]

    def fetch(self, step: int | None = None) -> dict:
        """The replica at `step` (None: the newest held): the diffs kept back are applied up to
        it, the newer ones dropped (the worker sends those steps' diffs again)."""
        self._stand_at(self.own.newest() if step is None else step)
        self.due.clear()
        self.step_time.reset()
        r, arena = self.own.stepped.replica, self.own.stepped.arena
        self.ctx.emit(type="replica_fetch", rank=self.ctx.rank, step=r.step, nbytes=arena.nbytes)
        return {"step": r.step, "path": str(arena.file.path), "skeleton": r.skeleton,
                "tensors": {k: s.to_json() for k, s in arena.specs.items()}, "exact": r.exact or r.real}

    # ---- engine.replicate.HeldMemory ------------------------------------------------------
    def replication(self) -> tuple[Any, PartnerReplicas]:
        return self, self.copies

    def held_steps(self) -> list[int]:
        return [s for s, _ in self.held()]

    @contextlib.contextmanager
    def pinned(self, step: int) -> Iterator[tuple[RecordSpec, memoryview] | None]:
        """The replica at `step`, standing there (the ranks resume from it), to complete a
        partner's thin copy of that step (`_state_at`); None if it cannot stand there. One at a
        time: partners given copies back at once (the replicator's threads) do not step the
        replica under each other; one that asks for an older step gets None."""
        with self.pin_lock:
            if step not in self.own.steps():
                yield None
                return
            self._stand_at(step)
            yield self.own.stepped.spec(), memoryview(self.own.stepped.arena.buf.numpy())

    def _stand_at(self, step: int) -> None:
        """Stand the replica at `step`: the diffs kept back applied up to it, newer ones dropped
        (and their prints: the worker sends those steps again)."""
        self.own.stand_at(step, self._stood)
        self.copies.own_dropped(step)

    def install(self, spec: RecordSpec, data: bytes | bytearray) -> None:
        """Hold the replica of `spec` a partner gave back (a replaced node's engine, before its
        worker's Hello is answered), as a re-base."""
        what = f"the replica of step {spec.step} given back"
        extra = replica_meta(spec.meta, what)
        self._based(extra["replicated"], extra["shared"], extra["exact"])
        meta = {k: v for k, v in spec.meta.items() if k not in (REPLICA_META, "shared")}
        spec = RecordSpec(record=spec.record, kind=spec.kind, step=spec.step, skeleton=spec.skeleton,
                          tensors=spec.tensors, meta=meta)
        self.own.stepped.rebase_from(spec, data, self.exact, what)


# At the engine's start (its `preload` imports this module): a replaced node's engine builds an
# optimizer for the replica a partner gives back before its worker's hello is answered, and a
# cold one took 1.9 s there.
warm_up_in_background()


def _extent(spec: RecordSpec) -> int:
    """The bytes of a slot that `spec`'s tensors lie in."""
    return max((t["offset"] + t["nbytes"] for t in spec.tensors.values()), default=0)
