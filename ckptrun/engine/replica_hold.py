"""Holding what partners ship (engine/replicate.py): one receiving thread per partner, each copy
checked before it is held (a partner's copy is untrusted input), said in the metrics and for
`ls`, and the oldest step held for every partner told to the engine (--node-local-dir prunes
nothing newer)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from ..errors import CorruptCheckpoint
from ..log import log
from ..storage import memory_status
from ..storage.schema import rank_files
from ..storage.tiers.dpshared import parse
from ..storage.tiers.memtier import MemoryTier
from .held_copies import checked, flipped
from .replica_round import HELD, SHIP, THIN, Round
from .replica_state import ReplicaState, files_of, short


class Holder:
    """The copies this engine receives and holds for its partners."""

    def __init__(self, state: ReplicaState) -> None:
        self.state = state
        self.on_held: Callable[[int], None] | None = None  # called by `_say_held`

    def start(self, r: Round) -> None:
        """Receive `r`'s partners' copies, each on a thread of its own, until the round ends."""
        for p in r.partners:
            t = threading.Thread(target=self.receive, args=(r, p), name=f"ckptrun-replicas-from-{p}", daemon=True)
            r.threads.append(t)
            t.start()

    def receive(self, r: Round, src: int) -> None:
        """Hold each copy `src` ships, until it says STOP (it left the round) or its connection
        breaks (it died: no more copies go to it either). A copy that cannot be held, for
        whatever reason, is refused in one line and the next one received: this thread never
        ends silently while its partner goes on shipping."""
        while True:
            try:
                got = r.recv(src, SHIP, on_manifest=self.state.faults.receiving)
            except (RuntimeError, ValueError, KeyError, TypeError, CorruptCheckpoint) as e:
                self.state.drop(r, src, e)
                return
            if got is None:
                r.live.discard(src)
                return
            owner, flags, blobs = got
            try:
                if owner != src:
                    raise CorruptCheckpoint(f"rank {src} sent a copy of rank {owner}")
                (self._hold_copy if flags & HELD else self._hold_record)(r, owner, flags, blobs)
            except Exception as e:  # noqa: BLE001 - a partner's copy is untrusted input: any failure refuses it
                if not isinstance(e, CorruptCheckpoint):
                    e = CorruptCheckpoint(f"{type(e).__name__}: {short(e)}")
                log.warning(f"rank {r.rank}: refused rank {src}'s copy ({short(e)}); keeping what it holds")
                self.state.log.emit(type="replica_error", rank=r.rank, partner=src, error=short(e))

    def _hold_record(self, r: Round, owner: int, flags: int, blobs: list[bytes]) -> None:
        """Keep `owner`'s copy of its part of a record, once checked (else CorruptCheckpoint)."""
        manifest, *files = blobs
        state = self.state
        with state.lock:
            m = state.held.hold(owner, manifest, files_of(owner, files), thin=bool(flags & THIN))
            if m is None:
                return
            if state.faults.corrupts(m.step):
                _damage(state.held, owner)
        self._said_held(r, owner, m.step, sum(map(len, files)), memory_status.COPIES)
        self._say_held(r)

    def _hold_copy(self, r: Round, owner: int, flags: int, blobs: list[bytes]) -> None:
        """Keep `owner`'s copy of a step it holds in memory, once checked (else CorruptCheckpoint)."""
        copy = checked(owner, *blobs, thin=bool(flags & THIN))
        state = self.state
        with state.lock:
            if not state.copies.hold(owner, copy, damage=state.faults.corrupts(copy.step)):
                return
        self._said_held(r, owner, copy.step, len(copy.data) + len(copy.raw_index), memory_status.HELD_COPIES)

    def _said_held(self, r: Round, owner: int, step: int, nbytes: int, of: str) -> None:
        """A copy of `owner`'s `step` is held: in the metrics, and for `ls` (`of` its status file)."""
        self.state.log.emit(type="replica_held", rank=r.rank, owner=owner, step=step, bytes=nbytes,
                            **({"held": True} if of == memory_status.HELD_COPIES else {}))
        with contextlib.suppress(OSError):  # (only `ls` misses it; of the run's own --dir only)
            self.state.store.check_owned()
            memory_status.publish(self.state.store.root, owner, step, nbytes, of=of)

    def _say_held(self, r: Round) -> None:
        """Tell `on_held` the oldest step among the copies held for this round's partners, once
        each partner's is held (--node-local-dir: no node prunes that step or a newer one)."""
        held = self.state.held
        with self.state.lock:
            steps = [held.owners[p][1] for p in r.partners if p in held.owners]
        if self.on_held is not None and len(steps) == len(r.partners):
            self.on_held(min(steps))

    def held_records(self) -> list[str]:
        """The records of the copies held for partners (--node-local-dir: this node keeps its own
        parts of them, which a partner's node coming back from them resumes beside)."""
        with self.state.lock:
            return [name for name, _ in self.state.held.owners.values()]

    def keep(self, partners: list[int]) -> None:
        """Let the copies of ranks not among `partners` go (the rendezvous ranked the nodes anew):
        an engine holds its K-1 partners' copies, no more."""
        state = self.state
        with state.lock:
            for held, of in ((state.held, memory_status.COPIES), (state.copies, memory_status.HELD_COPIES)):
                for owner in [o for o in held.owners if o not in partners]:
                    held.forget(owner)
                    memory_status.withdraw(state.store.root, owner, of=of)

    def withdraw(self) -> None:
        """`ls` no longer lists the copies this engine holds (it closes)."""
        state = self.state
        if state.store is None:
            return
        for owner in list(state.held.owners):
            memory_status.withdraw(state.store.root, owner, of=memory_status.COPIES)
        for owner in list(state.copies.owners):
            memory_status.withdraw(state.store.root, owner, of=memory_status.HELD_COPIES)


def _damage(held: MemoryTier, owner: int) -> None:
    """The injected fault `corrupt-replica` (`ReplicaFaults.corrupts`) on the copy of `owner`'s
    part of a record, just held: a bit flips after its checks."""
    name = held.owners[owner][0]
    data_file, index_file = rank_files(owner)
    index = parse(held.objects[f"{name}/{index_file}"], name)
    held.objects[f"{name}/{data_file}"] = flipped(held.objects[f"{name}/{data_file}"], index, owner in held.thin)
