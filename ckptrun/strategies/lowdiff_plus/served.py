"""lowdiff+'s replica as others ask for it (engine.py): a restarted worker resumes from it
(`fetch`), and the replicator (engine/replicate.py) reads it to complete a partner's thin copy,
installs one a partner gave back, and takes it and the partners' copies whole when the worker
comes back as another rank (`give_up`). Each of them stands the replica at the step asked for."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from ...engine.handlers import EngineContext
from ...engine.held_copies import HeldCopy
from ...engine.step_clock import StepClock
from ...errors import CorruptCheckpoint
from ...ipc.messages import RecordSpec
from ...log import log
from .copies import REPLICA_META, PartnerReplicas, replica_meta
from .facts import BaseFacts
from .persist import ReplicaWriter
from .replica import KeptBack


class ServedReplica:
    """The replica and the partners' copies, stood at a step and handed out (engine/held_copies.py's
    `HeldMemory` for the replicator)."""

    def __init__(self, ctx: EngineContext, own: KeptBack, copies: PartnerReplicas, facts: BaseFacts,
                 writer: ReplicaWriter, step_time: StepClock, stood: Callable[[int], None],
                 based: Callable[[list[int], list[int], bool], None]) -> None:
        self.ctx, self.own, self.copies, self.facts = ctx, own, copies, facts
        self.writer, self.step_time = writer, step_time
        self.stood = stood  # the handler's: the replica stands at a step
        self.based = based  # the handler's: a base's DDP facts taken
        self.pin_lock = threading.Lock()  # `pinned`: one partner's give-back at a time

    # ---- the worker ---------------------------------------------------------------------
    def held(self) -> list[tuple[int, int]]:
        return [(s, self.own.stepped.arena.nbytes) for s in self.own.steps()]

    def fetch(self, step: int | None = None) -> dict:
        """The replica at `step` (None: the newest held): the diffs kept back are applied up to
        it, the newer ones dropped (the worker sends those steps' diffs again)."""
        self.stand_at(self.own.newest() if step is None else step)
        self.writer.due.clear()
        self.step_time.reset()
        r, arena = self.own.stepped.replica, self.own.stepped.arena
        self.ctx.emit(type="replica_fetch", rank=self.ctx.rank, step=r.step, nbytes=arena.nbytes)
        return {"step": r.step, "path": str(arena.file.path), "skeleton": r.skeleton,
                "tensors": {k: s.to_json() for k, s in arena.specs.items()}, "exact": r.exact or r.real}

    # ---- the replicator: engine.held_copies.HeldMemory ----------------------------------
    def held_steps(self) -> list[int]:
        return [s for s, _ in self.held()]

    @contextlib.contextmanager
    def pinned(self, step: int) -> Iterator[tuple[RecordSpec, memoryview] | None]:
        """The replica at `step`, standing there (the ranks resume from it), to complete a
        partner's thin copy of that step (the handler's `_state_at`); None if it cannot stand
        there. One at a time: partners given copies back at once (the replicator's threads) do
        not step the replica under each other; one that asks for an older step gets None."""
        with self.pin_lock:
            if step not in self.own.steps():
                yield None
                return
            self.stand_at(step)
            yield self.own.stepped.spec(), memoryview(self.own.stepped.arena.buf.numpy())

    def stand_at(self, step: int) -> None:
        """Stand the replica at `step`: the diffs kept back applied up to it, newer ones dropped
        (and their prints: the worker sends those steps again)."""
        self.own.stand_at(step, self.stood)
        self.copies.own_dropped(step)

    def install(self, spec: RecordSpec, data: bytes | bytearray) -> None:
        """Hold the replica of `spec` a partner gave back (a replaced node's engine, before its
        worker's Hello is answered), as a re-base."""
        what = f"the replica of step {spec.step} given back"
        extra = replica_meta(spec.meta, what)
        self.based(extra["replicated"], extra["shared"], extra["exact"])
        meta = {k: v for k, v in spec.meta.items() if k not in (REPLICA_META, "shared")}
        spec = RecordSpec(record=spec.record, kind=spec.kind, step=spec.step, skeleton=spec.skeleton,
                          tensors=spec.tensors, meta=meta)
        self.own.stepped.rebase_from(spec, data, self.facts.exact, what)

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
            self.stand_at(step)
            cuts = [self.own.stepped.copy(rank, self.facts.made())]
            for owner in list(self.copies.owners):
                try:
                    cuts.append(self.copies.whole(owner, step, None))
                except CorruptCheckpoint as e:
                    log.warning(f"rank {rank}: its copy of rank {owner}'s replica at step {step} is left behind ({e})")
            return cuts
