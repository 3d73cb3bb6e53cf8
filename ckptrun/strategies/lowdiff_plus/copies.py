"""--replicas with lowdiff+: the copies an engine keeps of its partners' replicas. Each partner
ships its replica whole once (a new round, a re-base) and then each step's diff, the gradients
the optimizer consumed; a copy is stepped by them with the same exact replay as the owner's own
(replica.py), so a step costs the network its gradients, not the whole state (§VI-B's merging,
done again on another node).

A copy applies a diff only once this engine's own replica has one of that step too (`KeptBack`):
the copy of a lost node's replica and the survivor's own can then stand at one common step,
which the next round's ranks resume from. After each step applied its tensors' xxh3 are taken;
a copy given back is checked against them first (memory gone bad since), then cut whole with
fresh checksums, which its owner's engine checks again.

Under DDP the copy of a data-parallel peer's replica is its per-rank part only (perrank.py): its
shared state is checked equal to this engine's own replica's at the step the copy starts from
(`own_at`: their xxh3, taken for a few steps after a new round or a re-base), each diff's update
equal to this engine's own diff of its step (`own_diff`); a copy that differs is dropped with one
line, and a step is given back only once every check up to it passed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from ...engine.held_copies import HeldCopy, spec_of
from ...errors import CorruptCheckpoint
from ...log import log
from ...storage.layout import Layout
from .perrank import PerRankReplica, update_print
from .replica import KEPT_BACK, Arena, KeptBack, SteppedReplica

REPLICA_META = "lowdiff_plus"  # a whole copy's meta: {"exact", "replicated", "shared"} of its Base
EXPECT_STEPS = KEPT_BACK + 2  # own steps whose shared state's xxh3 is taken after `expect`
KEPT_PRINTS = 16  # own diffs' update prints kept for thin diffs that come after them
KEPT_SUMS = 8  # own steps' shared xxh3 kept for thin whole replicas that come after them


def replica_meta(meta: dict, what: str) -> dict:
    """REPLICA_META of a whole replica's index, checked (from a partner: untrusted)."""
    extra = meta.get(REPLICA_META)
    if not (isinstance(extra, dict) and isinstance(extra.get("exact"), bool)
            and all(isinstance(v, list) and all(type(i) is int for i in v)
                    for v in (extra.get("replicated"), extra.get("shared")))):
        raise CorruptCheckpoint(f"{what} does not say how it was made ({REPLICA_META})")
    return extra


@dataclass
class _Copy:
    kept: KeptBack  # of a SteppedReplica, or a PerRankReplica (thin: under DDP)
    extra: dict  # REPLICA_META of the whole copy it started from
    sums: dict[str, str] = field(default_factory=dict)  # xxh3 of each tensor it holds, as last stepped
    base: int | None = None  # thin: the step it started from, until its shared state is checked
    shared: dict[str, str] = field(default_factory=dict)  # thin: the owner's xxh3 of them at `base`
    unchecked: dict[int, str] = field(default_factory=dict)  # thin: its diffs' update prints not yet compared

    @property
    def thin(self) -> bool:
        return isinstance(self.kept.stepped, PerRankReplica)

    def check(self, owner: int) -> None:
        bad = [k for k, s in self.kept.stepped.sums().items() if self.sums.get(k) != s]
        if bad:
            raise CorruptCheckpoint(f"the copy of rank {owner}'s replica changed in memory since its step "
                                    f"{self.kept.stepped.step} ({len(bad)} tensors, first {bad[0]})")

    def checked_up_to(self, step: int) -> bool:
        """Every step up to `step` checked against this engine's own (a thin copy's)."""
        return self.base is None and all(s > step for s in self.unchecked)


class PartnerReplicas:
    """`engine.held_copies.PartnerCopies` of lowdiff+: one stepped copy per owner.
    `new_arena(owner, layout)` makes a copy's arena; `own()` is the newest step of this
    engine's own replica (with its diffs kept back), `own_state(step)` its full state if it
    stands at `step` (else None). The replicator's threads call it under its lock, this
    engine's handler (`own_at`, `own_diff`, `expect`, `forget_own`) without."""

    def __init__(self, classes: dict[str, type], new_arena: Callable[[int, Layout], Arena],
                 own: Callable[[], int | None], own_state: Callable[[int], dict | None] = lambda step: None) -> None:
        self.classes = classes
        self.new_arena = new_arena
        self.own = own
        self.own_state = own_state
        self.owners: dict[int, _Copy] = {}
        self.lock = threading.Lock()  # the thin copies' checks, between those two sides
        self.own_prints: dict[int, str] = {}  # step -> this engine's own diff's `update_print`
        self.own_sums: dict[int, dict[str, str]] = {}  # step -> its own replica's shared xxh3
        self.expecting = 0  # own steps whose shared xxh3 is still to be taken

    def hold(self, owner: int, copy: HeldCopy, damage: bool = False) -> bool:
        """A whole replica starts (or starts again) `owner`'s copy; a diff is kept back until
        this engine's own replica has one of its step. A diff that does not follow a step the
        copy can stand at drops the copy until the owner's next whole one."""
        with self.lock:
            if copy.kind == "full":
                self._start(owner, copy)
            elif copy.kind != "diff":
                raise CorruptCheckpoint(f"rank {owner} sent a copy of kind {copy.kind!r}")
            elif not self._step(owner, copy):
                return False
            if damage:
                self.owners[owner].kept.stepped.flip()
            return True

    def _step(self, owner: int, copy: HeldCopy) -> bool:
        c = self.owners.get(owner)
        try:
            if c is None:
                raise ValueError("it holds no replica")
            if copy.thin != c.thin:
                raise ValueError("a diff " + ("without" if copy.thin else "with") + " the replicated gradients")
            c.kept.add(spec_of(copy), copy)
        except ValueError as e:
            if self._drop(owner):
                log.warning(f"the copy of rank {owner}'s replica dropped until a whole one comes: step "
                            f"{copy.step}'s diff does not follow it ({e})")
            return False
        if c.thin:
            mine, theirs = self.own_prints.get(copy.step), update_print(copy.index)
            if mine is None:
                c.unchecked[copy.step] = theirs
            elif mine != theirs:
                return self._refuse(owner, f"its step {copy.step} updates the replicated state otherwise")
        own = self.own()
        try:
            if c.kept.apply(own if own is not None else float("inf")):
                c.sums = c.kept.stepped.sums()
        except Exception as e:  # noqa: BLE001 - a partner's diff: any failure refuses it (and the copy)
            self._drop(owner)
            raise CorruptCheckpoint(f"rank {owner}'s diff does not apply to its copy ({type(e).__name__}: "
                                    f"{e}); dropped until a whole one comes") from e
        return True

    def _start(self, owner: int, copy: HeldCopy) -> None:
        what = f"rank {owner}'s whole replica"
        extra = replica_meta(spec_of(copy).meta, what)
        self._drop(owner)
        if copy.thin:
            replica = PerRankReplica()
            replica.rebase_from(copy, what)
            shared = {k: copy.index.tensors[k].xxh3 for k in replica.shared_keys()}
            c = _Copy(KeptBack(replica, owned=True), extra, replica.sums(), base=copy.step, shared=shared)
        else:
            replica = SteppedReplica(self.classes, lambda layout: self.new_arena(owner, layout))
            replica.rebase_from(spec_of(copy), copy.data, extra["exact"], what)
            c = _Copy(KeptBack(replica, owned=True), extra, replica.sums())
        self.owners[owner] = c
        self._check_base(owner, c, None)

    def _check_base(self, owner: int, c: _Copy, now: int | None) -> None:
        """Compare a thin copy's shared state with this engine's own at its step, once taken;
        refuse it if its step has passed (`now`, where this engine's own replica stands) untaken."""
        if c.base is None:
            return
        mine = self.own_sums.get(c.base)
        if mine is not None:
            if mine != c.shared:
                self._refuse(owner, f"its replicated state at step {c.base} differs from this rank's")
            else:
                c.base = None
        elif now is not None and now > c.base:
            self._refuse(owner, f"this rank's replica passed its step {c.base} before it came")

    def _refuse(self, owner: int, why: str) -> bool:
        if self._drop(owner):
            log.warning(f"the copy of rank {owner}'s replica dropped until a whole one comes: {why} (ranks not "
                        "data-parallel alike)")
        return False

    # ---- this engine's own replica (its handler's thread) -----------------------------------
    def expect(self) -> None:
        """Partners may ship thin whole replicas now (a new round, a re-base): take the own
        replica's shared xxh3 at its next EXPECT_STEPS steps (`own_at`)."""
        with self.lock:
            self.expecting = EXPECT_STEPS

    def own_at(self, step: int, sums: Callable[[], dict[str, str]], keep: bool = False) -> None:
        """This engine's own replica stands at `step`: its shared xxh3 (`sums()`) are taken when
        `keep` says (a step partners ship their replicas at), when expected, or when a thin copy
        waits for a step not passed yet, and the copies waiting on them are checked."""
        with self.lock:
            need = keep or self.expecting > 0 or \
                any(c.base is not None and c.base >= step for c in self.owners.values())
        got = sums() if need else None  # (not under the lock: the replicator's threads go on)
        with self.lock:
            if got is not None:
                self.own_sums[step] = got
                _trim(self.own_sums, KEPT_SUMS)
                self.expecting = max(0, self.expecting - 1)
            for owner, c in list(self.owners.items()):
                self._check_base(owner, c, step)

    def own_dropped(self, after: int) -> None:
        """This engine's own diffs after step `after` are dropped (the worker sends those steps
        again, maybe otherwise): their prints go too."""
        with self.lock:
            for step in [s for s in self.own_prints if s > after]:
                del self.own_prints[step]

    def own_diff(self, step: int, print_: str) -> None:
        """This engine's own diff of `step` has `update_print` `print_`: thin copies' diffs of that
        step are compared with it (prints of later steps go: the trainer resumed before them)."""
        self.own_dropped(step)
        with self.lock:
            self.own_prints[step] = print_
            _trim(self.own_prints, KEPT_PRINTS)
            for owner, c in list(self.owners.items()):
                theirs = c.unchecked.pop(step, None)
                if theirs is not None and theirs != print_:
                    self._refuse(owner, f"its step {step} updates the replicated state otherwise")

    def forget_own(self) -> None:
        """The own replica starts anew (its steps may come again otherwise)."""
        with self.lock:
            self.own_prints.clear()
            self.own_sums.clear()

    # ---- PartnerCopies ---------------------------------------------------------------------
    def newest(self) -> float:
        """The oldest among the copies' newest steps (what this engine's own replica may be
        stepped up to); infinity when it holds none."""
        return min((c.kept.newest() for c in list(self.owners.values())), default=float("inf"))

    def steps(self, owner: int) -> list[int]:
        c = self.owners.get(owner)
        return c.kept.steps() if c is not None else []

    def whole_steps(self, owner: int, own: Collection[int]) -> list[int]:
        """A whole copy's every step; a thin one's checked steps this engine's own replica can
        stand at too."""
        c = self.owners.get(owner)
        if c is None or not c.thin:
            return self.steps(owner)
        return [s for s in c.kept.steps() if s in own and c.checked_up_to(s)]

    def whole(self, owner: int, step: int, own: Callable[[str, memoryview], int] | None) -> HeldCopy:
        """`owner`'s replica at `step`, checked against its checksums, then cut whole (a thin
        one's shared state is this engine's own replica's at `step`, `own_state`: `own`, a
        reader of it, is not needed)."""
        c = self.owners.get(owner)
        if c is None or step not in c.kept.steps():
            raise CorruptCheckpoint(f"no copy of rank {owner}'s replica at step {step} is held")
        mine = self.own_state(step) if c.thin else None
        if c.thin and not c.checked_up_to(step):
            raise CorruptCheckpoint(f"rank {owner}'s copy at step {step} is not checked against this rank's yet")
        if c.thin and mine is None:
            raise CorruptCheckpoint(f"this rank's replica no longer stands at step {step} to complete rank {owner}'s")
        c.check(owner)
        meta = {REPLICA_META: c.extra}
        try:
            c.kept.stand_at(step)  # (the owner's diffs kept back: untrusted)
            return c.kept.stepped.whole(owner, mine, meta) if c.thin else c.kept.stepped.copy(owner, meta)
        except CorruptCheckpoint:
            raise
        except Exception as e:  # noqa: BLE001 - any failure: the owner resumes from its records at once
            self._drop(owner)
            raise CorruptCheckpoint(f"rank {owner}'s copy cannot stand at step {step} ({type(e).__name__}: "
                                    f"{e})") from e

    def forget(self, owner: int) -> None:
        with self.lock:
            self._drop(owner)

    def _drop(self, owner: int) -> bool:
        """Let `owner`'s copy go (its arena closed); whether one was held."""
        c = self.owners.pop(owner, None)
        if c is not None:
            c.kept.stepped.drop()
        return c is not None

    def close(self) -> None:
        for owner in list(self.owners):
            self._drop(owner)


def _trim(d: dict[int, object], n: int) -> None:
    """Keep the `n` newest steps of `d`."""
    for step in sorted(d)[:-n]:
        del d[step]
