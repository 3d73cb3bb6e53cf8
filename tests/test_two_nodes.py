"""Two real nodes: each in a network namespace of its own (and a host name of its own), joined by
a veth pair, with its own launcher, engine and worker (c10d rendezvous, gloo), one shared --dir
(or with --node-local-dir each node its own).

One node's whole process tree is SIGKILLed mid-run and started again, as a job scheduler
restarts a node: the surviving node's agent restarts its worker, both resume from the same
committed step, and every rank's final state equals an uninterrupted two-node run's bit for bit.
No step is ever committed without both nodes' parts. The replacement node may come back under
an address that sorts first, so that the rendezvous ranks it 0 and the survivor 1: each rank's
state follows the rank, and the survivor's engine gives up what it held for its old rank.
Needs root (CAP_NET_ADMIN), `ip` and `unshare` (ckptrun/bench/netns.py); skipped, saying which is
missing, elsewhere.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    EXAMPLE,
    FULL,
    LONG,
    assert_training_state,
    clean_env,
    cli,
    error_line,
    load,
    ok,
    restore,
    run_cmd,
    verify,
)

from ckptrun.bench import netns
from ckptrun.config import RunConfig
from ckptrun.storage.schema import rank_files
from ckptrun.storage.store import Store, full_name
from ckptrun.strategies import REGISTRY

STOP = 24  # optimizer steps of each run
KILL_AFTER = 3  # node 1 is killed once this step is committed
PORT = 29611
# Rendezvous settings that keep the test short: a dead node's heartbeats are missed after 3 s
# (torch's default: 15 s) and a join gives up after 60 s.
RDZV_CONF = "join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3"
RUN_TIMEOUT_S = 180
ARGS = [*LONG, "--stop-after", STOP, "--save-at", STOP, "--save-path", "own-{rank}.pt"]


class Node(netns.Node):
    """A node of these tests: it starts `ckptrun run` on the example."""

    def start(self, cwd: Path, host: str, strategy: str, *, addr: str | None = None, extra: tuple[str, ...] = (),
              fault: str | None = None, args: list[Any] = ARGS) -> subprocess.Popen:
        """Its launcher (`ckptrun run`, node rank `rank`, with `extra` flags and `fault`). The
        rendezvous ranks nodes by their address (`--local-addr`, default `self.addr`). --dir is
        `ckpts`, shared, or with --node-local-dir among `extra` the node's own (`own_dir`)."""
        argv = [sys.executable, "-m", "ckptrun", "run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(self.rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{PORT}",
                "--rdzv-id", "two-nodes", "--rdzv-conf", f"{RDZV_CONF},is_host={str(self.rank == 0).lower()}",
                "--local-addr", addr or self.addr, "--max-restarts", "1", "--no-dashboard",
                "--dir", self.own_dir if "--node-local-dir" in extra else "ckpts",
                "--keep", "0", "--metrics-dir", f"metrics-node{self.rank}", "--strategy", strategy,
                *REGISTRY[strategy].short_run_flags, *extra, EXAMPLE,
                *map(str, args)]
        return self.popen(argv, cwd, {**clean_env(fault), "OMP_NUM_THREADS": "1"}, cwd / f"node{self.rank}.log")

    @property
    def own_dir(self) -> str:
        """Its own --dir (--node-local-dir), relative to the test's folder."""
        return f"ckpts-node{self.rank}"


@pytest.fixture
def nodes() -> Iterator[tuple[Node, Node]]:
    """Two nodes (bench/netns.py), torn down however the test ends."""
    try:
        with netns.node_pair(Node) as pair:
            yield pair
    except netns.NetnsUnavailable as e:
        pytest.skip(f"two-node test skipped: {e}")


def _finish(procs: list[subprocess.Popen], cwd: Path) -> list[int]:
    try:
        return [p.wait(timeout=RUN_TIMEOUT_S) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"a node did not finish in {RUN_TIMEOUT_S} s\n{_logs(cwd)}")


def _logs(cwd: Path) -> str:
    return "\n".join(f"--- node{r}\n" + (cwd / f"node{r}.log").read_text()[-3000:] for r in (0, 1))


def _committed_with_both_parts(cwd: Path) -> list[int]:
    """Every committed step lists both ranks' parts, and `ckptrun verify` passes; the steps."""
    ms = Store(cwd / "ckpts").manifests()
    for m in ms:
        assert (m.world_size, sorted(m.index_checksums)) == (2, ["0", "1"]), f"{m.name} lacks a node's part"
    ok(verify(cwd, "ckpts"))
    return [m.step for m in ms]


def _newest(cwd: Path) -> int:
    """The newest committed step in cwd/ckpts (-1: none yet)."""
    return max((m.step for m in Store(cwd / "ckpts").manifests(warn=False)), default=-1)


def _runs(cwd: Path, node: Node) -> list[dict]:
    """Every `run` event (one per worker start) of one node's workers, in the order they started."""
    events = [json.loads(line) for f in (cwd / f"metrics-node{node.rank}").glob("worker-*.jsonl")
              for line in f.read_text().splitlines()]
    return sorted((e for e in events if e.get("type") == "run"), key=lambda e: e["t"])


# Under --full only (each adds about half a minute): every registered strategy with ranks kept
# and swapped. By default the default strategy's node is killed and restarted with its ranks
# kept in each replication test below (node 1 lost, started again, resumed from disk or a
# partner), and tests/test_replicas.py's engines swap ranks between rounds.
CASES = [pytest.param(s, swap, id=f"{s}-{'ranks-swap' if swap else 'same-ranks'}", marks=FULL)
         for swap in (False, True) for s in REGISTRY]


@pytest.mark.parametrize(("strategy", "swap"), CASES)
def test_node_killed_and_restarted_resumes_exactly(nodes, tmp_path, strategy, swap):
    """`swap`: the replacement node has another address, which sorts before the surviving
    node's, so the rendezvous gives it rank 0 and the survivor rank 1: each rank's state follows
    the rank, not the node, and the survivor's engine serves its worker's new rank."""
    head, other = nodes
    t0 = time.monotonic()
    plain = tmp_path / "uninterrupted"
    plain.mkdir()
    procs = [head.start(plain, head.addr, strategy), other.start(plain, head.addr, strategy)]
    assert _finish(procs, plain) == [0, 0], _logs(plain)
    assert _committed_with_both_parts(plain)[-1] == STOP
    t_plain = time.monotonic() - t0

    killed = tmp_path / "killed"
    killed.mkdir()
    procs = [head.start(killed, head.addr, strategy), other.start(killed, head.addr, strategy)]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while _newest(killed) < KILL_AFTER:  # (whatever the strategy's layout)
        assert time.monotonic() < deadline and procs[1].poll() is None, _logs(killed)
        time.sleep(0.01)
    other.kill()
    t_kill = time.time()
    assert procs[1].wait(timeout=30) == -signal.SIGKILL
    at_kill = _newest(killed)
    # Mid-run: had the surviving node's worker finished its steps, its agent would wait at torch
    # elastic's exit barrier and never rejoin, and the restarted node could not rendezvous.
    assert at_kill < STOP and not (killed / "own-0.pt").exists(), "the node was killed after the run ended"
    procs[1] = other.start(killed, head.addr, strategy,  # the scheduler restarts the node
                           addr=other.other_addr if swap else None)
    assert _finish(procs, killed) == [0, 0], _logs(killed)
    t_all = time.monotonic() - t0

    steps = _committed_with_both_parts(killed)
    assert steps[-1] == STOP
    # The surviving node's agent restarted its worker once: counted against --max-restarts when
    # the worker failed (a collective with the dead node), not when it was held back waiting for
    # a checkpoint slot the dead node's steps hold (lightcheck) and was restarted as the new node
    # joined (a membership change). The restarted node starts its count afresh. Both resume
    # from one committed step.
    survivor, restarted = ([e for e in _runs(killed, node) if e["t"] > t_kill] for node in nodes)
    resumed = survivor + restarted
    assert [e["restart_count"] for e in survivor] in ([0], [1]), resumed
    assert [e["restart_count"] for e in restarted] == [0], resumed
    assert [e["rank"] for e in survivor + restarted] == ([1, 0] if swap else [0, 1]), resumed
    assert len({e["resume_step"] for e in resumed}) == 1, f"the ranks resumed from different steps: {resumed}"
    assert KILL_AFTER <= resumed[0]["resume_step"] < STOP, resumed
    for rank in (0, 1):
        assert_training_state(load(killed / f"own-{rank}.pt"), load(plain / f"own-{rank}.pt"))
    back = max(e["t"] for e in resumed) - t_kill
    print(f"two nodes, {strategy}: uninterrupted run {t_plain:.1f} s, whole test {t_all:.1f} s; killed with step "
          f"{at_kill} committed, resumed at {resumed[0]['resume_step']}, {back:.1f} s after the kill")


REPLICAS = ("--replicas", "2")
REPLICATED = 5  # node 1 is killed once node 0's engine holds its part of this step or a later one


def _held(cwd: Path, owner: int, before: float = math.inf) -> list[int]:
    """The steps of `owner`'s copies node 0's engine has held (before time `before`), in order."""
    lines = (cwd / "metrics-node0" / "engine-0.jsonl").read_text().splitlines()
    return [e["step"] for e in map(json.loads, lines)
            if e.get("type") == "replica_held" and e["owner"] == owner and e["t"] < before]


def _start_replicated(cwd: Path, head: Node, other: Node, strategy: str, *, fault: str | None = None,
                      extra: tuple[str, ...] = REPLICAS) -> list[subprocess.Popen]:
    """Both nodes started in a new folder `cwd`; returned once node 0's engine holds a copy of
    rank 1's part of step REPLICATED or later."""
    cwd.mkdir()
    procs = [head.start(cwd, head.addr, strategy, extra=extra, fault=fault),
             other.start(cwd, head.addr, strategy, extra=extra)]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (cwd / "metrics-node0" / "engine-0.jsonl").exists() or max(_held(cwd, 1), default=-1) < REPLICATED:
        assert time.monotonic() < deadline and procs[1].poll() is None, _logs(cwd)
        time.sleep(0.05)
    return procs


def _lose_node1(cwd: Path, head: Node, other: Node, strategy: str, *, fault: str | None = None,
                lost: Callable[[int], bool], extra: tuple[str, ...] = REPLICAS, swap: bool = False
                ) -> tuple[int, float]:
    """A run with --replicas 2 (and `extra`) in which node 1's whole tree is killed once node 0
    holds a copy of step REPLICATED or later, node 1's part of the steps `lost(step)` picks is
    deleted (its disk lost; with --node-local-dir its whole --dir) and node 1 starts again (with
    `swap`, under an address the rendezvous ranks first). Returns (newest step node 0 held, when
    node 1 was killed)."""
    procs = _start_replicated(cwd, head, other, strategy, fault=fault, extra=extra)
    other.kill()
    t_kill = time.time()
    assert procs[1].wait(timeout=30) == -signal.SIGKILL
    time.sleep(1)  # rank 0's engine commits nothing more: rank 1's writer is gone
    held = max(_held(cwd, 1))
    assert held < STOP and not (cwd / "own-0.pt").exists(), "the node was killed after the run ended"
    if "--node-local-dir" in extra:  # (node 0's engine lives on: its worker waits for the new node)
        _lists_the_copy_of_rank1(cwd, head)
    if "--node-local-dir" in extra:
        shutil.rmtree(cwd / other.own_dir)
    for part in (cwd / "ckpts").glob("step-*/rank-00001.*"):
        if lost(int(part.parent.name.removeprefix("step-"))):
            part.unlink()
    t_back = time.time()
    procs[1] = other.start(cwd, head.addr, strategy, extra=extra, addr=other.other_addr if swap else None)
    assert _finish(procs, cwd) == [0, 0], _logs(cwd)
    # Copies node 1 sent before it died may be held later than the look above on a loaded machine
    # (the receiving thread behind): what node 0 held of the old node 1 is what it held before the
    # new one started.
    return max(_held(cwd, 1, before=t_back)), t_kill


def _lists_the_copy_of_rank1(cwd: Path, head: Node) -> None:
    """`ckptrun ls` on node 0 (its host) says which of its --dir's steps its engine holds rank 1's
    copy of (tiers `copy:1`)."""
    out = cwd / "ls-node0.json"
    argv = [sys.executable, "-m", "ckptrun", "ls", "--json", "--dir", head.own_dir]
    lister = head.popen(argv, cwd, clean_env(None), out)
    assert lister.wait(timeout=60) == 0, out.read_text()
    rows = json.loads(out.read_text())
    assert any("copy:1" in r.get("tiers", ()) for r in rows), rows


def _resumed_at(cwd: Path, nodes: tuple[Node, Node], after: float) -> int:
    """The one step both ranks resumed from after time `after` (each started once since)."""
    resumed = [e for node in nodes for e in _runs(cwd, node) if e["t"] > after]
    assert len(resumed) == 2 and len({e["resume_step"] for e in resumed}) == 1, resumed
    return resumed[0]["resume_step"]


def _back_from_partner(cwd: Path, plain: Path, nodes: tuple[Node, Node], held: int, t_kill: float) -> dict:
    """Node 1's engine took step `held` back from node 0's memory (its one `replica_restored`
    event, returned), both ranks resumed from it after `t_kill`, and their final states equal
    the uninterrupted run's (in `plain`) bit for bit."""
    back = [json.loads(line) for line in (cwd / "metrics-node1" / "engine-0.jsonl").read_text().splitlines()]
    restored = [e for e in back if e.get("type") == "replica_restored"]
    assert [(e["step"], e["holder"]) for e in restored] == [(held, 0)], _logs(cwd)
    assert _resumed_at(cwd, nodes, t_kill) == held
    # Node 0 shipped to a partner that died, maybe mid-copy, and went on; the replacement holds
    # its copies of the steps after the resume.
    again = [e["step"] for e in back if e.get("type") == "replica_held" and e["owner"] == 0 and e["t"] > t_kill]
    assert again and max(again) > held, f"node 1's new engine held no copy of rank 0's newer steps: {again}"
    for rank in (0, 1):
        assert_training_state(load(cwd / f"own-{rank}.pt"), load(plain / f"own-{rank}.pt"))
    return restored[0]


NODE_LOCAL = (*REPLICAS, "--node-local-dir")
_UNINTERRUPTED: dict[str, Path] = {}


def _uninterrupted(strategy: str, nodes: tuple[Node, Node], factory: pytest.TempPathFactory) -> Path:
    """The folder of an uninterrupted two-node run of `strategy` with NODE_LOCAL, made once per
    test process: the runs that lose node 1 compare their final states with its (the states do
    not depend on where --dir is, and one run fewer keeps the suite short)."""
    if strategy not in _UNINTERRUPTED:
        plain = factory.mktemp(f"uninterrupted-{strategy}")
        procs = [node.start(plain, nodes[0].addr, strategy, extra=NODE_LOCAL) for node in nodes]
        assert _finish(procs, plain) == [0, 0], _logs(plain)
        _finished_cleanly(plain, nodes)
        _UNINTERRUPTED[strategy] = plain
    return _UNINTERRUPTED[strategy]


# What torch elastic printed on the node that does not host the rendezvous store when the hosting
# node ended first (its exit barrier, its rendezvous shutdown and keep-alive: a Python traceback,
# C++ stack dumps; launcher/rdzv_exit.py), and any other error a clean finish must not print.
NOT_CLEAN = re.compile(r"Traceback|\berror\b|Exception|failed|frame #", re.IGNORECASE)


def _log_sizes(cwd: Path, nodes: tuple[Node, Node]) -> dict[int, int]:
    """How far each node's log (appended to by every run in `cwd`) reaches now."""
    return {node.rank: (cwd / f"node{node.rank}.log").stat().st_size for node in nodes}


def _printed_no_error(cwd: Path, nodes: tuple[Node, Node], since: dict[int, int] | None = None) -> None:
    """Neither node printed a traceback or an error line (both ended 0), in its log past `since`
    (a run before, killed, may: a node killed second sees its peer's connection close first)."""
    for node in nodes:
        with open(cwd / f"node{node.rank}.log", "rb") as f:
            f.seek((since or {}).get(node.rank, 0))
            text = f.read().decode(errors="replace")
        lines = text.splitlines()
        first = next((i for i, line in enumerate(lines) if NOT_CLEAN.search(line)), None)
        shown = "\n".join(lines[first:first + 30]) if first is not None else ""
        assert first is None, f"node {node.rank} printed errors in a clean finish:\n{shown}"


def _finished_cleanly(cwd: Path, nodes: tuple[Node, Node]) -> None:
    """Both nodes ended a run well (--node-local-dir): neither printed a traceback or an error
    line, and each one's summary counts the steps its own --dir holds (--keep 0: every one)."""
    _printed_no_error(cwd, nodes)
    for node in nodes:
        log = (cwd / f"node{node.rank}.log").read_text()
        steps = [m.step for m in Store(cwd / node.own_dir).manifests()]
        said = f"checkpoints committed {len(steps)} | last durable step {steps[-1]} |"
        assert said in log, f"node {node.rank}'s summary does not say {said!r}: {log}"


# Each strategy whose records a rank's part restores alone (the registry's `replicas`); the
# default strategy by default, the others under --full.
REPLICABLE = [pytest.param(s, marks=() if s == RunConfig.strategy else FULL)
              for s, e in REGISTRY.items() if e.replicas]


@pytest.mark.parametrize("strategy", REPLICABLE)
def test_a_damaged_partner_copy_falls_through_to_disk(strategy, nodes, tmp_path, tmp_path_factory):
    """--replicas 2, a shared --dir: node 1 is killed and its part of the newest steps on disk is
    lost; the copy node 0 holds has gone bad in its memory: it is refused with one line, and both
    ranks resume from the newest step whose parts are on disk, bit-exact. (A good copy taken back
    is the node-local test's, which loses node 1's whole --dir.)"""
    head, other = nodes
    plain = _uninterrupted(strategy, nodes, tmp_path_factory)
    assert _held(plain, 1), "node 0 held no copy of rank 1's part"
    bad = tmp_path / "bad-copy"
    _, t_kill = _lose_node1(bad, head, other, strategy, fault=f"corrupt-replica:step={REPLICATED}:rank=0",
                          lost=lambda step: step >= REPLICATED)
    log1 = (bad / "node1.log").read_text()
    assert log1.count("the copy rank 0 held is damaged") == 1, _logs(bad)
    assert _resumed_at(bad, nodes, t_kill) == REPLICATED - 1
    for rank in (0, 1):
        assert_training_state(load(bad / f"own-{rank}.pt"), load(plain / f"own-{rank}.pt"))


def _shipped_only_per_rank_state(cwd: Path, node: Node) -> None:
    """The DDP short-cut: each copy `node`'s engine shipped held only the tensors its index does
    not name as replicated (for the example script, its RNG state: the parameters and optimizer
    state are every data-parallel peer's), and its index."""
    events = [json.loads(line) for line in (cwd / f"metrics-node{node.rank}" / "engine-0.jsonl").open()]
    sent = [e for e in events if e.get("type") == "replica_sent" and e["partners"]]
    assert sent, f"node {node.rank} shipped nothing"
    for e in sent:
        raw = (cwd / node.own_dir / full_name(e["step"]) / rank_files(node.rank)[1]).read_bytes()
        index = json.loads(raw)
        kept = {k: t["nbytes"] for k, t in index["tensors"].items() if k not in index["meta"].get("shared", ())}
        assert all(k.startswith("rng/") for k in kept), f"step {e['step']}: shipped {sorted(kept)}"
        assert e["bytes"] == sum(kept.values()) + len(raw), e
    assert sent[-1]["bytes"] < index["data_nbytes"] // 10, sent[-1]  # (the newest: optimizer state too)


@pytest.mark.parametrize("strategy", REPLICABLE)
def test_node_local_dirs_a_lost_node_resumes_from_partner_memory(strategy, nodes, tmp_path, tmp_path_factory):
    """--node-local-dir --replicas 2: each node commits every step into its own --dir (the
    manifest and its own rank's part only); node 1 is killed and its whole --dir deleted; started
    again, its engine takes the newest step node 0 held back (manifest and part) before its
    worker starts, both ranks resume from it, and the final states equal an uninterrupted run's
    bit for bit. Each node's --dir restores its own rank and says where the other's part is."""
    head, other = nodes
    plain = _uninterrupted(strategy, nodes, tmp_path_factory)
    for node in nodes:
        store = Store(plain / node.own_dir)
        ms = store.manifests()
        assert ms and ms[-1].step == STOP and all(store.ranks_held(m) == [node.rank] for m in ms), node
        state, _ = restore(plain, plain / node.own_dir, "latest", node.rank)
        assert_training_state(state, load(plain / f"own-{node.rank}.pt"))
    line = error_line(cli(plain, "restore", "--dir", plain / other.own_dir, "--rank", "0"))
    assert "holds the part(s) of rank(s) 1 of 2" in line, line
    for node in nodes:
        _shipped_only_per_rank_state(plain, node)

    lost = tmp_path / "lost"
    held, t_kill = _lose_node1(lost, head, other, strategy, lost=lambda step: True, extra=NODE_LOCAL)
    restored = _back_from_partner(lost, plain, nodes, held, t_kill)
    assert Store(lost / other.own_dir).manifests()[-1].step == STOP
    print(f"two nodes, {strategy}, --node-local-dir --replicas 2: rank 1 took step {held} back (manifest and "
          f"part, {restored['bytes']} bytes) from rank 0's memory in {restored['seconds']:.2f} s")


LAGGED = "no longer their own state"  # node 0 ran ahead of the copies that left node 1 (below)
TRIES = 3


def _lose_node1_in_step(cwd: Path, head: Node, other: Node, *, fault: str | None, extra: tuple[str, ...],
                        lost: Callable[[int], bool], strategy: str = RunConfig.strategy, swap: bool = False
                        ) -> tuple[Path, int, float]:
    """`_lose_node1` with --persist-every 4 on top, tried again in a new folder where node 0 ran
    two steps ahead of the newest copy that left node 1 before it died (on a loaded machine, or
    at this model's 30 ms steps): no copy can be made whole then, which node 1 says in one line
    and resumes from --dir. Returns the last try's, in `cwd`."""
    for i in range(TRIES):
        cwd = cwd.with_name(f"{cwd.name}-{i}")
        newest, t_kill = _lose_node1(cwd, head, other, strategy, fault=fault, lost=lost,
                                     extra=(*extra, "--persist-every", "4"), swap=swap)
        if LAGGED not in (cwd / "node1.log").read_text():
            return cwd, newest, t_kill
    raise AssertionError(f"in {TRIES} tries node 0 always ran ahead of node 1's copies: {_logs(cwd)}")


@pytest.mark.parametrize("swap", [False, True], ids=["same-ranks", "ranks-swap"])
def test_memory_first_a_lost_node_resumes_from_its_partners_memory_at_a_step_held_only(swap, nodes, tmp_path,
                                                                                     tmp_path_factory):
    """--persist-every 4 on top: each engine holds every step in memory (the two newest, with
    --replicas), ships each to its partner as it holds it (per-rank state only: the DDP
    short-cut), and writes every 4th. Node 1 lost with its --dir: its new engine takes its rank's
    newest step that node 0 can make whole back into its own memory before its worker starts;
    both ranks resume there from memory, reading no disk, and end bit-exact. With `swap` the
    rendezvous gives the new node rank 0 and node 0 rank 1: node 0's engine gives its old rank's
    step back whole and holds its new rank's steps again from its own copies."""
    head, other = nodes
    plain = _uninterrupted(RunConfig.strategy, nodes, tmp_path_factory)
    lost, newest, t_kill = _lose_node1_in_step(tmp_path / "lost", head, other, fault=None, extra=NODE_LOCAL,
                                               lost=lambda step: True, swap=swap)
    events = [json.loads(line) for line in (lost / "metrics-node1" / "engine-0.jsonl").read_text().splitlines()]
    restored = [e for e in events if e.get("type") == "replica_restored" and e.get("held")]
    assert len(restored) == 1 and restored[0]["holder"] == (1 if swap else 0), _logs(lost)
    step = restored[0]["step"]
    assert newest - 1 <= step <= newest and _resumed_at(lost, nodes, t_kill) == step, (newest, step)
    if swap:
        survivor = [json.loads(line) for line in (lost / "metrics-node0" / "engine-0.jsonl").open()]
        own = [e["step"] for e in survivor if e.get("type") == "replica_restored" and e["holder"] == e["rank"] == 1]
        assert step in own, _logs(lost)
    for node in nodes:
        log = (lost / f"node{node.rank}.log").read_text()
        assert f"resumed step {step} from the checkpoint engine's memory (no disk read)" in log, _logs(lost)
    sent = [e for e in events if e.get("type") == "replica_sent" and e.get("held") and e["t"] < t_kill]
    assert sent and all(e["bytes"] < restored[0]["bytes"] // 10 for e in sent), (sent, restored)
    for rank in (0, 1):
        assert_training_state(load(lost / f"own-{rank}.pt"), load(plain / f"own-{rank}.pt"))
    written = {m.step for m in Store(lost / head.own_dir).manifests()}
    assert all(s % 4 == 0 or s == STOP for s in written), written


@pytest.mark.parametrize("swap", [False, True], ids=["same-ranks", "ranks-swap"])
def test_lowdiff_plus_a_lost_node_resumes_from_its_partners_copy_of_its_replica_stepped_by_the_diffs(
        swap, nodes, tmp_path, tmp_path_factory):
    """lowdiff+ with --replicas 2 under DDP: each engine ships its replica once, then only each
    step's diff, both thin (per-rank state; the replicated state by its xxh3, checked against
    node 0's own). Node 1 lost with its --dir: its new engine takes rank 1's replica back from
    node 0's copy, completed from node 0's own replica, at a step both can stand at; both ranks
    resume there from memory, reading no disk, and end bit-exact. With `swap` the rendezvous
    gives the new node rank 0 and node 0 rank 1: node 0's engine gives its old rank's replica
    back whole and holds its copy of rank 1's as its replica, both cut at one step."""
    head, other = nodes
    plain = _uninterrupted("lowdiff+", nodes, tmp_path_factory)
    lost, _, t_kill = _lose_node1_in_step(tmp_path / "lost", head, other, fault=None, extra=NODE_LOCAL,
                                          lost=lambda step: True, strategy="lowdiff+", swap=swap)
    events = [json.loads(line) for line in (lost / "metrics-node1" / "engine-0.jsonl").read_text().splitlines()]
    restored = [e for e in events if e.get("type") == "replica_restored" and e.get("held")]
    assert len(restored) == 1 and restored[0]["holder"] == (1 if swap else 0), _logs(lost)
    step = restored[0]["step"]
    assert _resumed_at(lost, nodes, t_kill) == step, _logs(lost)
    if swap:
        survivor = [json.loads(line) for line in (lost / "metrics-node0" / "engine-0.jsonl").open()]
        own = [e["step"] for e in survivor
               if e.get("type") == "replica_restored" and e.get("held") and e["holder"] == e["rank"] == 1]
        assert own == [step], _logs(lost)
    for node in nodes:
        log = (lost / f"node{node.rank}.log").read_text()
        assert f"resumed step {step} from the checkpoint engine's memory (no disk read)" in log, _logs(lost)
    sent = [e for e in events if e.get("type") == "replica_sent" and e.get("held") and e["t"] < t_kill]
    kinds = {e["kind"] for e in sent}
    assert kinds == {"full", "diff"}, sent
    # DDP: the replica and each diff ship thin, their parameters, optimizer state and gradients
    # by their xxh3 only (node 0's own replica and diffs are the same); the replica comes back
    # whole, and the parameters' bytes alone are a third of it (Adam's moments the rest).
    diffs = [e["bytes"] for e in sent if e["kind"] == "diff"]
    assert len(diffs) >= 4 and max(e["bytes"] for e in sent) < restored[0]["bytes"] // 20, (sent, restored)
    for rank in (0, 1):
        assert_training_state(load(lost / f"own-{rank}.pt"), load(plain / f"own-{rank}.pt"))


def test_memory_first_a_damaged_copy_of_a_step_held_only_falls_through_to_disk(nodes, tmp_path, tmp_path_factory):
    """One shared --dir, --persist-every 4, --replicas 2: the copies node 0 holds of rank 1's
    steps go bad in its memory after their checks. Node 1's new engine refuses the one given
    back, with one line; both ranks resume from the newest write on disk, bit-exact."""
    head, other = nodes
    plain = _uninterrupted(RunConfig.strategy, nodes, tmp_path_factory)
    bad, _, t_kill = _lose_node1_in_step(tmp_path / "bad-copy", head, other, fault="corrupt-replica:step=1:rank=0",
                                         extra=REPLICAS, lost=lambda step: False)
    assert (bad / "node1.log").read_text().count("held in rank 0's memory, did not come back") == 1, _logs(bad)
    resumed = _resumed_at(bad, nodes, t_kill)  # (killed at step 5 or later: step 4 at least was written)
    assert resumed >= 4 and resumed % 4 == 0, _logs(bad)
    for rank in (0, 1):
        assert_training_state(load(bad / f"own-{rank}.pt"), load(plain / f"own-{rank}.pt"))


@pytest.mark.parametrize("strategy", REPLICABLE)
def test_both_nodes_lost_resume_from_disk(strategy, nodes, tmp_path, tmp_path_factory):
    """--replicas 2, both nodes' whole trees killed (every engine's memory, copies included, is
    gone): started again, neither engine takes anything back from memory, both ranks resume from
    the newest step committed on disk, and the final states equal an uninterrupted run's."""
    head, other = nodes
    plain = _uninterrupted(strategy, nodes, tmp_path_factory)
    cwd = tmp_path / "both"
    procs = _start_replicated(cwd, head, other, strategy)
    for node in nodes:
        node.kill()
    t_kill = time.time()
    assert [p.wait(timeout=30) for p in procs] == [-signal.SIGKILL] * 2
    on_disk = _newest(cwd)
    assert REPLICATED <= on_disk < STOP, f"killed with step {on_disk} committed"
    since = _log_sizes(cwd, nodes)
    procs = [node.start(cwd, head.addr, strategy, extra=REPLICAS) for node in nodes]
    assert _finish(procs, cwd) == [0, 0], _logs(cwd)
    _printed_no_error(cwd, nodes, since)
    assert _resumed_at(cwd, nodes, t_kill) == on_disk
    for node in nodes:
        events = (cwd / f"metrics-node{node.rank}" / "engine-0.jsonl").read_text()
        assert '"replica_restored"' not in events, f"node {node.rank} took a step back from memory"
    for rank in (0, 1):
        assert_training_state(load(cwd / f"own-{rank}.pt"), load(plain / f"own-{rank}.pt"))
    assert _committed_with_both_parts(cwd)[-1] == STOP


DURABLE_STOP = 150  # long enough for several remote commits before node 1 is lost


def test_node_local_dirs_a_lost_node_resumes_from_the_durable_tier(nodes, tmp_path):
    """--node-local-dir --durable (no --replicas), each node keeping its newest 2 steps: node 1
    is killed once a step past REPLICATED is in the durable tier, and its whole --dir deleted;
    started again, the ranks agree on the tier's newest step, each worker whose --dir lacks it
    (node 1's; node 0's, which has retired it) takes its own rank's part back, both resume from
    it, and the final
    states equal an uninterrupted run's (plain torchrun, 2 ranks) bit for bit. Each node's
    engine uploads its own rank's part only. The tier is a plain path here, through the same
    code as `s3://` (the loopback S3 endpoint of tests/s3server.py is not reachable from inside
    a namespace)."""
    head, other = nodes
    strategy = RunConfig.strategy
    args = [a if a != STOP else DURABLE_STOP for a in ARGS]
    plain = tmp_path / "plain"
    plain.mkdir()
    ok(run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", 2, EXAMPLE, *args], plain))
    cwd, remote = tmp_path / "lost", tmp_path / "remote"
    extra = ("--node-local-dir", "--durable", str(remote), "--durable-every", "2", "--keep", "2")
    cwd.mkdir()
    procs = [node.start(cwd, head.addr, strategy, extra=extra, args=args) for node in nodes]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while max((m.step for m in Store(remote).manifests(warn=False)), default=-1) <= REPLICATED:
        assert time.monotonic() < deadline and procs[1].poll() is None, _logs(cwd)
        time.sleep(0.05)
    other.kill()
    t_kill = time.time()
    assert procs[1].wait(timeout=30) == -signal.SIGKILL
    time.sleep(1)  # no step is committed in the tier without node 1's part
    durable = max(m.step for m in Store(remote).manifests())
    assert durable < DURABLE_STOP and not (cwd / "own-0.pt").exists(), "the node was killed after the run ended"
    shutil.rmtree(cwd / other.own_dir)
    procs[1] = other.start(cwd, head.addr, strategy, extra=extra, args=args)
    assert _finish(procs, cwd) == [0, 0], _logs(cwd)

    assert _resumed_at(cwd, nodes, t_kill) == durable
    for rank in (0, 1):
        assert_training_state(load(cwd / f"own-{rank}.pt"), load(plain / f"own-{rank}.pt"))
    # Each worker took its own rank's part back, never the other's (nor the whole record).
    assert f"step {durable} (rank 1's part)" in (cwd / "node1.log").read_text()
    for node in nodes:
        assert not list((cwd / node.own_dir).glob(f"step-*/rank-{1 - node.rank:05d}.*")), node
        lines = (cwd / f"metrics-node{node.rank}" / "engine-0.jsonl").read_text().splitlines()
        parts = [e for e in map(json.loads, lines) if e["type"] == "durable_part"]
        assert parts and {(e["rank"], e["by"]) for e in parts} == {(node.rank, node.rank)}, parts
    ok(verify(cwd, remote))
    assert Store(remote).manifests()[-1].step == DURABLE_STOP
    for rank in (0, 1):
        state, _ = restore(cwd, remote, "latest", rank)
        assert_training_state(state, load(cwd / f"own-{rank}.pt"))
