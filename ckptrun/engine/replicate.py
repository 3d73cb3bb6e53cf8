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
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from ..errors import CkptrunError, CorruptCheckpoint
from ..faults import Fault, die
from ..ipc.events import EventLog
from ..ipc.messages import RecordSpec
from ..log import log
from ..storage import memory_status
from ..storage.fsutil import json_bytes
from ..storage.schema import (
    MAX_FILE_BYTES,
    MAX_METADATA_BYTES,
    MAX_WORLD_SIZE,
    Manifest,
    checksum,
    rank_files,
)
from ..storage.store import Store
from ..storage.tiers.dpshared import parse, rebuild, shared_keys
from ..storage.tiers.group import ReplicationGroup
from ..storage.tiers.memtier import MemoryTier
from ..storage.tiers.mirror import fill
from ..storage.tiers.parts import rank_part, thin_part, thin_rank_part
from .held_copies import KEEP, HeldCopies, HeldCopy, HeldMemory, PartnerCopies, checked, cut, flipped, spec_of
from .round_board import Board

SHIP, FETCH = 1, 2  # gloo tags: a new copy for a partner; a copy sent back to its owner
THIN, HELD = 1, 2  # a copy's flags: its data lacks the shared tensors; it is of a step held in memory only
FORM_TIMEOUT_S = 60.0  # the round's engines meeting (all of them start their worker after rendezvous)
SEND_TIMEOUT_S = 30.0  # one copy to one partner; past it the partner counts as stalled
STOP = -1  # a header that ends the partner's receiving thread (a new round begins)
HEADER = 5  # int64s of a copy's first message: owner, flags, bytes of its manifest (or header), data and index
FRESH_KEPT = 4  # thin copies cut as their parts were written, waiting for their records to commit
OUTBOX_KEPT = 8  # `offer_copy`'s copies waiting to be shipped, at most
MAX_SHIP_WAIT_S = 1.0  # an engine waits for its previous copy to leave one step's time, at most this


class Round:
    """One rendezvous round's process group and who this rank exchanges copies with."""

    def __init__(self, spec: dict, rank: int, world_size: int) -> None:
        import torch.distributed as dist

        self.key, self.rank, self.world_size = spec["prefix"], rank, world_size
        self.group = ReplicationGroup(world_size // spec["local"], spec["local"], spec["replicas"], spec["jump"])
        self.partners = self.group.partners(rank)
        tcp = dist.TCPStore(spec["addr"], spec["port"], is_master=False,
                            timeout=timedelta(seconds=FORM_TIMEOUT_S))
        self.store = dist.PrefixStore(f"{spec['prefix']}/replicas", tcp)
        self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timedelta(seconds=FORM_TIMEOUT_S))
        self.live = set(self.partners)  # partners not (yet) found dead or stalled
        self.threads: list[threading.Thread] = []  # receiving partners' copies

    def board(self, name: str) -> Board:
        """Exchange `name`'s keys in the round's job store."""
        return Board(self.store, self.rank, self.world_size, name, FORM_TIMEOUT_S)

    def send(self, dst: int, tag: int, owner: int, blobs: list[bytes | bytearray], flags: int = 0) -> None:
        """Send one copy: `blobs` = [manifest, data file, index] of rank `owner`'s part, or
        [header, data, index] of a step it holds (`flags` HELD; THIN: its data lacks the shared
        tensors, storage/tiers/dpshared.py). Three messages, whatever its size: a header of
        sizes, the manifest and index together, the data (a per-step thin copy's messages cost
        the engines more CPU in gloo than its bytes do)."""
        import torch

        manifest, data, index = blobs
        head = torch.tensor([owner, flags, len(manifest), len(data), len(index)], dtype=torch.int64)
        for t in [head, _bytes_tensor(bytearray(manifest) + index), *([_bytes_tensor(data)] if data else [])]:
            self.pg.send([t], dst, tag).wait(timedelta(seconds=SEND_TIMEOUT_S))

    def stop(self, dst: int, tag: int = SHIP) -> None:
        """No (more) copies to `dst` on `tag`."""
        import torch

        head = torch.tensor([STOP, 0, 0, 0, 0], dtype=torch.int64)
        self.pg.send([head], dst, tag).wait(timedelta(seconds=2))

    def close(self) -> None:
        """End the group: receives still waiting (a partner that never said STOP) fail now, and
        their threads end, rather than abort the process at exit."""
        with contextlib.suppress(RuntimeError):
            self.pg.abort()
        for t in self.threads:
            t.join(timeout=5)

    def recv(self, src: int, tag: int, timeout: float | None = None,
             on_manifest: Callable[[bytes], None] | None = None) -> tuple[int, int, list[bytes]] | None:
        """(owner, flags, [manifest, data, index]) of the next copy from `src`; None: it said STOP.
        The sizes are checked before anything is allocated; `on_manifest` sees the manifest
        before the data is received."""
        import torch

        wait = timedelta(seconds=timeout) if timeout else timedelta(days=365)
        head = torch.empty(HEADER, dtype=torch.int64)
        self.pg.recv([head], src, tag).wait(wait)
        owner, flags, n_manifest, n_data, n_index = head.tolist()
        if owner == STOP:
            return None
        if not (0 <= owner < MAX_WORLD_SIZE and 0 <= flags <= THIN | HELD and 0 < n_manifest <= MAX_METADATA_BYTES
                and 0 < n_index <= MAX_METADATA_BYTES and 0 <= n_data <= MAX_FILE_BYTES):
            raise CorruptCheckpoint(f"rank {src} sent a copy header out of range ({head.tolist()})")
        meta = self._recv_bytes(src, tag, n_manifest + n_index, wait)
        manifest, index = meta[:n_manifest], meta[n_manifest:]
        if on_manifest is not None:
            on_manifest(manifest)
        return owner, flags, [manifest, self._recv_bytes(src, tag, n_data, wait), index]

    def _recv_bytes(self, src: int, tag: int, n: int, wait: timedelta) -> bytes:
        import torch

        if n == 0:
            return b""
        buf = torch.empty(n, dtype=torch.uint8)
        self.pg.recv([buf], src, tag).wait(wait)
        return bytearray(buf.numpy())  # (writable: lowdiff+'s copies step tensors over it)


def _bytes_tensor(b: bytes | bytearray) -> Any:
    """`b` as a uint8 tensor (a bytearray shared, not copied)."""
    import torch

    return torch.frombuffer(b if isinstance(b, bytearray) else bytearray(b), dtype=torch.uint8)


class Replicator:
    """This engine's side of the replicated memory tier (see the module docstring)."""

    def __init__(self, events: EventLog) -> None:
        self.log = events
        self.held = MemoryTier("partner memory")
        self.copies: PartnerCopies = HeldCopies()  # partners' steps held in memory only (join's `copies`)
        self._snapshot_copies = self.copies
        self.memory: HeldMemory | None = None
        self._adopted: list[HeldCopy] = []  # this engine's steps of its worker's old rank (`adopt`)
        self.round: Round | None = None
        self.store: Store | None = None
        self.fault: Fault | None = None
        self.node_local = False
        self.on_held: Callable[[int], None] | None = None  # called by `_say_held`
        self._lock = threading.Lock()  # the round and the held copies
        self._offered: str | None = None  # the newest committed record not shipped yet
        self._offered_held: int | None = None  # the newest step held in memory not shipped yet
        self._shipping_held = False  # the shipping thread is sending one
        self._newest = -1  # the step of the newest record offered
        self._fresh: dict[str, tuple[bytes, bytes]] = {}  # record -> this rank's thin copy, cut as written
        self._outbox: deque[HeldCopy] = deque()  # `offer_copy`'s, shipped in order
        self._sending = 0  # of them, taken by the shipping thread and not sent yet
        self._full_due = True  # the next `offer_copy` must be whole (a new round, or copies dropped)
        self._wake = threading.Condition()
        self._closing = False
        self._shipper = threading.Thread(target=self._ship_loop, name="ckptrun-replicas", daemon=True)
        self._shipper.start()

    # ---- rounds ------------------------------------------------------------------------
    def join(self, spec: dict, rank: int, world_size: int, store: Store, fault: Fault | None, *,
             node_local: bool = False, memory: HeldMemory | None = None, copies: PartnerCopies | None = None) -> None:
        """A worker's Hello in round `spec` (the job store's address and prefix, K, J, local
        ranks per node): make the round's group with every other engine, exchange copies a
        replaced node lacks, then receive partners' new copies. `node_local`: --dir is this
        node's own, so a record it lost comes back whole (manifest and this rank's part).
        `memory`: the steps this engine holds in memory; `copies`: what it keeps of partners'
        (a snapshot strategy's copies by default). Never raises: replication off for the round
        is said in one line."""
        self.store, self.fault, self.node_local, self.memory = store, fault, node_local, memory
        self.copies = copies if copies is not None else self._snapshot_copies
        if self.round is not None and self.round.key == spec["prefix"] and self.round.rank == rank:
            return  # the same round (a worker restarted alone)
        self._end_round()
        with self._wake:
            self._newest = -1  # new partners may hold nothing yet: the next commit goes, whatever its step
            self._outbox.clear()
            self._full_due = True  # (and the next stepped copy whole)
        try:
            r = Round(spec, rank, world_size)
        except (CkptrunError, RuntimeError, ValueError) as e:
            log.warning(f"rank {rank}: replicas off for this round: the engines did not meet ({_short(e)})")
            self.log.emit(type="replica_error", rank=rank, error=_short(e))
            self._adopted = []
            return
        try:
            if self._exchange(r):
                self._keep_partners(r)
        except (RuntimeError, ValueError, CorruptCheckpoint, OSError) as e:
            log.warning(f"rank {rank}: copies not exchanged this round ({_short(e)}); resuming from --dir")
            self.log.emit(type="replica_error", rank=rank, error=_short(e))
        self._adopted = []  # (the exchange is over: what it did not give back is the records')
        with self._lock:
            self.round = r
        for p in r.partners:
            t = threading.Thread(target=self._recv_loop, args=(r, p), name=f"ckptrun-replicas-from-{p}", daemon=True)
            r.threads.append(t)
            t.start()

    def _keep_partners(self, r: Round) -> None:
        """Let the copies of ranks that are not this round's partners go, once the exchange has
        given them back (the rendezvous ranked the nodes anew): an engine holds its K-1
        partners' copies, no more."""
        with self._lock:
            for held, of in ((self.held, memory_status.COPIES), (self.copies, memory_status.HELD_COPIES)):
                for owner in [o for o in held.owners if o not in r.partners]:
                    held.forget(owner)
                    memory_status.withdraw(self.store.root, owner, of=of)

    def _end_round(self) -> None:
        """Tell the old round's partners to stop receiving (best effort: they may be dead)."""
        with self._lock:
            old, self.round = self.round, None
        if old is None:
            return
        for p in sorted(old.live):
            with contextlib.suppress(RuntimeError):
                old.stop(p)
        old.close()

    def _exchange(self, r: Round) -> bool:
        """Through the job store: what each engine holds of each rank, what each rank wants back
        and from whom (any engine that holds it: `Board`); then the wanted copies go back point
        to point (sends on threads, so no pair waits on the other). Steps held in memory first,
        then records. Whether every copy asked of this engine was sent."""
        sent = self._exchange_held(r)
        board = r.board("records")
        with self._lock:
            held = dict(self.held.owners)
        for owner, (name, step) in held.items():
            if owner != r.rank:
                board.post(f"for/{owner}", {"record": name, "step": step})
        board.sync("said")
        offers = [(d["step"], d["record"], d["from"]) for d in board.read(f"for/{r.rank}", ("step", "record"))]
        if r.rank in held:  # the rendezvous gave this node the rank whose copy it held
            offers.append((held[r.rank][1], held[r.rank][0], r.rank))
        return self._trade(r, board, self._wanted(r.rank, max(offers, default=None)),
                           give=lambda p, asked: self._give_back(r, p),
                           take=lambda want: self._take_back(r, want["holder"], want["record"])) and sent

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
        with self._lock:
            self._adopted = adopted

    def _exchange_held(self, r: Round) -> bool:
        """Each engine says which held steps of each rank it can give back whole (a thin copy
        needs its own state of the same step, or the old rank's it adopted); one that holds no
        step of its rank takes the newest ones back from its own copies, where the rendezvous
        gave it a rank it held copies of, else asks the engine that holds the newest of them (a
        partner, or any other), into its memory. Whether every copy asked of it was sent."""
        board = r.board("held")
        own = set(self.memory.held_steps()) if self.memory is not None else set()
        with self._lock:
            whole_at = own | {c.step for c in self._adopted}
            owners = {*self.copies.owners, *(c.index.rank for c in self._adopted)} - {r.rank}
            kept = {o: self.copies.steps(o) for o in owners}
            can = {o: self.copies.whole_steps(o, whole_at) for o in owners}
            for c in self._adopted:  # (whole: kept and given back alike)
                if c.index.rank in owners:
                    for said in (kept, can):
                        said[c.index.rank] = sorted({*said[c.index.rank], c.step}, reverse=True)
            snapshots = self.copies is self._snapshot_copies
            mine = [] if self.memory is None or own else sorted({
                *self.copies.whole_steps(r.rank, whole_at), *(c.step for c in self._adopted if c.index.rank == r.rank)})
        if mine:
            own = set(self._take_back_own(r, mine))
        for o in owners:
            board.post(f"for/{o}", {"kept": kept[o], "whole": can[o]})
        if own:
            board.post("own", {"steps": sorted(own)})
        board.sync("said")
        want = {}
        if self.memory is not None and not own:
            said = board.read(f"for/{r.rank}", ("kept", "whole"))
            held = [set(d["steps"]) for d in board.read("own", ("steps",))]  # (the surviving ranks' own steps)
            offers = [(s, d["from"]) for d in said for s in d["whole"] if all(s in h for h in held)]
            if offers:
                step, holder = max(offers)
                want = {"holder": holder, "step": step}
            elif copies := sorted({s for d in said for s in d["kept"]}):
                log.warning(f"rank {r.rank}: other engines hold copies of its steps {_steps(copies)} in memory, but "
                            "no longer their own state of those steps to complete them (they ran ahead); resuming "
                            "from --dir")
        self.log.emit(type="replica_exchange", rank=r.rank, holds=sorted(own),
                      kept={str(o): v for o, v in kept.items()}, whole={str(o): v for o, v in can.items()}, wants=want)
        sent = self._trade(r, board, want, give=lambda p, asked: self._give_back_held(r, p, asked["step"]),
                           take=lambda want: self._take_back_held(r, want["holder"], want["step"]), asks=("step",))
        with self._lock:  # (copies of its own rank, taken back or not, are of no use to this engine now)
            if snapshots and self.copies.owners.pop(r.rank, None) is not None:
                memory_status.withdraw(self.store.root, r.rank, of=memory_status.HELD_COPIES)
        return sent

    @contextlib.contextmanager
    def _own_state(self, step: int) -> Iterator[Callable[[str, memoryview], int] | None]:
        """A reader of this engine's own state of `step` (`HeldCopies.whole`'s `own`): held in
        memory, or adopted from its worker's old rank; None if neither."""
        with self.memory.pinned(step) as got:
            if got is None:
                got = next(((spec_of(c), memoryview(c.data)) for c in self._adopted if c.step == step), None)
            yield None if got is None else _reader(*got)

    def _give_back_held(self, r: Round, owner: int, step: int) -> None:
        """Send `owner` the copy of its `step`: adopted whole, or made whole with this engine's
        own state of it."""
        def whole() -> tuple[list[bytes | bytearray], int]:
            for c in self._adopted:
                if c.index.rank == owner and c.step == step:
                    return c.blobs(), HELD
            with self._own_state(step) as own:
                return self.copies.whole(owner, step, own).blobs(), HELD

        self._send_back(r, owner, f"its step {step}", whole)

    def _take_back_own(self, r: Round, steps: list[int]) -> list[int]:
        """The rendezvous gave this node a partner's rank, whose copies it holds: hold the newest
        of `steps` (as many as the memory keeps) again, made whole and checked, before the
        worker's Hello is answered; the steps held."""
        t0, took = time.time(), []
        for step in sorted(steps)[-KEEP:]:
            try:
                copy = self._own_copy(r.rank, step)
                self.memory.install(spec_of(copy), copy.data)
            except CorruptCheckpoint as e:
                log.warning(f"rank {r.rank}: step {step}, held in this engine's copy of rank {r.rank}, did not "
                            f"come back ({_short(e)})")
                self.log.emit(type="replica_error", rank=r.rank, error=_short(e))
                continue
            took.append(step)
            self.log.emit(type="replica_restored", rank=r.rank, step=step, holder=r.rank, held=True,
                          bytes=len(copy.data), seconds=time.time() - t0)
        if took:
            log.info(f"rank {r.rank}: step(s) {_steps(took)} taken back from this engine's own copies of rank "
                     f"{r.rank} (the rendezvous gave this node the rank) in {time.time() - t0:.2f} s")
        return took

    def _own_copy(self, rank: int, step: int) -> HeldCopy:
        """`rank`'s `step` whole and checked, from this engine's copies of it: one its old
        handler gave up whole (`adopt`), or one it keeps, made whole with its own state."""
        adopted = next((c for c in self._adopted if c.index.rank == rank and c.step == step), None)
        if adopted is not None:
            return checked(rank, *adopted.blobs(), thin=False)
        with self._own_state(step) as own:
            return checked(rank, *self.copies.whole(rank, step, own).blobs(), thin=False)

    def _take_back_held(self, r: Round, holder: int, step: int) -> None:
        """Hold this rank's `step` again, from `holder`'s copy, checked whole."""
        t0 = time.time()
        try:
            got = r.recv(holder, FETCH, SEND_TIMEOUT_S)
            if got is None or got[0] != r.rank or got[1] != HELD:
                raise CorruptCheckpoint(f"rank {holder} sent no whole copy of it")
            copy = checked(r.rank, *got[2], thin=False)
            if copy.step != step:
                raise CorruptCheckpoint(f"rank {holder} sent step {copy.step}")
            self.memory.install(spec_of(copy), copy.data)
        except (CorruptCheckpoint, RuntimeError, OSError) as e:
            log.warning(f"rank {r.rank}: step {step}, held in rank {holder}'s memory, did not come back "
                        f"({_short(e)}); resuming from --dir")
            self.log.emit(type="replica_error", rank=r.rank, error=_short(e))
            return
        took = time.time() - t0
        log.info(f"rank {r.rank}: step {step} taken back from rank {holder}'s memory into this engine's in "
                 f"{took:.2f} s (held in memory only)")
        self.log.emit(type="replica_restored", rank=r.rank, step=step, holder=holder, held=True,
                      bytes=len(copy.data), seconds=took)

    def _wanted(self, rank: int, offer: tuple[int, str, int] | None) -> dict:
        """{holder, record} to ask for, if the newest copy partners hold is missing from --dir."""
        if offer is None:
            return {}
        step, name, holder = offer
        store = self.store
        if store.is_committed(name) and rank in store.ranks_present(name):
            return {}
        if not store.is_committed(name) and not self.node_local:
            log.warning(f"rank {rank}: rank {holder} holds step {step}, but {store.root} has no record of it "
                        "to complete; resuming from --dir")
            return {}
        return {"holder": holder, "record": name}

    def _take_back(self, r: Round, holder: int, name: str) -> None:
        """Complete record `name` in --dir with this rank's part from `holder`'s memory (this
        engine's own, where the rendezvous gave it the rank whose copy it held), checked; a
        node-local --dir that lost the record gets it back with its manifest."""
        t0 = time.time()
        try:
            tier = _tier(f"rank {holder}'s memory", r.rank, *(self._whole(r.rank) if holder == r.rank
                                                               else self._received(r, holder)))
            # (every tensor was checked as the copy arrived, and the worker checks them as it reads)
            copied = fill(tier, self.store, name, [r.rank], checksums=False)
        except CorruptCheckpoint as e:
            log.warning(f"rank {r.rank}: the copy rank {holder} held is damaged ({_short(e)}); resuming "
                        "from --dir")
            self.log.emit(type="replica_error", rank=r.rank, error=_short(e))
            return
        took, step = time.time() - t0, tier.owners[r.rank][1]
        log.info(f"rank {r.rank}: step {step} taken back from rank {holder}'s memory in {took:.2f} s "
                 f"({', '.join(copied)})")
        self.log.emit(type="replica_restored", rank=r.rank, step=step, holder=holder, files=copied,
                      bytes=sum(len(tier.objects[f"{name}/{f}"]) for f in copied), seconds=took)

    def _received(self, r: Round, holder: int) -> tuple[bytes, dict[str, bytes]]:
        """(manifest, files) of the copy of this rank's part `holder` sends back, whole."""
        got = r.recv(holder, FETCH, SEND_TIMEOUT_S)
        if got is None or got[0] != r.rank or got[1] != 0:
            raise CorruptCheckpoint(f"rank {holder} sent no whole copy of rank {r.rank}")
        manifest, *files = got[2]
        return manifest, _files(r.rank, files)

    def _give_back(self, r: Round, owner: int) -> None:
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
            log.warning(f"rank {r.rank}: cannot give rank {owner} {what} back ({_short(e)})")
            self.log.emit(type="replica_error", rank=r.rank, partner=owner, error=_short(e))
            with contextlib.suppress(RuntimeError):
                r.stop(owner, FETCH)
            return
        with contextlib.suppress(RuntimeError):  # it died again: it resumes without
            r.send(owner, FETCH, owner, blobs, flags)

    def _whole(self, owner: int) -> tuple[bytes, dict[str, bytes]]:
        """(manifest, files) of the copy held for `owner`; a thin one with its shared tensors read
        from this node's own part of the same record (kept in --dir while the copy is held)."""
        with self._lock:
            part, thin = self.held.part(owner), owner in self.held.thin
            name = self.held.owners[owner][0] if part is not None else ""
        if part is None:
            raise CorruptCheckpoint(f"no copy of rank {owner} is held")
        manifest, files = part
        if not thin:
            return part
        data_file, index_file = rank_files(owner)
        store = self.store
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

    def held_records(self) -> list[str]:
        """The records of the copies held for partners (--node-local-dir: this node keeps its own
        parts of them, which a partner's node coming back from them resumes beside)."""
        with self._lock:
            return [name for name, _ in self.held.owners.values()]

    def _say_held(self, r: Round) -> None:
        """Tell `on_held` the oldest step among the copies held for this round's partners, once
        each partner's is held (--node-local-dir: no node prunes that step or a newer one)."""
        with self._lock:
            steps = [self.held.owners[p][1] for p in r.partners if p in self.held.owners]
        if self.on_held is not None and len(steps) == len(r.partners):
            self.on_held(min(steps))

    # ---- shipping and holding ----------------------------------------------------------
    def offer_held(self, step: int) -> None:
        """This engine holds `step` in memory now (its newest): ship it."""
        with self._wake:
            self._offered_held = step
            self._wake.notify_all()

    def wait_held_shipped(self, timeout: float) -> bool:
        """Wait until the step offered last (`offer_held`) has left, `timeout` seconds (one
        step's time) or MAX_SHIP_WAIT_S at most; whether it has. Called before the next step is
        held: the copies keep up with the steps that way, or a survivor's own held steps (the
        two newest) run ahead of every copy that left a lost node and none can be made whole."""
        with self._wake:
            return self._wake.wait_for(lambda: self._offered_held is None and not self._shipping_held,
                                       min(timeout, MAX_SHIP_WAIT_S))

    def offer_copy(self, copy: HeldCopy) -> None:
        """Ship `copy` after those offered before it: lowdiff+'s whole replica, or a step's diff
        that partners step their copy of it with (all of them, in order). A backlog past
        OUTBOX_KEPT (partners slower than the steps) is dropped, and the next offer must be whole."""
        with self._wake:
            if copy.kind == "full":
                self._full_due = False
            if len(self._outbox) >= OUTBOX_KEPT:
                self._outbox.clear()
                self._full_due = True
                self.log.emit(type="replica_error", rank=self.round.rank if self.round else -1,
                              error=f"copies of {OUTBOX_KEPT} steps not shipped yet: dropped, the next one whole")
            else:
                self._outbox.append(copy)
            self._wake.notify_all()

    def wait_shipped(self, most: int, timeout: float) -> bool:
        """Wait until at most `most` of the copies offered are not sent yet (to every live
        partner), for `timeout` seconds (one step's time) or MAX_SHIP_WAIT_S at most; whether
        they are."""
        with self._wake:
            return self._wake.wait_for(lambda: len(self._outbox) + self._sending <= most,
                                       min(timeout, MAX_SHIP_WAIT_S))

    def full_due(self) -> bool:
        """Must the next `offer_copy` be whole (partners of a new round, or copies dropped)?"""
        with self._wake:
            return self._full_due

    def offer(self, record: str, step: int) -> None:
        """A record of `step` this rank wrote has committed: ship it, if no newer step has been
        (records commit out of step order when one's parts are late; only the newest waits)."""
        with self._wake:
            if step > self._newest:
                self._offered, self._newest = record, step
                self._wake.notify_all()

    def _ship_loop(self) -> None:
        while True:
            with self._wake:
                while self._offered is None and self._offered_held is None and not self._outbox \
                        and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
                name, step, self._offered, self._offered_held = self._offered, self._offered_held, None, None
                self._shipping_held = step is not None
                copies, self._outbox = list(self._outbox), deque()
                self._sending = len(copies)
            with self._lock:
                r = self.round
            for copy in copies if r is not None else []:
                if r.live:
                    self._to_partners(r, copy.blobs(), HELD | (THIN if copy.thin else 0), copy.step,
                                      len(copy.data) + len(copy.raw_index), time.time(), copy.kind)
                with self._wake:
                    self._sending -= 1
                    self._wake.notify_all()
            with self._wake:  # (none sent without a round)
                self._sending = 0
                self._wake.notify_all()
            if r is not None and r.live and step is not None:
                self._ship_held(r, step)
            with self._wake:
                self._shipping_held = False
                self._wake.notify_all()
            if r is not None and r.live and name is not None:
                self._ship(r, name)

    def _ship_held(self, r: Round, step: int) -> None:
        """Ship this rank's copy of `step`, held in memory, to the live partners (thin under DDP)."""
        t0 = time.time()
        try:
            with self.memory.pinned(step) as got:
                if got is None:  # replaced meanwhile: the newer one is offered
                    return
                copy = cut(r.rank, *got)
        except CorruptCheckpoint as e:
            self.log.emit(type="replica_error", rank=r.rank, error=f"step {step}: {_short(e)}")
            return
        self._to_partners(r, copy.blobs(), HELD | (THIN if copy.thin else 0), step,
                          len(copy.data) + len(copy.raw_index), t0, copy.kind)

    def written(self, name: str, rank: int, index: bytes, data: memoryview) -> None:
        """This rank's part of `name` was just written from `data` (its staging slot, not yet
        freed) with `index`: with --node-local-dir, its thin copy is cut now, so that shipping
        it once the record commits reads nothing back (the index, written O_DIRECT, is not in
        the page cache: reading it and checking it again was most of the shipping thread's
        time in a profile). Best effort: without it, `_ship` reads the part from --dir."""
        if not self.node_local:
            return
        try:
            copy = thin_part(index, lambda offset, n: bytes(data[offset : offset + n]), f"{name}: rank {rank}")
        except CorruptCheckpoint:
            return
        if copy is not None:
            with self._lock:
                self._fresh[name] = copy
                for old in list(self._fresh)[:-FRESH_KEPT]:
                    del self._fresh[old]

    def _cut(self, m: Manifest, rank: int) -> tuple[bytes, bytes] | None:
        """The thin copy `written` cut of this rank's part of `m`, if its index is the one `m` pins."""
        with self._lock:
            copy = self._fresh.pop(m.name, None)
        return copy if copy is not None and checksum(copy[1]) == m.index_checksums.get(str(rank)) else None

    def _ship(self, r: Round, name: str) -> None:
        """Ship this rank's part of committed record `name` to the live partners: with
        --node-local-dir, thin when its index names shared tensors (cut as it was written, else
        only the others are read)."""
        t0 = time.time()
        try:
            m = self.store.manifest(name)
            thin = (self._cut(m, r.rank) or thin_rank_part(self.store, m, r.rank)) if self.node_local else None
            part = thin or self._whole_part(m, r.rank)
            if len(part) != 2:
                raise CorruptCheckpoint(f"{name}: rank {r.rank}'s part is not a data file and an index")
        except (CorruptCheckpoint, OSError) as e:  # pruned meanwhile: a newer one comes
            self.log.emit(type="replica_error", rank=r.rank, error=f"{name}: {_short(e)}")
            return
        manifest = json_bytes(m.to_json())
        self._to_partners(r, [manifest, *part], THIN if thin is not None else 0, m.step, sum(map(len, part)), t0)

    def _to_partners(self, r: Round, blobs: list[bytes | bytearray], flags: int, step: int, nbytes: int,
                     t0: float, kind: str = "") -> None:
        """Send one copy of `step` (`nbytes` and a held step's `kind` said in its event) to each
        live partner; one that fails is dropped for the round."""
        for p in sorted(r.live):
            try:
                r.send(p, SHIP, r.rank, blobs, flags)
            except RuntimeError as e:
                self._drop(r, p, e)
        held = {"held": True, "kind": kind} if flags & HELD else {}
        self.log.emit(type="replica_sent", rank=r.rank, step=step, bytes=nbytes, partners=sorted(r.live),
                      of=len(r.partners), seconds=time.time() - t0, **held)

    def _whole_part(self, m: Manifest, rank: int) -> tuple[bytes, ...]:
        """Rank `rank`'s files of committed record `m`, read whole and checked."""
        with contextlib.ExitStack() as stack:
            return tuple(b"".join(src.chunks(8 << 20)) for _, src in rank_part(self.store, m, rank, stack))

    def _drop(self, r: Round, p: int, e: BaseException) -> None:
        """Partner `p` is dead or stalled: no more copies go to it this round (said once)."""
        if p in r.live and self.round is r:
            r.live.discard(p)
            log.warning(f"rank {r.rank}: replicas to rank {p} stopped ({_short(e)}); its steps stay in --dir "
                        "only, until the next rendezvous round")
            self.log.emit(type="replica_error", rank=r.rank, partner=p, error=_short(e))

    def _recv_loop(self, r: Round, src: int) -> None:
        """Hold each copy `src` ships, until it says STOP (it left the round) or its connection
        breaks (it died: no more copies go to it either). A copy that cannot be held, for
        whatever reason, is refused in one line and the next one received: this thread never
        ends silently while its partner goes on shipping."""
        while True:
            try:
                got = r.recv(src, SHIP, on_manifest=self._die_if_asked)
            except (RuntimeError, ValueError, KeyError, TypeError, CorruptCheckpoint) as e:
                self._drop(r, src, e)
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
                    e = CorruptCheckpoint(f"{type(e).__name__}: {_short(e)}")
                log.warning(f"rank {r.rank}: refused rank {src}'s copy ({_short(e)}); keeping what it holds")
                self.log.emit(type="replica_error", rank=r.rank, partner=src, error=_short(e))

    def _hold_record(self, r: Round, owner: int, flags: int, blobs: list[bytes]) -> None:
        """Keep `owner`'s copy of its part of a record, once checked (else CorruptCheckpoint)."""
        manifest, *files = blobs
        with self._lock:
            m = self.held.hold(owner, manifest, _files(owner, files), thin=bool(flags & THIN))
            if m is None:
                return
            if self._corrupt_due(m.step):
                self._corrupt_record(owner)
        self._said_held(r, owner, m.step, sum(map(len, files)), memory_status.COPIES)
        self._say_held(r)

    def _hold_copy(self, r: Round, owner: int, flags: int, blobs: list[bytes]) -> None:
        """Keep `owner`'s copy of a step it holds in memory, once checked (else CorruptCheckpoint)."""
        copy = checked(owner, *blobs, thin=bool(flags & THIN))
        with self._lock:
            if not self.copies.hold(owner, copy, damage=self._corrupt_due(copy.step)):
                return
        self._said_held(r, owner, copy.step, len(copy.data) + len(copy.raw_index), memory_status.HELD_COPIES)

    def _said_held(self, r: Round, owner: int, step: int, nbytes: int, of: str) -> None:
        """A copy of `owner`'s `step` is held: in the metrics, and for `ls` (`of` its status file)."""
        self.log.emit(type="replica_held", rank=r.rank, owner=owner, step=step, bytes=nbytes,
                      **({"held": True} if of == memory_status.HELD_COPIES else {}))
        with contextlib.suppress(OSError):  # (only `ls` misses it; of the run's own --dir only)
            self.store.check_owned()
            memory_status.publish(self.store.root, owner, step, nbytes, of=of)

    def _die_if_asked(self, manifest: bytes) -> None:
        """The injected fault `kill-engine:step=N:phase=receive` (tests): this engine dies while it
        receives a partner's copy of step N or later, the copy's manifest in and its data not."""
        fault = self.fault
        if fault is None or fault.target != "kill-engine" or fault.phase != "receive":
            return
        with contextlib.suppress(ValueError, KeyError, TypeError):
            if json.loads(manifest)["step"] >= fault.step:
                die()

    def _corrupt_due(self, step: int) -> bool:
        """The injected fault `corrupt-replica:step=N` (tests): a bit flips in each copy held of
        step N or later, after its checks, as memory going bad would."""
        fault = self.fault
        return fault is not None and fault.target == "corrupt-replica" and step >= fault.step

    def _corrupt_record(self, owner: int) -> None:
        """`_corrupt_due` on the copy of `owner`'s part of a record, just held."""
        name = self.held.owners[owner][0]
        data_file, index_file = rank_files(owner)
        index = parse(self.held.objects[f"{name}/{index_file}"], name)
        self.held.objects[f"{name}/{data_file}"] = flipped(self.held.objects[f"{name}/{data_file}"], index,
                                                            owner in self.held.thin)

    def close(self) -> None:
        """Stop shipping and end the round. The shipping thread is joined once the round's group
        is aborted (a send still waiting fails then): a thread left inside gloo when the process
        exits aborts it (SIGABRT), as a partner closing while a copy went to it showed."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        self._end_round()
        self._shipper.join(timeout=SEND_TIMEOUT_S)
        if self.store is not None:
            for owner in list(self.held.owners):
                memory_status.withdraw(self.store.root, owner, of=memory_status.COPIES)
            for owner in list(self.copies.owners):
                memory_status.withdraw(self.store.root, owner, of=memory_status.HELD_COPIES)


def _reader(spec: RecordSpec, view: memoryview) -> Callable[[str, memoryview], int]:
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


def _files(owner: int, blobs: list[bytes]) -> dict[str, bytes]:
    """Rank `owner`'s files by name, of the [data, index] a copy's messages carry (`Round.recv`)."""
    return dict(zip(rank_files(owner), blobs, strict=True))


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps))


def _short(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
