"""DDP's replicated state written once: each parameter and optimizer state tensor by one rank,
each rank about 1/N of those bytes; per-rank state (RNG, a tracked Generator, a parameter DDP
ignores) stays per rank;
restore and a resume after a rank is killed reassemble every rank's state exactly."""

from __future__ import annotations

import pytest
from conftest import (
    DDP_STEPS,
    DP_MLP,
    FULL,
    assert_same,
    ckptrun,
    error_line,
    load,
    ok,
    restore,
    run_events,
)

from ckptrun.restore.recovery import optimizer_classes, verify_problems
from ckptrun.storage.layout import align
from ckptrun.storage.store import Manifest, Store
from ckptrun.storage.writeonce import owners, remote_refs
from ckptrun.strategies import BUILTIN, REGISTRY

SCRIPT, STEPS = DP_MLP, DDP_STEPS
WRITE_ONCE = [name for name, entry in REGISTRY.items() if entry.write_once]


def test_every_builtin_strategy_writes_replicated_state_once():
    assert [name for name, entry in BUILTIN.items() if not entry.write_once] == []


def test_owners_balance_bytes_to_within_one_tensor():
    sizes = {f"t{i}": (i * 7919) % 1000 + 1 for i in range(50)}
    for n in (1, 2, 3, 7):
        assigned = owners(sizes, n)
        assert assigned == owners(dict(reversed(sizes.items())), n)  # from names and sizes alone
        per_rank = [sum(s for k, s in sizes.items() if assigned[k] == r) for r in range(n)]
        assert max(per_rank) - min(per_rank) <= max(sizes.values())


def replicated_bytes_per_rank(store: Store, m: Manifest) -> tuple[list[int], int]:
    """(the bytes of replicated tensors each rank wrote in record `m`, the largest one's), after
    checking that each tensor a rank names as another's is held by that rank and by no other."""
    indexes = [store.read_index(m.name, r, m) for r in range(m.world_size)]
    assert m.rank_bytes == [index["data_nbytes"] for index in indexes]
    refs = {(owner, key) for index in indexes for owner, key in remote_refs(index["skeleton"])}
    assert refs, f"{m.name}: nothing was written once"
    keys = {key for _, key in refs}
    for owner, key in refs:
        assert [r for r, index in enumerate(indexes) if key in index["tensors"]] == [owner], key
    written = [[align(index["tensors"][k]["nbytes"]) for k in keys & set(index["tensors"])] for index in indexes]
    return [sum(w) for w in written], max(max(w) for w in written)


# By default the record-folder and region families at 3 ranks (owners no longer alternate: it
# covers the 2-rank case's checks), and checkfreq at 2, whose run the crash matrix shares: which
# tensors a rank writes is decided by code every strategy shares (worker/state.py,
# storage/writeonce.py), each family writes and restores its parts its own way (lowdiff's diff
# records under DDP: tests/test_lowdiff.py's DDP run). Every strategy at 2 and 3 under --full.
DEFAULT_CASES = {("checkfreq", 3), ("lightcheck", 3), ("checkfreq", 2)}
CASES = [pytest.param(s, n, marks=() if (s, n) in DEFAULT_CASES else FULL) for s in WRITE_ONCE for n in (2, 3)]


@pytest.mark.parametrize(("strategy", "ranks"), CASES, ids=[f"{s}-{n}" for s in WRITE_ONCE for n in (2, 3)])
def test_ddp_writes_replicated_state_once_and_resumes_exactly(strategy, ranks, ddp_killed_run, ddp_truth,
                                                              tmp_path):
    """Rank 1 killed mid-run: every rank resumes exactly (its tracked Generator too); the last
    step restores every rank's own state; in every record (full checkpoints and the replay
    strategies' gradient records alike) each replicated tensor was written by one rank, and each
    rank wrote 1/N of them to within one tensor."""
    run = ddp_killed_run(strategy, ranks)
    assert [e["restart_count"] for e in run_events(run / "metrics", 1)] == [0, 1], "the fault did not fire"
    for rank in range(ranks):
        own = load(ddp_truth(ranks) / f"own-{rank}-{STEPS}.pt")
        assert_same(load(run / f"own-{rank}-{STEPS}.pt"), own)
        state, _ = restore(tmp_path, run / "ckpts", STEPS, rank=rank)
        assert_same([state["model"], state["optimizer"], state["extra"]["mine"]],
                    [own["model"], own["optimizer"], own["mine"]])
    store = Store(run / "ckpts")
    records = store.manifests()
    assert records[-1].step == STEPS
    for m in records:
        sizes, largest = replicated_bytes_per_rank(store, m)
        assert max(sizes) - min(sizes) <= largest, (m.name, sizes)
    assert verify_problems(store, optimizer_classes()) == []
    for m in records:  # a replay step (a diff record) restores every rank's replicated state from all ranks' parts
        if m.kind == "diff":
            states = [replicated(restore(tmp_path, run / "ckpts", m.step, rank=r)[0]) for r in range(ranks)]
            for state in states[1:]:
                assert_same(state, states[0])


OWN = 4  # dp_mlp.py's parameter DDP ignores: the optimizer's last (after the Sequential's four)


def replicated(state: dict) -> list:
    """The model and optimizer state DDP keeps the same on every rank: all but dp_mlp's `own`."""
    optimizer = {**state["optimizer"], "state": {k: v for k, v in state["optimizer"]["state"].items() if k != OWN}}
    return [{k: v for k, v in state["model"].items() if k != "own"}, optimizer]


# checkfreq grows from 2 to 3 ranks (a resume on 1 rank is tests/test_sharded.py's, of FSDP2
# state saved on 2; the refusal of a replay chain at another world size is its lowdiff case);
# every strategy both ways under --full.
@pytest.mark.parametrize(("strategy", "saved", "ranks"), [
    pytest.param(s, saved, ranks, marks=() if (s, saved) == ("checkfreq", 2) else FULL)
    for s in REGISTRY for saved, ranks in [(2, 3), (3, 1)]])
def test_ddp_resumes_at_another_world_size(strategy, saved, ranks, tmp_path):
    """DDP saved on `saved` ranks, resumed on `ranks` (an elastic membership change): every rank
    starts from the replicated state as every saved rank had it, assembled from the parts that
    wrote it once, and its per-rank state (the parameter DDP ignores, the tracked Generator) from
    saved rank `rank % saved`; training goes on and commits at the new world size. A strategy
    whose step 4 is a replay chain refuses, naming the fix."""
    run = ["--strategy", strategy, *REGISTRY[strategy].short_run_flags, "--dir", "ckpts", SCRIPT, "--wrap", "ddp"]
    ok(ckptrun(tmp_path, "--nproc-per-node", saved, *run, "--steps", 4))
    before = [restore(tmp_path, tmp_path / "ckpts", 4, rank=r)[0] for r in range(saved)]
    proc = ckptrun(tmp_path, "--nproc-per-node", ranks, *run, "--steps", 6, "--resumed-out", "resumed-{rank}.pt")
    if Store(tmp_path / "ckpts").manifests()[-1].kind == "diff":
        line = error_line(proc)
        assert f"is a replay chain written by {saved} ranks, this run has {ranks}" in line, line
        return
    assert f"resharding step 4 from {saved} to {ranks} ranks" in ok(proc).stderr
    for rank in range(ranks):
        resumed, own = load(tmp_path / f"resumed-{rank}.pt"), before[rank % saved]
        assert_same(replicated(resumed), replicated(before[0]))
        assert_same([resumed["model"]["own"], resumed["optimizer"]["state"][OWN], resumed["mine"]],
                    [own["model"]["own"], own["optimizer"]["state"][OWN], own["extra"]["mine"]])
    m = Store(tmp_path / "ckpts").manifests()[-1]
    assert (m.step, m.world_size) == (6, ranks)
