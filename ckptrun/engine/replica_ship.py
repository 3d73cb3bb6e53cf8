"""Shipping this rank's copies to its partners (engine/replicate.py), on a thread of its own so
that the trainer never waits on it: each committed record's part (thin under DDP, cut as it was
written where it can be), each step held in memory, and a handler's own copies in order."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque

from ..errors import CorruptCheckpoint
from ..storage.fsutil import json_bytes
from ..storage.schema import Manifest, checksum
from ..storage.tiers.parts import rank_part, thin_part, thin_rank_part
from .held_copies import HeldCopy, cut
from .replica_round import HELD, SHIP, THIN, Round
from .replica_state import ReplicaState, short

FRESH_KEPT = 4  # thin copies cut as their parts were written, waiting for their records to commit
OUTBOX_KEPT = 8  # `offer_copy`'s copies waiting to be shipped, at most
MAX_SHIP_WAIT_S = 1.0  # an engine waits for its previous copy to leave one step's time, at most this


class Shipper:
    """What is offered to ship, and the thread that ships it to the round's live partners."""

    def __init__(self, state: ReplicaState) -> None:
        self.state = state
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
        self._thread = threading.Thread(target=self._loop, name="ckptrun-replicas", daemon=True)
        self._thread.start()

    def new_round(self) -> None:
        """New partners may hold nothing yet: the next commit goes, whatever its step, and the
        next stepped copy whole."""
        with self._wake:
            self._newest = -1
            self._outbox.clear()
            self._full_due = True

    def stop(self) -> None:
        """The thread ends once it has sent what it is sending (`join` it after the round ends)."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)

    # ---- what is offered ----------------------------------------------------------------
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
                r = self.state.round
                self.state.log.emit(type="replica_error", rank=r.rank if r else -1,
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

    def written(self, name: str, rank: int, index: bytes, data: memoryview) -> None:
        """This rank's part of `name` was just written from `data` (its staging slot, not yet
        freed) with `index`: with --node-local-dir, its thin copy is cut now, so that shipping
        it once the record commits reads nothing back (the index, written O_DIRECT, is not in
        the page cache: reading it and checking it again was most of the shipping thread's
        time in a profile). Best effort: without it, `_ship` reads the part from --dir."""
        if not self.state.node_local:
            return
        try:
            copy = thin_part(index, lambda offset, n: bytes(data[offset : offset + n]), f"{name}: rank {rank}")
        except CorruptCheckpoint:
            return
        if copy is not None:
            with self.state.lock:
                self._fresh[name] = copy
                for old in list(self._fresh)[:-FRESH_KEPT]:
                    del self._fresh[old]

    # ---- the shipping thread ------------------------------------------------------------
    def _loop(self) -> None:
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
            with self.state.lock:
                r = self.state.round
            self._ship_copies(r, copies)
            if r is not None and r.live and step is not None:
                self._ship_held(r, step)
            with self._wake:
                self._shipping_held = False
                self._wake.notify_all()
            if r is not None and r.live and name is not None:
                self._ship(r, name)

    def _ship_copies(self, r: Round | None, copies: list[HeldCopy]) -> None:
        """Ship `offer_copy`'s `copies` in order, each counted off as it leaves (none without a round)."""
        for copy in copies if r is not None else []:
            if r.live:
                self._to_partners(r, copy.blobs(), HELD | (THIN if copy.thin else 0), copy.step,
                                  len(copy.data) + len(copy.raw_index), time.time(), copy.kind)
            with self._wake:
                self._sending -= 1
                self._wake.notify_all()
        with self._wake:
            self._sending = 0
            self._wake.notify_all()

    def _ship_held(self, r: Round, step: int) -> None:
        """Ship this rank's copy of `step`, held in memory, to the live partners (thin under DDP)."""
        t0 = time.time()
        try:
            with self.state.memory.pinned(step) as got:
                if got is None:  # replaced meanwhile: the newer one is offered
                    return
                copy = cut(r.rank, *got)
        except CorruptCheckpoint as e:
            self.state.log.emit(type="replica_error", rank=r.rank, error=f"step {step}: {short(e)}")
            return
        self._to_partners(r, copy.blobs(), HELD | (THIN if copy.thin else 0), step,
                          len(copy.data) + len(copy.raw_index), t0, copy.kind)

    def _cut(self, m: Manifest, rank: int) -> tuple[bytes, bytes] | None:
        """The thin copy `written` cut of this rank's part of `m`, if its index is the one `m` pins."""
        with self.state.lock:
            copy = self._fresh.pop(m.name, None)
        return copy if copy is not None and checksum(copy[1]) == m.index_checksums.get(str(rank)) else None

    def _ship(self, r: Round, name: str) -> None:
        """Ship this rank's part of committed record `name` to the live partners: with
        --node-local-dir, thin when its index names shared tensors (cut as it was written, else
        only the others are read)."""
        t0, store = time.time(), self.state.store
        try:
            m = store.manifest(name)
            thin = (self._cut(m, r.rank) or thin_rank_part(store, m, r.rank)) if self.state.node_local else None
            part = thin or self._whole_part(m, r.rank)
            if len(part) != 2:
                raise CorruptCheckpoint(f"{name}: rank {r.rank}'s part is not a data file and an index")
        except (CorruptCheckpoint, OSError) as e:  # pruned meanwhile: a newer one comes
            self.state.log.emit(type="replica_error", rank=r.rank, error=f"{name}: {short(e)}")
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
                self.state.drop(r, p, e)
        held = {"held": True, "kind": kind} if flags & HELD else {}
        self.state.log.emit(type="replica_sent", rank=r.rank, step=step, bytes=nbytes, partners=sorted(r.live),
                            of=len(r.partners), seconds=time.time() - t0, **held)

    def _whole_part(self, m: Manifest, rank: int) -> tuple[bytes, ...]:
        """Rank `rank`'s files of committed record `m`, read whole and checked."""
        with contextlib.ExitStack() as stack:
            return tuple(b"".join(src.chunks(8 << 20)) for _, src in rank_part(self.state.store, m, rank, stack))
