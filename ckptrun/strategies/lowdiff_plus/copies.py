"""--replicas with lowdiff+: the copies an engine keeps of its partners' replicas. Each partner
ships its replica whole once (a new round, a re-base) and then each step's diff, the gradients
the optimizer consumed; a copy is stepped by them with the same exact replay as the owner's own
(replica.py), so a step costs the network its gradients, not the whole state (§VI-B's merging,
done again on another node).

A copy applies a diff only once this engine's own replica has one of that step too (`KeptBack`):
the copy of a lost node's replica and the survivor's own can then stand at one common step,
which the next round's ranks resume from. After each step applied its tensors' xxh3 are taken;
a copy given back is checked against them first (memory gone bad since), then cut whole with
fresh checksums, which its owner's engine checks again."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from ...engine.held_copies import HeldCopy, spec_of
from ...errors import CorruptCheckpoint
from ...log import log
from ...storage.layout import Layout
from ...storage.schema import checksum
from .replica import Arena, KeptBack, SteppedReplica

REPLICA_META = "lowdiff_plus"  # a whole copy's meta: {"exact", "replicated", "shared"} of its Base


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
    kept: KeptBack
    extra: dict  # REPLICA_META of the whole copy it started from
    sums: dict[str, str] = field(default_factory=dict)  # xxh3 of each tensor, as last stepped

    def check(self, owner: int) -> None:
        bad = [k for k, s in _sums(self.kept.stepped).items() if self.sums.get(k) != s]
        if bad:
            raise CorruptCheckpoint(f"the copy of rank {owner}'s replica changed in memory since its step "
                                    f"{self.kept.stepped.step} ({len(bad)} tensors, first {bad[0]})")


class PartnerReplicas:
    """`engine.held_copies.PartnerCopies` of lowdiff+: one stepped copy per owner.
    `new_arena(owner, layout)` makes a copy's arena; `own()` is the newest step of this
    engine's own replica (with its diffs kept back)."""

    def __init__(self, classes: dict[str, type], new_arena: Callable[[int, Layout], Arena],
                 own: Callable[[], int | None]) -> None:
        self.classes = classes
        self.new_arena = new_arena
        self.own = own
        self.owners: dict[int, _Copy] = {}

    def hold(self, owner: int, copy: HeldCopy, damage: bool = False) -> bool:
        """A whole replica starts (or starts again) `owner`'s copy; a diff is kept back until
        this engine's own replica has one of its step. A diff that does not follow a step the
        copy can stand at drops the copy until the owner's next whole one."""
        if copy.kind == "full":
            self._start(owner, copy)
        elif copy.kind != "diff":
            raise CorruptCheckpoint(f"rank {owner} sent a copy of kind {copy.kind!r}")
        else:
            c = self.owners.get(owner)
            try:
                if c is None:
                    raise ValueError("it holds no replica")
                c.kept.add(spec_of(copy), copy)
            except ValueError as e:
                if self._drop(owner):
                    log.warning(f"the copy of rank {owner}'s replica dropped until a whole one comes: step "
                                f"{copy.step}'s diff does not follow it ({e})")
                return False
            own = self.own()
            try:
                if c.kept.apply(own if own is not None else float("inf")):
                    c.sums = _sums(c.kept.stepped)
            except Exception as e:  # noqa: BLE001 - a partner's diff: any failure refuses it (and the copy)
                self._drop(owner)
                raise CorruptCheckpoint(f"rank {owner}'s diff does not apply to its copy ({type(e).__name__}: "
                                        f"{e}); dropped until a whole one comes") from e
        if damage:
            _flip(self.owners[owner].kept.stepped)
        return True

    def _start(self, owner: int, copy: HeldCopy) -> None:
        spec = spec_of(copy)
        extra = replica_meta(spec.meta, f"rank {owner}'s whole replica")
        self._drop(owner)
        replica = SteppedReplica(self.classes, lambda layout: self.new_arena(owner, layout))
        replica.rebase_from(spec, copy.data, extra["exact"], f"rank {owner}'s whole replica")
        self.owners[owner] = _Copy(KeptBack(replica, owned=True), extra, sums=_sums(replica))

    def newest(self) -> float:
        """The oldest among the copies' newest steps (what this engine's own replica may be
        stepped up to); infinity when it holds none."""
        return min((c.kept.newest() for c in list(self.owners.values())), default=float("inf"))

    def steps(self, owner: int) -> list[int]:
        c = self.owners.get(owner)
        return c.kept.steps() if c is not None else []

    def whole_steps(self, owner: int, own: Collection[int]) -> list[int]:
        """Every step a copy can stand at is whole (no state of this engine's needed)."""
        return self.steps(owner)

    def whole(self, owner: int, step: int, own: Callable[[str, memoryview], int] | None) -> HeldCopy:
        """`owner`'s replica at `step`, checked against its checksums, then cut whole."""
        c = self.owners.get(owner)
        if c is None or step not in c.kept.steps():
            raise CorruptCheckpoint(f"no copy of rank {owner}'s replica at step {step} is held")
        c.check(owner)
        c.kept.stand_at(step)
        return c.kept.stepped.copy(owner, {REPLICA_META: c.extra})

    def _drop(self, owner: int) -> bool:
        """Let `owner`'s copy go (its arena closed); whether one was held."""
        c = self.owners.pop(owner, None)
        if c is not None:
            c.kept.stepped.drop()
        return c is not None

    def close(self) -> None:
        for owner in list(self.owners):
            self._drop(owner)


def _sums(replica: SteppedReplica) -> dict[str, str]:
    arena = replica.arena
    data = memoryview(arena.buf.numpy())
    return {k: checksum(data[s.offset : s.offset + s.nbytes]) for k, s in arena.specs.items()}


def _flip(replica: SteppedReplica) -> None:
    """One bit of its largest tensor flipped, as memory going bad would (after its checksums)."""
    arena = replica.arena
    s = max(arena.specs.values(), key=lambda s: s.nbytes)
    arena.buf[s.offset + s.nbytes // 2] ^= 1
