"""Taking copies back and giving them back (engine/replicate.py), at a new round's exchange: a
replaced node's engine takes its rank's part of a record, or its steps held in memory, back
from the engine that holds them, checked whole; a holder gives back what it holds, made whole
with its own state where the copy is thin; a survivor keeps its worker's old rank's steps for
the node that has that rank now (`adopt`)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

from ..errors import CorruptCheckpoint
from ..ipc.messages import RecordSpec
from ..log import log
from ..storage.schema import rank_files
from ..storage.tiers.dpshared import parse, rebuild, shared_keys
from ..storage.tiers.memtier import MemoryTier
from ..storage.tiers.mirror import fill
from .held_copies import KEEP, HeldCopy, HeldMemory, checked, cut, spec_of
from .replica_round import FETCH, HELD, SEND_TIMEOUT_S, Round
from .replica_state import ReplicaState, files_of, short, steps_text


class Returns:
    """Copies going back to the rank they are of, and coming back to this one."""

    def __init__(self, state: ReplicaState) -> None:
        self.state = state

    def adopt(self, rank: int, memory: HeldMemory, given_up: list[HeldCopy]) -> None:
        """The worker came back as another rank (the rendezvous ranked the nodes anew): the steps
        `memory` holds of its old `rank` are cut whole before the engine lets go of them, for the
        next round's exchange, beside what its handler gave up whole (`given_up`: lowdiff+'s
        replica and its copies of partners'). There the node that has that rank now takes them
        back; they complete this node's copies of its new rank (the shared tensors of a thin copy
        are every data-parallel rank's alike), or are that rank's own (`_own_copy`). Dropped
        once the exchange is done."""
        adopted = list(given_up)
        for step in sorted(memory.held_steps(), reverse=True):
            with memory.pinned(step) as got:
                if got is not None:
                    adopted.append(cut(rank, *got, thin=False))
        with self.state.lock:
            self.state.adopted = adopted

    # ---- steps held in memory -----------------------------------------------------------
    @contextlib.contextmanager
    def own_state(self, step: int) -> Iterator[Callable[[str, memoryview], int] | None]:
        """A reader of this engine's own state of `step` (`HeldCopies.whole`'s `own`): held in
        memory, or adopted from its worker's old rank; None if neither."""
        with self.state.memory.pinned(step) as got:
            if got is None:
                got = next(((spec_of(c), memoryview(c.data)) for c in self.state.adopted if c.step == step), None)
            yield None if got is None else reader(*got)

    def give_back_held(self, r: Round, owner: int, step: int) -> None:
        """Send `owner` the copy of its `step`: adopted whole, or made whole with this engine's
        own state of it."""
        def whole() -> tuple[list[bytes | bytearray], int]:
            for c in self.state.adopted:
                if c.index.rank == owner and c.step == step:
                    return c.blobs(), HELD
            with self.own_state(step) as own:
                return self.state.copies.whole(owner, step, own).blobs(), HELD

        self._send_back(r, owner, f"its step {step}", whole)

    def take_back_own(self, r: Round, steps: list[int]) -> list[int]:
        """The rendezvous gave this node a partner's rank, whose copies it holds: hold the newest
        of `steps` (as many as the memory keeps) again, made whole and checked, before the
        worker's Hello is answered; the steps held."""
        t0, took = time.time(), []
        for step in sorted(steps)[-KEEP:]:
            try:
                copy = self._own_copy(r.rank, step)
                self.state.memory.install(spec_of(copy), copy.data)
            except CorruptCheckpoint as e:
                log.warning(f"rank {r.rank}: step {step}, held in this engine's copy of rank {r.rank}, did not "
                            f"come back ({short(e)})")
                self.state.log.emit(type="replica_error", rank=r.rank, error=short(e))
                continue
            took.append(step)
            self.state.log.emit(type="replica_restored", rank=r.rank, step=step, holder=r.rank, held=True,
                                bytes=len(copy.data), seconds=time.time() - t0)
        if took:
            log.info(f"rank {r.rank}: step(s) {steps_text(took)} taken back from this engine's own copies of rank "
                     f"{r.rank} (the rendezvous gave this node the rank) in {time.time() - t0:.2f} s")
        return took

    def _own_copy(self, rank: int, step: int) -> HeldCopy:
        """`rank`'s `step` whole and checked, from this engine's copies of it: one its old
        handler gave up whole (`adopt`), or one it keeps, made whole with its own state."""
        adopted = next((c for c in self.state.adopted if c.index.rank == rank and c.step == step), None)
        if adopted is not None:
            return checked(rank, *adopted.blobs(), thin=False)
        with self.own_state(step) as own:
            return checked(rank, *self.state.copies.whole(rank, step, own).blobs(), thin=False)

    def take_back_held(self, r: Round, holder: int, step: int) -> None:
        """Hold this rank's `step` again, from `holder`'s copy, checked whole."""
        t0 = time.time()
        try:
            got = r.recv(holder, FETCH, SEND_TIMEOUT_S)
            if got is None or got[0] != r.rank or got[1] != HELD:
                raise CorruptCheckpoint(f"rank {holder} sent no whole copy of it")
            copy = checked(r.rank, *got[2], thin=False)
            if copy.step != step:
                raise CorruptCheckpoint(f"rank {holder} sent step {copy.step}")
            self.state.memory.install(spec_of(copy), copy.data)
        except (CorruptCheckpoint, RuntimeError, OSError) as e:
            log.warning(f"rank {r.rank}: step {step}, held in rank {holder}'s memory, did not come back "
                        f"({short(e)}); resuming from --dir")
            self.state.log.emit(type="replica_error", rank=r.rank, error=short(e))
            return
        took = time.time() - t0
        log.info(f"rank {r.rank}: step {step} taken back from rank {holder}'s memory into this engine's in "
                 f"{took:.2f} s (held in memory only)")
        self.state.log.emit(type="replica_restored", rank=r.rank, step=step, holder=holder, held=True,
                            bytes=len(copy.data), seconds=took)

    # ---- parts of committed records -----------------------------------------------------
    def take_back(self, r: Round, holder: int, name: str) -> None:
        """Complete record `name` in --dir with this rank's part from `holder`'s memory (this
        engine's own, where the rendezvous gave it the rank whose copy it held), checked; a
        node-local --dir that lost the record gets it back with its manifest."""
        t0 = time.time()
        try:
            tier = _tier(f"rank {holder}'s memory", r.rank, *(self._whole(r.rank) if holder == r.rank
                                                               else self._received(r, holder)))
            # (every tensor was checked as the copy arrived, and the worker checks them as it reads)
            copied = fill(tier, self.state.store, name, [r.rank], checksums=False)
        except CorruptCheckpoint as e:
            log.warning(f"rank {r.rank}: the copy rank {holder} held is damaged ({short(e)}); resuming "
                        "from --dir")
            self.state.log.emit(type="replica_error", rank=r.rank, error=short(e))
            return
        took, step = time.time() - t0, tier.owners[r.rank][1]
        log.info(f"rank {r.rank}: step {step} taken back from rank {holder}'s memory in {took:.2f} s "
                 f"({', '.join(copied)})")
        self.state.log.emit(type="replica_restored", rank=r.rank, step=step, holder=holder, files=copied,
                            bytes=sum(len(tier.objects[f"{name}/{f}"]) for f in copied), seconds=took)

    def _received(self, r: Round, holder: int) -> tuple[bytes, dict[str, bytes]]:
        """(manifest, files) of the copy of this rank's part `holder` sends back, whole."""
        got = r.recv(holder, FETCH, SEND_TIMEOUT_S)
        if got is None or got[0] != r.rank or got[1] != 0:
            raise CorruptCheckpoint(f"rank {holder} sent no whole copy of rank {r.rank}")
        manifest, *files = got[2]
        return manifest, files_of(r.rank, files)

    def give_back(self, r: Round, owner: int) -> None:
        """Send `owner` the copy of a record held for it, whole."""
        def whole() -> tuple[list[bytes | bytearray], int]:
            manifest, files = self._whole(owner)
            return [manifest, *files.values()], 0

        self._send_back(r, owner, "its copy", whole)

    def _send_back(self, r: Round, owner: int, what: str,
                   whole: Callable[[], tuple[list[bytes | bytearray], int]]) -> None:
        """Send `owner` the copy `whole()` makes ([blobs], flags); if it cannot be made, say so
        to it at once (STOP), so that it resumes from --dir without waiting."""
        try:
            blobs, flags = whole()
        except (CorruptCheckpoint, OSError, KeyError) as e:
            log.warning(f"rank {r.rank}: cannot give rank {owner} {what} back ({short(e)})")
            self.state.log.emit(type="replica_error", rank=r.rank, partner=owner, error=short(e))
            with contextlib.suppress(RuntimeError):
                r.stop(owner, FETCH)
            return
        with contextlib.suppress(RuntimeError):  # it died again: it resumes without
            r.send(owner, FETCH, owner, blobs, flags)

    def _whole(self, owner: int) -> tuple[bytes, dict[str, bytes]]:
        """(manifest, files) of the copy held for `owner`; a thin one with its shared tensors read
        from this node's own part of the same record (kept in --dir while the copy is held)."""
        held = self.state.held
        with self.state.lock:
            part, thin = held.part(owner), owner in held.thin
            name = held.owners[owner][0] if part is not None else ""
        if part is None:
            raise CorruptCheckpoint(f"no copy of rank {owner} is held")
        manifest, files = part
        if not thin:
            return part
        data_file, index_file = rank_files(owner)
        store = self.state.store
        peers = [p for p in store.ranks_present(name) if p != owner] if store.is_committed(name) else []
        if not peers:
            raise CorruptCheckpoint(f"{store.root} holds no data-parallel peer's part of {name} to complete it")
        own_index, fd, base = store.open_rank(store.manifest(name), peers[0])
        try:
            own = own_index["tensors"]

            def peer(key: str, into: memoryview) -> int:
                t = own.get(key)
                return os.preadv(fd, [into], base + t["offset"]) if t and t["nbytes"] == len(into) else -1

            index = parse(files[index_file], f"{name}: rank {owner}'s copy")
            data = rebuild(files[data_file], index, shared_keys(index), peer)
        finally:
            os.close(fd)
        return manifest, {data_file: data, index_file: files[index_file]}


def reader(spec: RecordSpec, view: memoryview) -> Callable[[str, memoryview], int]:
    """`rebuild`'s `peer`: a tensor of this engine's own held state of the same step, by key."""
    def read(key: str, into: memoryview) -> int:
        t = spec.tensors.get(key)
        if t is None or t["nbytes"] != len(into):
            return -1
        into[:] = view[t["offset"] : t["offset"] + t["nbytes"]]
        return len(into)

    return read


def _tier(what: str, owner: int, manifest: bytes, files: dict[str, bytes]) -> MemoryTier:
    """A tier holding rank `owner`'s copy (`files` of the record `manifest` commits), checked."""
    tier = MemoryTier(what)
    tier.hold(owner, manifest, files)
    return tier
