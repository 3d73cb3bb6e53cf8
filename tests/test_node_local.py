"""--node-local-dir: two engines (ranks 0 and 1, each its own node's --dir) commit through one job
store (`engine/nodecommit.py`), and readers of a --dir that holds only its node's parts. The
two-node run is in tests/test_two_nodes.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from conftest import cli, error_line, pack

from ckptrun.engine.nodecommit import Board
from ckptrun.engine.retention import retain
from ckptrun.engine.server import Engine
from ckptrun.ipc.messages import RecordSpec
from ckptrun.launcher.console.batch_log import summary_line
from ckptrun.launcher.console.metrics_feed import MetricsTailer
from ckptrun.launcher.console.metrics_state import MetricsState
from ckptrun.restore.recovery import newest_good, plans, read_state
from ckptrun.storage.store import Store, full_name


def _engines(tmp_path, keep: int = 1, *, shared: bool = False) -> tuple[Engine, Engine]:
    """Engines of ranks 0 and 1, each on a node of its own (its own --dir), one job store; each
    the first of its node (local rank 0), its metrics in `metrics-node<rank>`. `shared`: one --dir
    for both, no job store."""
    kv = dist.HashStore()
    engines = []
    for rank in (0, 1):
        e = Engine(0, f"nodelocal-{rank}", str(tmp_path / f"metrics-node{rank}"))
        state = e.state
        state.store = Store(tmp_path / ("shared" if shared else f"node{rank}"))
        state.rank, state.world_size, state.keep, state.board = rank, 2, keep, None if shared else Board(kv)
        state.io_threads = 1
        state.store.ensure_writable()
        engines.append(e)
    return engines[0], engines[1]


def _state(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(10 * step + rank)
    return {"models": {"model": {"w": torch.randn(500, generator=g)}}, "step": step,
            "optimizers": {"optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}}}


def _write(e: Engine, step: int) -> None:
    """What the engine does with a worker's Persist of `step` (its part written, then reported)."""
    skeleton, data, specs = pack(_state(step, e.state.rank))
    spec = RecordSpec(record=full_name(step), kind="full", step=step, skeleton=skeleton, tensors=specs,
                      meta={"step": step})
    e.commits.write_part(spec, memoryview(data))


def _newest(e: Engine) -> int:
    plan = newest_good(e.state.store, ranks=[e.state.rank])
    return plan.step if plan else -1


def test_a_step_commits_on_every_node_once_every_part_is_reported(tmp_path):
    """Rank 0 commits only once rank 1 has reported its part; each node's --dir then holds the
    same manifest and its own rank's part, which restores bit for bit. A kill between the reports
    and rank 0's commit (or its announcement) leaves every node the previous step. Retention
    keeps what a node that has not acknowledged a newer step still resumes from."""
    e0, e1 = _engines(tmp_path)
    _write(e0, 1)
    assert not e0.state.store.is_committed(full_name(1))  # rank 1 has not reported
    _write(e1, 1)
    e0.commits.commit_ready()
    e1.commits.watch_commits()
    for e in (e0, e1):
        store, rank = e.state.store, e.state.rank
        m = store.manifest(full_name(1))
        assert store.ranks_held(m) == [rank] and store.verify_record(m, ranks=[rank]) == []
        got = read_state(store, m, rank)["models"]["model"]["w"]
        assert torch.equal(got, _state(1, rank)["models"]["model"]["w"])
    assert e0.state.board.safe_step(2) == 1

    # step 2: both parts reported, rank 0's engine killed before it commits
    _write(e1, 2)
    e0.state.board.report(full_name(2), 0, _part(e0, 2))
    e1.commits.watch_commits()
    assert (_newest(e0), _newest(e1)) == (1, 1)

    # step 3: rank 0 commits in its own --dir, and is killed before rank 1 publishes the manifest
    _write(e1, 3)
    _write(e0, 3)
    assert (_newest(e0), _newest(e1)) == (3, 1)
    assert e0.state.store.is_committed(full_name(1)), "--keep 1 pruned the step node 1 resumes from"
    assert sorted(set(plans(e0.state.store)) & set(plans(e1.state.store))) == [1]
    e1.commits.watch_commits()  # (the announcement came, after all)
    assert (_newest(e0), _newest(e1)) == (3, 3)
    _write(e1, 4)
    _write(e0, 4)
    e1.commits.watch_commits()
    retain(e0.state)  # (its commit of step 4 pruned before node 1 acknowledged it)
    assert [[m.step for m in e.state.store.manifests()] for e in (e0, e1)] == [[4], [4]]
    # with --replicas, also only what every engine holds its partners' copies of
    assert e0.state.board.safe_step(2, replicated=True) == -1
    e0.state.board.hold(0, 3)
    e1.state.board.hold(1, 4)
    assert e0.state.board.safe_step(2, replicated=True) == 3


@pytest.mark.parametrize("shared", [False, True], ids=["node-local-dir", "shared-dir"])
def test_every_nodes_summary_counts_the_commits_its_own_dir_holds(tmp_path, shared):
    """A node's launcher reads its own node's metrics only: the engine of node 1 (global rank 1)
    logs each step committed in its --dir (its own, published from rank 0's announcement; or the
    shared one, committed by rank 0), so that its exit summary counts them, as node 0's does."""
    e0, e1 = _engines(tmp_path, keep=0, shared=shared)
    for step in (1, 2):
        _write(e1, step)
        _write(e0, step)
        e1.commits.watch_commits()
    for e in (e0, e1):
        e.state.log.close()
        state = MetricsState()
        state.apply_all(MetricsTailer(tmp_path / f"metrics-node{e.state.rank}").poll())
        line = summary_line(state.summary())
        assert "checkpoints committed 2 | last durable step 2 |" in line, (e.state.rank, line)
        assert [m.step for m in e.state.store.manifests()] == [1, 2]


def _part(e: Engine, step: int) -> tuple[str, int]:
    """Rank `e.state.rank`'s part of `step` written into its --dir, as its engine writes it, unreported."""
    skeleton, data, specs = pack(_state(step, e.state.rank))
    e.state.store.write_rank(full_name(step), e.state.rank, memoryview(data), specs, skeleton, {"step": step})
    return e.state.store.part_summary(full_name(step), e.state.rank)


def test_a_record_holding_some_ranks_is_refused_in_one_line_for_the_others(tmp_path):
    """Node 1's --dir holds rank 1's part of each step: `restore --rank 1` restores it, `--rank 0`
    says in one line (exit 2) which ranks the record holds and where the rest are, `verify`
    says the same for each record, and a crafted part of a rank the manifest lacks is refused."""
    e0, e1 = _engines(tmp_path, keep=0)
    for step in (1, 2):
        _write(e0, step)
        _write(e1, step)
        e0.commits.commit_ready()
        e1.commits.watch_commits()
    node1 = e1.state.store.root
    ok = cli(tmp_path, "restore", "--dir", node1, "--rank", "1", "--out", tmp_path / "r1.pt")
    assert ok.returncode == 0, ok.stderr
    got = torch.load(tmp_path / "r1.pt", weights_only=True)
    assert got["step"] == 2 and torch.equal(got["model"]["w"], _state(2, 1)["models"]["model"]["w"])
    for step in ("latest", "1"):
        bad = cli(tmp_path, "restore", "--dir", node1, "--step", step, "--rank", "0", "--out", tmp_path / "r0.pt")
        line = error_line(bad)
        assert bad.returncode == 2 and "holds the part(s) of rank(s) 1 of 2" in line and "--durable" in line, line
        assert "Traceback" not in bad.stderr
    verify = cli(tmp_path, "verify", "--dir", node1)
    assert verify.returncode == 1 and verify.stdout.count("holds the part(s) of rank(s) 1 of 2") == 2, verify.stdout
    listing = json.loads(cli(tmp_path, "ls", "--dir", node1, "--json").stdout)
    assert [r["ranks_here"] for r in listing] == [[1], [1]]
    (node1 / full_name(2) / "rank-00007.json").write_text("{}")  # a rank the manifest lacks
    m = e1.state.store.manifest(full_name(2))
    assert "holds a part of rank 7" in e1.state.store.verify_record(m, ranks=[1])[0]
    assert newest_good(e1.state.store, ranks=[1]).step == 1
    data = node1 / full_name(1) / "rank-00001.data"
    flipped = bytearray(data.read_bytes())
    flipped[0] ^= 1
    data.write_bytes(flipped)  # the part it holds is still checked in full
    verify = cli(tmp_path, "verify", "--dir", node1)
    assert "step-00000001: rank 1 tensor" in verify.stdout and "checksum mismatch" in verify.stdout, verify.stdout


def test_node_local_dir_is_refused_for_a_strategy_whose_part_cannot_restore_alone(tmp_path):
    from ckptrun.config import RunConfig
    from ckptrun.errors import UsageError
    from ckptrun.launcher import replicas

    with pytest.raises(UsageError, match="--node-local-dir: lowdiff's records"):
        replicas.check(RunConfig(strategy="lowdiff", node_local_dir=True), "2")
