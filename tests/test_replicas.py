"""--replicas: who holds whose copy, the memory tier's checks, taking a lost part back into --dir,
and the refusals at start. The two-node runs are in tests/test_two_nodes.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import EXAMPLE, TINY, cli, error_line, pack

from ckptrun.errors import CorruptCheckpoint, UsageError
from ckptrun.restore.recovery import newest_good
from ckptrun.storage.schema import Manifest, rank_files
from ckptrun.storage.store import Store, full_name
from ckptrun.storage.tiers import dpshared
from ckptrun.storage.tiers import mirror as mirror_module
from ckptrun.storage.tiers.base import MANIFEST
from ckptrun.storage.tiers.group import ReplicationGroup
from ckptrun.storage.tiers.memtier import MemoryTier
from ckptrun.storage.tiers.mirror import fill
from ckptrun.storage.tiers.parts import record_parts, thin_rank_part
from ckptrun.strategies import REGISTRY, names_where


def test_groups_are_cliques_across_nodes():
    two = ReplicationGroup(nnodes=2, local=1, replicas=2)
    assert (two.partners(0), two.partners(1)) == ([1], [0])
    # 4 nodes of 2 ranks, K=2, J=2: nodes {0, 2} and {1, 3}; a rank's copies keep its local rank
    g = ReplicationGroup(nnodes=4, local=2, replicas=2, jump=2)
    assert [g.partners(r) for r in range(8)] == [[4], [5], [6], [7], [0], [1], [2], [3]]
    three = ReplicationGroup(nnodes=6, local=1, replicas=3)
    assert [three.partners(r) for r in range(6)] == [[1, 2], [0, 2], [0, 1], [4, 5], [3, 5], [3, 4]]
    for r in range(6):  # symmetric, never on its own node: each engine holds exactly K-1 copies
        assert all(r in three.partners(p) and three.node(p) != three.node(r) for p in three.partners(r))
    with pytest.raises(UsageError, match="multiple of 4 nodes"):
        ReplicationGroup(nnodes=6, local=1, replicas=2, jump=2)
    with pytest.raises(UsageError, match="at least 1"):
        ReplicationGroup(nnodes=2, local=1, replicas=0)


def _steps(root: Path, steps: list[int]) -> Store:
    """--dir with full records of two ranks at `steps`."""
    store = Store(root)
    store.ensure_writable()
    for step in steps:
        for rank in (0, 1):
            g = torch.Generator().manual_seed(10 * step + rank)
            state = {"models": {"model": {"w": torch.randn(3000, generator=g)}}, "step": step,
                     "optimizers": {"optimizer": {"state": {0: {"step": torch.tensor(float(step))}},
                                                  "param_groups": [{"lr": 0.1, "params": [0]}]}}}
            skeleton, data, specs = pack(state)
            store.write_rank(full_name(step), rank, memoryview(data), specs, skeleton, {"step": step})
        assert store.try_commit(full_name(step), kind="full", step=step, first_step=step, world_size=2)
    return store


def _hold(tier: MemoryTier, store: Store, step: int, owner: int = 1) -> Manifest | None:
    """What a partner's engine does with `owner`'s shipped part of `step` (the bytes as sent)."""
    m = store.manifest(full_name(step))
    with record_parts(store, m) as (parts, manifest):
        files = {f: b"".join(src.chunks(1 << 20)) for f, src in parts[owner]}
    return tier.hold(owner, manifest, files)


class _Wire:
    """A gloo group's send/recv between two ends of one process: each message in a queue."""

    def __init__(self) -> None:
        self.queue: list[torch.Tensor] = []
        self.received: list[int] = []  # the size of each buffer a receive was given

    def send(self, tensors, dst, tag):
        self.queue.append(tensors[0].clone())
        return self

    def recv(self, tensors, src, tag):
        self.received.append(tensors[0].numel())
        tensors[0].copy_(self.queue.pop(0))
        return self

    def wait(self, timeout=None):
        return True


def _round(wire: _Wire):
    from ckptrun.engine.replica_round import Round

    r = Round.__new__(Round)  # (its group, without a job store to meet through)
    r.pg = wire
    return r


def test_the_tests_faults_reach_replication_through_one_seam(monkeypatch):
    """`ReplicaFaults` (engine/faults.py) is where the replicator asks whether a test's fault fires: a bit
    flips in copies of the fault's step and later, the engine dies receiving a copy of that step
    or later (its manifest in), and nothing happens without a fault or with another kind."""
    from ckptrun import faults
    from ckptrun.engine.faults import ReplicaFaults

    died = []
    monkeypatch.setattr(faults, "die", lambda: died.append(True))
    none, other = ReplicaFaults(), ReplicaFaults(faults.Fault.parse("kill:step=1"))
    corrupt = ReplicaFaults(faults.Fault.parse("corrupt-replica:step=3"))
    assert not none.corrupts(9) and not other.corrupts(9) and not corrupt.corrupts(2) and corrupt.corrupts(3)
    kill = ReplicaFaults(faults.Fault.parse("kill-engine:step=3:phase=receive"))
    for seam in (none, other, corrupt, ReplicaFaults(faults.Fault.parse("kill-engine:step=3"))):
        seam.receiving(b'{"step": 5}')
    kill.receiving(b'{"step": 2}')
    kill.receiving(b"not json")
    assert not died
    kill.receiving(b'{"step": 3}')
    assert died == [True]


def test_a_copy_crosses_the_wire_whole_and_a_hostile_header_allocates_nothing():
    """A copy goes as a header of sizes, the manifest and index together, then the data; the
    receiver checks the header before it allocates: a header claiming more than a file may hold
    is refused after the header alone."""
    from ckptrun.engine.replica_round import SHIP, THIN

    wire = _Wire()
    r = _round(wire)
    r.send(1, SHIP, 3, [b"{manifest}", bytearray(b"data" * 5), b"{index}"], THIN)
    assert len(wire.queue) == 3
    assert r.recv(0, SHIP) == (3, THIN, [b"{manifest}", b"data" * 5, b"{index}"])
    r.stop(1)
    assert r.recv(0, SHIP) is None
    wire.received.clear()
    wire.queue.append(torch.tensor([3, 0, 10, 1 << 60, 7], dtype=torch.int64))
    with pytest.raises(CorruptCheckpoint, match="header out of range"):
        r.recv(0, SHIP)
    assert wire.received == [5]  # the header only: nothing was allocated for its sizes


def test_a_lost_part_comes_back_from_a_partner(tmp_path):
    """Rank 1's parts deleted (its node's disk lost): the held copy of the newest step completes
    that record again, read through Store; the older records stay incomplete."""
    store = _steps(tmp_path / "ckpts", [1, 2])
    tier = MemoryTier()
    _hold(tier, store, 1)
    _hold(tier, store, 2)
    assert tier.owners == {1: (full_name(2), 2)} and not any(k.startswith(full_name(1)) for k in tier.objects)
    assert _hold(tier, store, 1) is None and tier.owners == {1: (full_name(2), 2)}  # late: the newest stays
    kept = {f: (store.root / full_name(2) / f).read_bytes() for f in rank_files(1)}
    for step in (1, 2):
        for f in rank_files(1):
            (store.root / full_name(step) / f).unlink()
    assert fill(tier, store, full_name(2)) == sorted(rank_files(1))
    assert {f: (store.root / full_name(2) / f).read_bytes() for f in rank_files(1)} == kept
    assert newest_good(Store(store.root)).step == 2


def test_a_held_copy_is_the_buffer_received_not_a_copy_of_it(tmp_path):
    """Holding a partner's part checks its bytes where they are: the 55 MB part of the bench's
    model took 84 ms to hold when it was copied twice, 4 ms now (and half the memory)."""
    store = _steps(tmp_path / "ckpts", [1])
    m = store.manifest(full_name(1))
    with record_parts(store, m) as (parts, manifest):
        files = {f: b"".join(src.chunks(1 << 20)) for f, src in parts[1]}
    tier = MemoryTier()
    tier.hold(1, manifest, files)
    assert all(tier.objects[f"{full_name(1)}/{f}"] is files[f] for f in rank_files(1))


def test_a_part_taken_back_is_on_disk_before_its_record_is(tmp_path, monkeypatch):
    """A node that lost its --dir gets the record back whole: every file flushed to the disk
    before the manifest that commits it is published (a power loss right after would otherwise
    leave a committed record over files only the page cache held)."""
    store = _steps(tmp_path / "ckpts", [1])
    tier = MemoryTier()
    _hold(tier, store, 1)
    kept = {f: (store.root / full_name(1) / f).read_bytes() for f in rank_files(1)}
    shutil.rmtree(store.root / full_name(1))
    flushed = []
    real = mirror_module.fsync_file
    monkeypatch.setattr(mirror_module, "fsync_file", lambda path: flushed.append(
        (path.name.split(".part-")[0].lstrip("."), store.is_committed(full_name(1)))) or real(path))
    assert fill(tier, store, full_name(1), [1]) == sorted(rank_files(1))
    assert sorted(flushed) == sorted([(f, False) for f in rank_files(1)] + [(MANIFEST, False)])
    assert store.is_committed(full_name(1)) and store.ranks_present(full_name(1)) == [1]
    assert {f: (store.root / full_name(1) / f).read_bytes() for f in rank_files(1)} == kept


def test_damaged_copies_are_refused(tmp_path):
    """A part changed in transit is not held (the older copy stays); one that went bad in memory
    is found when it is taken back, and nothing of it is left in --dir."""
    store = _steps(tmp_path / "ckpts", [1, 2])
    tier = MemoryTier()
    _hold(tier, store, 1)
    m = store.manifest(full_name(2))
    with record_parts(store, m) as (parts, manifest):
        files = {f: bytearray(b"".join(src.chunks(1 << 20))) for f, src in parts[1]}
    files[rank_files(1)[0]][100] ^= 1
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        tier.hold(1, manifest, {f: bytes(b) for f, b in files.items()})
    assert tier.owners == {1: (full_name(1), 1)}
    key = f"{full_name(1)}/{rank_files(1)[0]}"
    flipped = bytearray(tier.objects[key])
    flipped[5] ^= 4
    tier.objects[key] = bytes(flipped)
    for f in rank_files(1):
        (store.root / full_name(1) / f).unlink()
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        fill(tier, store, full_name(1))
    assert store.ranks_present(full_name(1)) == [0]


def test_the_engine_ships_the_thin_copy_it_cut_as_the_part_was_written(tmp_path):
    """--node-local-dir: the engine cuts the thin copy of its rank's part from the staging slot
    as the part is written (`Shipper.written`), and once the record commits ships that: the
    same bytes as read back from --dir, without reading them. A copy whose index is not the one
    the manifest pins is not used (the part is read from --dir then)."""
    from ckptrun.engine.replicate import Replicator
    from ckptrun.ipc.events import EventLog

    store = Store(tmp_path / "ckpts")
    store.ensure_writable()
    name, written = full_name(4), {}
    for rank in (0, 1):
        state = {"models": {"model": {"w": torch.arange(3000.0)}}, "rng": torch.full((5,), float(rank))}
        skeleton, data, specs = pack(state)
        meta = {"step": 4, "shared": ["models/model/w"]}
        part = store.write_rank(name, rank, memoryview(data), specs, skeleton, meta)
        assert part.nbytes == len(data) and part.index == (store.root / name / rank_files(rank)[1]).read_bytes()
        written[rank] = (part.index, data)
    assert store.try_commit(name, kind="full", step=4, first_step=4, world_size=2)
    m = store.manifest(name)
    rep = Replicator(EventLog(str(tmp_path / "metrics"), "engine-0"))
    try:
        rep.shipper.written(name, 1, written[1][0], memoryview(written[1][1]))
        assert rep.shipper._cut(m, 1) is None  # (not node-local: nothing is cut)
        rep.state.node_local = True
        rep.shipper.written(name, 1, written[1][0], memoryview(written[1][1]))
        assert rep.shipper._cut(m, 1) == thin_rank_part(store, m, 1) and not rep.shipper._fresh
        rep.shipper.written(name, 1, written[0][0], memoryview(written[0][1]))  # another part's index
        assert rep.shipper._cut(m, 1) is None
    finally:
        rep.close()


def test_the_next_held_step_waits_for_the_copy_before_it_to_leave_one_steps_time_at_most(tmp_path, monkeypatch):
    """A step held in memory is shipped before the next one is held (`wait_held_shipped`), for
    one step's time at most (and MAX_SHIP_WAIT_S): a slow partner holds the engine back that
    long, never longer, and each step is offered in turn."""
    from types import SimpleNamespace

    from ckptrun.engine import replica_ship, replicate
    from ckptrun.ipc.events import EventLog

    shipped, slow = [], {"s": 0.3}

    def ship_held(r, step: int) -> None:
        time.sleep(slow["s"])
        shipped.append(step)

    rep = replicate.Replicator(EventLog(str(tmp_path / "metrics"), "engine-0"))
    monkeypatch.setattr(rep.shipper, "_ship_held", ship_held)
    rep.state.round = SimpleNamespace(live={1})  # (a partner alive; `_ship_held` is the fake above)
    try:
        assert rep.shipper.wait_held_shipped(1.0)  # (nothing offered yet)
        rep.shipper.offer_held(1)
        t0 = time.monotonic()
        assert rep.shipper.wait_held_shipped(5.0) and shipped == [1]
        assert 0.2 < time.monotonic() - t0 < replica_ship.MAX_SHIP_WAIT_S  # (one copy's time, not the step's)
        slow["s"] = 3.0
        rep.shipper.offer_held(2)
        t0 = time.monotonic()
        assert not rep.shipper.wait_held_shipped(0.2) and shipped == [1]  # (one step's time, at most)
        assert 0.15 < time.monotonic() - t0 < 1.0
        t0 = time.monotonic()
        assert not rep.shipper.wait_held_shipped(30.0)  # (MAX_SHIP_WAIT_S, at most)
        assert time.monotonic() - t0 < replica_ship.MAX_SHIP_WAIT_S + 0.5
        while not rep.shipper.wait_held_shipped(1.0):  # (it leaves in the end)
            assert time.monotonic() - t0 < 10
        assert shipped == [1, 2]
    finally:
        rep.state.round = None
        rep.close()


def test_a_thin_copy_holds_only_per_rank_state_and_a_peer_makes_it_whole(tmp_path):
    """The data-parallel short-cut (dpshared.py): a part whose index names its replicated
    tensors ships without them (nor any padding) and is checked as held; made whole from a
    peer's own part of the same record, it completes --dir, every tensor the owner's. A peer
    whose tensor differs, or a kept tensor damaged in transit, is refused."""
    store = Store(tmp_path / "ckpts")
    store.ensure_writable()
    name = full_name(3)
    for rank in (0, 1):
        state = {"models": {"model": {"w": torch.arange(3000.0), "b": torch.arange(7.0)}},
                 "rng": torch.full((5,), float(rank))}
        skeleton, data, specs = pack(state)
        store.write_rank(name, rank, memoryview(data), specs, skeleton,
                         {"step": 3, "shared": ["models/model/w", "models/model/b"]})
    assert store.try_commit(name, kind="full", step=3, first_step=3, world_size=2)
    with record_parts(store, store.manifest(name)) as (parts, manifest):
        whole = {f: b"".join(src.chunks(1 << 20)) for f, src in parts[1]}
    data_file, index_file = rank_files(1)
    index = dpshared.parse(whole[index_file], name)
    shared = dpshared.shared_keys(index)
    slim = dpshared.thin(lambda offset, n: whole[data_file][offset : offset + n], index, shared)
    assert thin_rank_part(store, store.manifest(name), 1) == (slim, whole[index_file])  # (what the engine ships)
    replaced = json.loads(whole[index_file])  # the index file swapped after its check, before it is read again
    replaced["meta"]["shared"] = ["models/model/b"]
    read, reads = store.reader._read_metadata, []

    def swapped(*a):  # the first read (RecordReader.open_rank's, checked) sees the file as committed
        reads.append(a[1])
        return json.dumps(replaced).encode() if reads.count(index_file) > 1 else read(*a)

    store.reader._read_metadata = swapped
    with pytest.raises(CorruptCheckpoint, match="rank 1 index checksum mismatch"):
        thin_rank_part(store, store.manifest(name), 1)
    store.reader._read_metadata = read
    assert len(slim) == 5 * 4 < len(whole[data_file])  # the rng tensor's bytes, nothing else
    tier = MemoryTier()
    damaged = bytearray(slim)
    damaged[3] ^= 1
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        tier.hold(1, manifest, {data_file: bytes(damaged), index_file: whole[index_file]}, thin=True)
    assert tier.hold(1, manifest, {data_file: slim, index_file: whole[index_file]}, thin=True).step == 3
    assert tier.thin == {1} and len(tier.objects[f"{name}/{data_file}"]) == len(slim)

    own = dpshared.parse((store.root / name / rank_files(0)[1]).read_bytes(), name)
    peer_data = (store.root / name / rank_files(0)[0]).read_bytes()

    def peer(key: str, into: memoryview) -> int:
        t = own.tensors[key]
        into[:] = peer_data[t.offset : t.offset + t.nbytes]
        return t.nbytes

    with pytest.raises(CorruptCheckpoint, match="differs"):
        dpshared.rebuild(slim, index, shared | {"rng"}, peer)  # the peer's rng is its own
    rebuilt = dpshared.rebuild(slim, index, shared, peer)
    for t in index.tensors.values():
        assert rebuilt[t.offset : t.offset + t.nbytes] == whole[data_file][t.offset : t.offset + t.nbytes]
    for f in rank_files(1):
        (store.root / name / f).unlink()
    back = MemoryTier()
    back.hold(1, manifest, {data_file: rebuilt, index_file: whole[index_file]})
    assert fill(back, store, name) == sorted(rank_files(1))  # (which checks the record through Store)
    assert store.ranks_present(name) == [0, 1]


def test_refused_at_start(tmp_path):
    """One line, exit 2: a strategy that cannot, too few nodes, a jump the nodes do not fit."""
    cannot = next(name for name, e in REGISTRY.items() if not e.replicas)
    line = error_line(cli(tmp_path, "run", "--strategy", cannot, "--replicas", "2", "--nnodes", "2", EXAMPLE, *TINY))
    assert f"use one of: {names_where(lambda e: e.replicas)}" in line
    can = next(name for name, e in REGISTRY.items() if e.replicas)
    line = error_line(cli(tmp_path, "run", "--strategy", can, "--replicas", "2", EXAMPLE, *TINY))
    assert "at most 1 (--nnodes 1)" in line
    line = error_line(cli(tmp_path, "run", "--strategy", can, "--replicas", "2", "--replica-jump", "2", "--nnodes", "2",
                              EXAMPLE, *TINY))
    assert "multiple of 4 nodes" in line
    assert not (tmp_path / "ckpts").exists()  # refused before anything starts


# One engine's replicator, as the engine drives it: each round (PREFIX[@RANK]=RECORD,...) joined,
# as RANK if given (the first with the fault PEER_FAULT names), and its committed records offered;
# then THEN: "-" closes, "hang" waits to be killed, a record name awaits the test's word that the
# partner is gone, then is offered.
PEER = """
import os, sys, time
from ckptrun.engine.replicate import Replicator
from ckptrun.faults import Fault
from ckptrun.ipc.events import EventLog
from ckptrun.storage.schema import record_step
from ckptrun.storage.store import Store
root, rank, port, then, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:]
rep = Replicator(EventLog(os.path.join(root, "..", "metrics"), f"engine-{rank}-{os.getpid()}"))
for i, spec in enumerate(rounds):
    head, _, offers = spec.partition("=")
    prefix, _, as_rank = head.partition("@")
    rep.join({"addr": "127.0.0.1", "port": port, "prefix": prefix, "replicas": 2, "jump": 1, "local": 1},
             int(as_rank or rank), 2, Store(root), Fault.parse(os.environ["PEER_FAULT"]) if i == 0 and
             os.environ.get("PEER_FAULT") else None)
    for name in filter(None, offers.split(",")):
        rep.shipper.offer(name, record_step(name))
        while rep.shipper._offered is not None:
            time.sleep(0.05)
    if i == 0 and then == "hang":
        time.sleep(600)
    if i == 0 and then != "-":
        while not os.path.exists(os.path.join(root, "..", "gone")):
            time.sleep(0.05)
        rep.shipper.offer(then, record_step(then))
        time.sleep(1)
rep.close()
"""


def _peer(root: Path, master: dist.TCPStore, rank: int, then: str, *rounds: str, fault: str = "") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PEER, root, str(rank), str(master.port), then, *rounds],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PEER_FAULT": fault})


def _events(tmp_path: Path, kind: str) -> list[dict]:
    lines = [line for f in sorted((tmp_path / "metrics").glob("*.jsonl")) for line in f.read_text().splitlines()]
    return [e for e in map(json.loads, lines) if e["type"] == kind]


@pytest.mark.parametrize("swap", [False, True], ids=["same-ranks", "ranks-swap"])
def test_engines_ship_hold_and_give_back_over_gloo(swap, tmp_path):
    """Two engines on loopback: each holds the other's newest step; one that is killed is dropped
    with one line; in the next round the rank whose --dir lost its part gets it back: the
    replacement from the survivor, or the survivor from itself where the rendezvous gave it the
    dead node's rank."""
    store = _steps(tmp_path / "ckpts", [1, 2, 3])
    names = f"{full_name(1)},{full_name(2)}"
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))

    def peer(rank: int, then: str, *rounds: str) -> subprocess.Popen:
        return _peer(store.root, master, rank, then, *rounds)

    first = peer(0, full_name(3), f"r1={names}", "r2@1=" if swap else "r2=")
    second = peer(1, "hang", f"r1={names}")
    deadline = time.monotonic() + 120
    while len(_events(tmp_path, "replica_held")) < 4:
        assert time.monotonic() < deadline and second.poll() is None, second.stderr.read()
        time.sleep(0.1)
    second.kill()  # its node dies
    second.wait()
    for step in (2, 3):  # with its disk (step 3: written, never shipped)
        for f in rank_files(1):
            (store.root / full_name(step) / f).unlink()
    (tmp_path / "gone").touch()
    third = peer(1, "-", "r2@0=" if swap else "r2=")
    assert (first.wait(120), third.wait(120)) == (0, 0), first.stderr.read() + third.stderr.read()
    said = first.stderr.read() + third.stderr.read()
    assert said.count("replicas to rank 1 stopped") == 1, said
    held = sorted((e["rank"], e["owner"], e["step"]) for e in _events(tmp_path, "replica_held"))
    assert held == [(0, 1, 1), (0, 1, 2), (1, 0, 1), (1, 0, 2)]
    restored = _events(tmp_path, "replica_restored")
    assert [(e["rank"], e["step"], e["holder"]) for e in restored] == [(1, 2, 1 if swap else 0)], said
    assert newest_good(Store(store.root)).step == 2


def test_a_partner_killed_mid_copy_is_dropped_and_the_next_round_copies_to_its_replacement(tmp_path):
    """Rank 1's engine dies while it receives rank 0's copy of step 2 (its manifest in, its files
    not: `kill-engine:step=2:phase=receive`). Rank 0's engine drops it with one line, shipping
    on (the trainer never waits on it), and in the next round ships its next step to the
    replacement, which holds it."""
    store = _steps(tmp_path / "ckpts", [1, 2, 3])
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    first = _peer(store.root, master, 0, full_name(3), f"r1={full_name(1)},{full_name(2)}", f"r2={full_name(3)}")
    second = _peer(store.root, master, 1, "hang", "r1=", fault="kill-engine:step=2:phase=receive")
    assert second.wait(120) == -signal.SIGKILL, second.stderr.read()
    (tmp_path / "gone").touch()
    third = _peer(store.root, master, 1, "hang", "r2=")
    try:
        assert first.wait(120) == 0, first.stderr.read() + third.stderr.read()
    finally:
        third.kill()
    said = first.stderr.read()
    assert said.count("replicas to rank 1 stopped") == 1, said
    held = [(e["rank"], e["owner"], e["step"]) for e in _events(tmp_path, "replica_held")]
    assert (1, 0, 2) not in held and (1, 0, 3) in held, held
    sent = [e for e in _events(tmp_path, "replica_sent") if e["rank"] == 0 and e["step"] == 3]
    assert sent and sent[-1]["partners"] == [1], sent


def test_an_engine_whose_partner_closes_while_it_ships_exits_cleanly(tmp_path):
    """Rank 1's engine leaves each round as soon as it joins (the end of a run), while rank 0's
    ships it a copy: rank 0's engine still ends with exit code 0 (its shipping thread, left
    inside gloo, once aborted the process at exit)."""
    store = _steps(tmp_path / "ckpts", [1, 2, 3])
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    first = _peer(store.root, master, 0, "-", f"r1={full_name(1)}", f"r2={full_name(3)}")
    second = _peer(store.root, master, 1, "-", "r1=", "r2=")
    assert (first.wait(120), second.wait(120)) == (0, 0), first.stderr.read() + second.stderr.read()


def _held_step(step: int, shared_fill: int = 7, rank: int = 0) -> tuple:
    """(spec, slot bytes) of `rank`'s step held in a staging slot: a shared tensor (every DDP
    rank's alike) and a per-rank one, at 4 KiB-aligned places."""
    from ckptrun.ipc.messages import RecordSpec

    slot = bytearray(8192)
    slot[:4096] = bytes([shared_fill]) * 4096
    slot[4096:4100] = (100 * rank + step).to_bytes(4, "little")
    tensors = {"models/model/w": {"dtype": "float32", "shape": [1024], "offset": 0, "nbytes": 4096},
               "rng/cpu": {"dtype": "uint8", "shape": [4], "offset": 4096, "nbytes": 4}}
    spec = RecordSpec(record=full_name(step), kind="full", step=step, skeleton={"step": step}, tensors=tensors,
                      meta={"shared": ["models/model/w"]})
    return spec, slot


def test_a_held_step_ships_thin_is_checked_kept_two_deep_and_made_whole_from_the_partners_own_step():
    """A copy of a step held in memory only: cut thin (the shared tensor left out), checked as it
    arrives, the two newest kept per owner; made whole with the partner's own tensor of the same
    step, checked against the owner's index. A bit gone bad, or a partner whose own tensor
    differs, is refused."""
    from ckptrun.engine.held_copies import HeldCopies, checked, cut, spec_of
    from ckptrun.engine.replica_return import reader

    copies = HeldCopies()
    for step in (5, 6, 7):
        spec, slot = _held_step(step)
        copy = cut(1, spec, memoryview(slot))
        assert copy.thin and len(copy.data) == 4  # the per-rank tensor only
        assert copies.hold(1, checked(1, copy.header, copy.data, copy.raw_index, thin=True))
    assert copies.steps(1) == [7, 6] and not copies.hold(1, copies.get(1, 6))  # older: not kept
    own_spec, own_slot = _held_step(6)  # the partner's own step 6: the shared tensor alike
    whole = copies.whole(1, 6, reader(own_spec, memoryview(own_slot)))
    assert bytes(whole.data) == bytes(_held_step(6)[1]) and not whole.thin
    again = checked(1, whole.header, whole.data, whole.raw_index, thin=False)
    assert spec_of(again).tensors == _held_step(6)[0].tensors and spec_of(again).step == 6
    bad = bytearray(copies.get(1, 7).data)
    bad[0] ^= 1
    with pytest.raises(CorruptCheckpoint, match="rank 1's copy of step 7"):
        checked(1, copies.get(1, 7).header, bytes(bad), copies.get(1, 7).raw_index, thin=True)
    other_spec, other_slot = _held_step(6, shared_fill=9)  # not data-parallel after all
    with pytest.raises(CorruptCheckpoint, match="differs from the owner's"):
        copies.whole(1, 6, reader(other_spec, memoryview(other_slot)))
    with pytest.raises(CorruptCheckpoint, match="no longer held"):
        copies.whole(1, 7, None)
    with pytest.raises(CorruptCheckpoint, match="no valid header"):
        checked(1, b'{"step": -1, "kind": "full"}', copies.get(1, 7).data, copies.get(1, 7).raw_index, thin=True)


# One engine's replicator with steps held in memory only (a snapshot strategy's slots, here a
# dict): MODE "ship" holds its rank's steps 1 and 2, ships each as it holds it, then waits to be
# killed; "survive" does the same, and once the test says its partner is gone joins round r2 as
# AS_RANK, letting go of its steps first (adopted, as the engine does when the rank changes);
# "replace" joins r2 as AS_RANK holding nothing; WORLD engines, --replica-jump JUMP. Each writes
# the steps it holds after r2's exchange, by step, and the ranks it keeps copies of, to
# held-RANK.json.
HELD_PEER = """
import contextlib, json, os, sys, time
sys.path.insert(0, sys.argv[5])
from test_replicas import _held_step
from ckptrun.engine.replicate import Replicator
from ckptrun.ipc.events import EventLog
from ckptrun.storage.store import Store
root, rank, port, mode, _, as_rank, world, jump = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], \
    sys.argv[5], *map(int, sys.argv[6:9])

class Slots:
    def __init__(self, steps, rank):
        self.held = {s: _held_step(s, rank=rank) for s in steps}
    def held_steps(self):
        return sorted(self.held, reverse=True)
    @contextlib.contextmanager
    def pinned(self, step):
        got = self.held.get(step)
        yield None if got is None else (got[0], memoryview(got[1]))
    def install(self, spec, data):
        self.held[spec.step] = (spec, bytearray(data))

rep = Replicator(EventLog(os.path.join(root, "..", "metrics"), f"engine-{rank}-{os.getpid()}"))
def join(prefix, r, memory):
    rep.join({"addr": "127.0.0.1", "port": port, "prefix": prefix, "replicas": 2, "jump": jump, "local": 1},
             r, world, Store(root), None, memory=memory)
if mode in ("ship", "survive"):
    memory = Slots([], rank)
    join("r1", rank, memory)
    for step in (1, 2):
        memory.held[step] = _held_step(step, rank=rank)
        rep.shipper.offer_held(step)
        assert rep.shipper.wait_held_shipped(30)
    if mode == "ship":
        time.sleep(600)
    while not os.path.exists(os.path.join(root, "..", "gone")):
        time.sleep(0.05)
    if as_rank != rank:
        rep.returns.adopt(rank, memory, [])
        memory = Slots([], as_rank)
    join("r2", as_rank, memory)
else:
    memory = Slots([], as_rank)
    join("r2", as_rank, memory)
with open(os.path.join(root, "..", f"held-{as_rank}.json"), "w") as f:
    json.dump({"steps": {s: bytes(d).hex() for s, (_, d) in memory.held.items()},
               "copies": sorted(rep.state.copies.owners)}, f)
rep.close()
"""


def test_steps_held_in_memory_only_come_back_when_the_rendezvous_swaps_the_ranks(tmp_path):
    """Two engines on loopback hold their steps 1 and 2 in memory only and ship them thin (the
    shared tensor left out). One dies, and the rendezvous gives its replacement rank 0 and the
    survivor rank 1: the survivor's engine has let go of its old rank's steps (adopted whole);
    the replacement takes the newest back from it, and the survivor holds its new rank's steps
    again from its own copies, completed with the shared tensor of the state it let go of. Both
    end with their rank's state byte for byte. (Without a swap: the two-node tests.)"""
    root = tmp_path / "ckpts"
    root.mkdir()
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))

    peer = _held_peers(root, master, world=2, jump=1)
    survivor, lost = peer(0, "survive", 1), peer(1, "ship", 1)
    deadline = time.monotonic() + 120
    while len(_events(tmp_path, "replica_held")) < 4:
        assert time.monotonic() < deadline and lost.poll() is None and survivor.poll() is None, \
            lost.stderr.read() if lost.poll() is not None else survivor.stderr.read()
        time.sleep(0.1)
    lost.kill()  # its node dies, with its memory
    lost.wait()
    (tmp_path / "gone").touch()
    replacement = peer(1, "replace", 0)
    assert (survivor.wait(120), replacement.wait(120)) == (0, 0), survivor.stderr.read() + replacement.stderr.read()
    held = _held_after(tmp_path, 2)
    # the survivor (rank 1 now) from its own copies, both steps; the replacement (rank 0) from it
    assert sorted(held[1]) == ["1", "2"] and sorted(held[0]) == ["2"], held
    restored = sorted((e["rank"], e["step"], e["holder"]) for e in _events(tmp_path, "replica_restored"))
    assert restored == [(0, 2, 1), (1, 1, 1), (1, 2, 1)], restored


def _held_peers(root: Path, master: dist.TCPStore, world: int,
                jump: int) -> Callable[[int, str, int], subprocess.Popen]:
    """Start a HELD_PEER: (rank, mode, as_rank) -> its process."""
    def peer(rank: int, mode: str, as_rank: int) -> subprocess.Popen:
        argv = [sys.executable, "-c", HELD_PEER, root, str(rank), str(master.port), mode, Path(__file__).parent,
                str(as_rank), str(world), str(jump)]
        return subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)

    return peer


def _held_after(tmp_path: Path, world: int) -> dict[int, dict]:
    """The steps each rank's engine holds after the second round (each its rank's bytes, checked)."""
    held = {r: json.loads((tmp_path / f"held-{r}.json").read_text())["steps"] for r in range(world)}
    for r, steps in held.items():
        for step, data in steps.items():
            assert bytes.fromhex(data) == bytes(_held_step(int(step), rank=r)[1]), (r, step)
    return held


def test_steps_held_in_memory_only_come_back_from_engines_that_are_not_the_ranks_partners(tmp_path):
    """Four engines, --replicas 2 --replica-jump 2 (groups of ranks {0, 2} and {1, 3}), hold their
    steps 1 and 2 in memory only, copied thin to their partners. The engine of rank 0 dies, and
    the rendezvous ranks the nodes anew: each survivor one rank down, the replacement rank 3. No
    rank's state is then held by its new partner: each takes its newest step back from the engine
    that holds it (its old owner, or its old partner), a partner or not; and each engine then
    keeps copies of its new partner's steps only."""
    root = tmp_path / "ckpts"
    root.mkdir()
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    peer = _held_peers(root, master, world=4, jump=2)
    lost, *survivors = [peer(0, "ship", 0), *(peer(r, "survive", r - 1) for r in (1, 2, 3))]
    deadline = time.monotonic() + 120
    while len(_events(tmp_path, "replica_held")) < 8:
        assert time.monotonic() < deadline and all(p.poll() is None for p in (lost, *survivors)), \
            "".join(p.stderr.read() for p in (lost, *survivors) if p.poll() is not None)
        time.sleep(0.1)
    lost.kill()  # its node dies, with its memory
    lost.wait()
    (tmp_path / "gone").touch()
    ended = [*survivors, peer(0, "replace", 3)]
    assert [p.wait(120) for p in ended] == [0] * 4, "".join(p.stderr.read() for p in ended)
    held = _held_after(tmp_path, 4)
    assert all(sorted(steps) == ["2"] for steps in held.values()), held
    restored = sorted((e["rank"], e["step"], e["holder"]) for e in _events(tmp_path, "replica_restored"))
    # (rank 1's step 2 is held by the engines now ranks 0 and 2; the newer holder's rank is asked)
    assert restored == [(0, 2, 1), (1, 2, 2), (2, 2, 1), (3, 2, 2)], restored
    group = ReplicationGroup(nnodes=4, local=1, replicas=2, jump=2)
    copies = {r: json.loads((tmp_path / f"held-{r}.json").read_text())["copies"] for r in range(4)}
    assert all(set(copies[r]) <= set(group.partners(r)) for r in range(4)), copies


def test_the_exchange_board_reads_what_is_posted_for_this_rank_checked_after_every_engine_said_it():
    """A round's exchange through its job store (engine/round_board.py): each engine reads what
    is posted under its rank, from any engine, once all have passed the barrier; a post naming a
    rank outside the round, a record path or a negative step is refused; an engine that never
    comes leaves the others to their records after the timeout."""
    from ckptrun.engine.round_board import Board

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))

    def client() -> dist.PrefixStore:  # (each engine its own connection, as in a round)
        return dist.PrefixStore("r1/replicas", dist.TCPStore("127.0.0.1", master.port, is_master=False,
                                                             timeout=timedelta(seconds=10)))

    store = client()
    boards = [Board(client(), r, 3, "held", timeout=10) for r in range(3)]
    boards[0].post("for/2", {"kept": [5, 4], "whole": [5]})
    boards[1].post("for/2", {"kept": [5], "whole": []})
    passed = []
    threads = [threading.Thread(target=lambda b=b: passed.append(b.sync("said"))) for b in boards]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(passed) == 3  # (every engine through the barrier, none timed out)
    assert boards[2].read("for/2", ("kept", "whole")) == [{"kept": [5, 4], "whole": [5], "from": 0},
                                                          {"kept": [5], "whole": [], "from": 1}]
    assert boards[1].read("for/1", ()) == []
    for bad in ({"from": 3}, {"from": 0, "record": "../../outside"}, {"from": 0, "step": -1},
                {"from": 0, "holder": 3}, {"from": 0, "whole": ["5"]}, {"from": 0, "kept": []}):
        store.append("held/for/0", json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match="malformed post"):
            boards[0].read("for/0", ("kept", "whole"))
        store.delete_key("held/for/0")
    alone = Board(store, 0, 2, "records", timeout=0.5)
    with pytest.raises(RuntimeError):
        alone.sync("said")


def test_a_copy_that_cannot_be_held_is_refused_in_one_line_and_the_next_one_is_held(tmp_path, monkeypatch, capsys):
    """Whatever holding a partner's copy raises (an error nobody foresaw, stood in for), the copy
    is refused in one line and the receiving thread goes on to the next copy, rather than end
    silently with its partner still shipping."""
    from ckptrun.engine.held_copies import cut
    from ckptrun.engine.replica_round import HELD, SHIP, THIN
    from ckptrun.engine.replicate import Replicator
    from ckptrun.ipc.events import EventLog

    rep = Replicator(EventLog(tmp_path / "metrics", "engine-0"))
    rep.state.store = Store(tmp_path)
    wire = _Wire()
    r = _round(wire)
    r.rank, r.live = 0, {1}
    rep.state.round = r
    real = rep.state.copies.hold

    def hold(owner, copy, damage=False):
        if copy.step == 1:
            raise ValueError("something unforeseen")
        return real(owner, copy, damage)

    monkeypatch.setattr(rep.state.copies, "hold", hold)
    for step in (1, 2):
        spec, slot = _held_step(step, rank=1)
        copy = cut(1, spec, memoryview(slot))
        r.send(0, SHIP, 1, copy.blobs(), HELD | THIN)
    r.stop(0)
    rep.holder.receive(r, 1)  # (returns at the STOP, after both copies)
    assert rep.state.copies.steps(1) == [2]
    said = [line for line in capsys.readouterr().err.splitlines() if "refused" in line]
    assert said == ["ckptrun: rank 0: refused rank 1's copy (ValueError: something unforeseen); keeping "
                    "what it holds"], said
    rep.state.round = None
    rep.close()
