"""Recovery planning on a directory's committed records (no training): which steps are
restorable and from which records — the nearest full checkpoint, then the gap-free run of diff
records chained on it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import pack

from ckptrun.restore.recovery import newest_good, plans
from ckptrun.storage.store import Store, diff_name, full_name


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "ckpts")
    s.ensure_writable()
    return s


def commit(store: Store, kind: str, step: int, first: int | None = None, depends_on: list[str] | None = None) -> str:
    skeleton, data, tensors = pack({"w": torch.full((2,), float(step))})
    name = full_name(step) if kind == "full" else diff_name(first, step)
    store.write_rank(name, 0, memoryview(data), tensors, skeleton, {"step": step})
    m = store.try_commit(name, kind=kind, step=step, first_step=first or step, world_size=1, depends_on=depends_on)
    assert m is not None
    return name


def shape(store: Store) -> dict[int, tuple[str, list[str]]]:
    return {s: (p.base.name, [d.name for d in p.diffs]) for s, p in plans(store).items()}


def test_every_step_of_a_chain_is_planned_from_its_nearest_base(store):
    f0 = commit(store, "full", 0)
    d13 = commit(store, "diff", 3, 1, [f0])
    d46 = commit(store, "diff", 6, 4, [f0, d13])
    f6 = commit(store, "full", 6)
    d78 = commit(store, "diff", 8, 7, [f6])
    assert shape(store) == {0: (f0, []), 1: (f0, [d13]), 2: (f0, [d13]), 3: (f0, [d13]), 4: (f0, [d13, d46]),
                            5: (f0, [d13, d46]), 6: (f6, []), 7: (f6, [d78]), 8: (f6, [d78])}
    assert newest_good(store, verify=False).step == 8


def test_a_gap_in_a_chain_ends_what_it_can_restore(store):
    f0 = commit(store, "full", 0)
    d13 = commit(store, "diff", 3, 1, [f0])
    commit(store, "diff", 9, 7, [f0, d13])  # steps 4..6 were never committed: 7..9 cannot be replayed
    assert list(plans(store)) == [0, 1, 2, 3]
    assert newest_good(store, at_most=2, verify=False).step == 2


def test_a_missing_base_leaves_no_plan_through_its_diffs(store):
    f0 = commit(store, "full", 0)
    f4 = commit(store, "full", 4)
    commit(store, "diff", 6, 5, [f4])
    shutil.rmtree(store.root / f4)  # as if retention or a hand had removed it
    assert list(plans(store)) == [0]
    assert newest_good(store, verify=False).base.name == f0
