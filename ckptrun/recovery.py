"""Which committed step to restore, and the state of one rank at that step.

Restore never trusts a record blindly: every checksum is re-checked, a bad record is skipped
with a warning and the next older good one is used (DESIGN invariant 2).
"""

from __future__ import annotations

import warnings

from .errors import CorruptCheckpoint, StepNotAvailable
from .store import Manifest, Store
from .tree import unflatten


def restorable(store: Store) -> list[Manifest]:
    """Committed records that restore on their own, oldest first."""
    return [m for m in store.manifests() if m.kind == "full"]


def newest_good(store: Store, *, at_most: int | None = None, verify: bool = True) -> Manifest | None:
    """The newest restorable record (≤ `at_most`) whose every rank passes its checks."""
    for m in reversed(restorable(store)):
        if at_most is not None and m.step > at_most:
            continue
        problems = store.verify_record(m) if verify else []
        if not problems:
            return m
        warnings.warn(f"ckptrun: step {m.step} is damaged ({problems[0]}); falling back to an older step",
                      stacklevel=2)
    return None


def find(store: Store, step: int | str) -> Manifest:
    """The record for `step` ("latest" falls back past damaged records)."""
    if step == "latest":
        m = newest_good(store)
        if m is None:
            raise StepNotAvailable(f"no restorable step in {store.root}" + _available(store))
        return m
    for m in restorable(store):
        if m.step == int(step):
            problems = store.verify_record(m)
            if problems:
                good = newest_good(store, at_most=m.step)
                hint = f"; the newest good step before it is {good.step}" if good else ""
                raise CorruptCheckpoint(f"step {m.step} is damaged ({problems[0]}){hint}")
            return m
    raise StepNotAvailable(f"step {step} is not committed in {store.root}" + _available(store))


def _available(store: Store) -> str:
    steps = [m.step for m in restorable(store)]
    return f"; available steps: {', '.join(map(str, steps))}" if steps else "; it holds no committed steps"


def load_state(store: Store, m: Manifest, rank: int) -> dict:
    """The nested state of `rank` in record `m` (tensors are private copies)."""
    index, tensors = store.read_rank(m.name, rank)
    return unflatten(index["skeleton"], {k: t.clone() for k, t in tensors.items()})


__all__ = ["CorruptCheckpoint", "find", "load_state", "newest_good", "restorable"]
