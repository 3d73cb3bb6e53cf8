"""`ckptrun bench --nodes 2`: one configuration on two nodes (bench/netns.py), the example
trained with DDP over gloo between them, and one node lost and replaced after the timed steps.

The figures are node 0's (rank 0): its step time and stall over the timed steps, its engine's
bytes, and with --replicas the bytes it shipped to its partner each step. `none` is the same
script under torchrun. A ckptrun run trains as many steps again, and TAIL more; once node 0 has
committed the last timed step (and, with --replicas, holds node 1's copy of it), node 1's whole
process tree is killed and node 1 started again, as a scheduler replaces a node. Without
--replicas, the page cache is dropped first, so the new node reads its state from the disk, not
from memory: from one directory both nodes write (a shared file system), or with
--node-local-dir from its own --dir (its disk outlived the processes). With --replicas, each
node's --dir is its own and node 1's is deleted: its state comes back from node 0's memory.
Recovery is node 1's: its new worker's start to the end of its first resumed step, and of it
the restore: the engine's take-back from the partner plus the worker's read and load.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..errors import CkptrunError
from ..launcher.console.metrics_feed import MetricsTailer
from . import figures
from .netns import Node
from .plan import Configuration, Workload, ckptrun_flags, run_env
from .procmem import PeakMemory
from .runner import Outcome, RunFailed, load_1m, log_tail

PORT = 29711  # the rendezvous ports, PORT..PORT+99 in turn (a run's port is free again by the 100th next)
TAIL = 10  # steps trained after the timed ones, besides as many as were timed: node 1 is lost among them
# Rendezvous settings for a short bench run: a dead node's heartbeats missed after 3 s
RDZV_CONF = "join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3"
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def run_on_nodes(cfg: Configuration, work: Workload, run_dir: Path, steps: int, warmup: int, timeout_s: float,
                 pair: tuple[Node, Node], port: int) -> Outcome:
    """Train `steps` steps of `cfg` on `pair`, then (ckptrun) lose node 1 and time its recovery;
    the run's files are removed afterwards unless it failed."""
    t0 = time.perf_counter()
    run_dir.mkdir(parents=True)
    procs: list[subprocess.Popen] = []
    try:
        result, params = _run(cfg, work, run_dir, steps, warmup, timeout_s, pair, port, procs)
    except CkptrunError as e:
        return Outcome(None, str(e), time.perf_counter() - t0, load_1m=load_1m())
    finally:
        for node in pair:
            node.kill()
        for p in procs:
            p.wait()
    shutil.rmtree(run_dir, ignore_errors=True)
    return Outcome(result, None, time.perf_counter() - t0, params, load_1m())


def _argv(cfg: Configuration, work: Workload, run_dir: Path, node: Node, host: str, port: int, steps: int) -> list:
    """Node `node`'s launcher: torchrun for `none`, `ckptrun run` for a strategy."""
    rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node.rank), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", run_dir.name,
            "--rdzv-conf", f"{RDZV_CONF},is_host={str(node.rank == 0).lower()}", "--local-addr", node.addr]
    script = [str(work.script), *work.script_args(steps, run_dir / f"timing-node{node.rank}.jsonl")]
    if cfg.kind == "baseline":
        return [sys.executable, "-m", "torch.distributed.run", *rdzv, *script, *cfg.flags]
    own = "--node-local-dir" in cfg.flags
    return [sys.executable, "-m", "ckptrun", "run", *rdzv, "--max-restarts", "1", "--no-dashboard",
            *ckptrun_flags(cfg, run_dir / (f"ckpt-node{node.rank}" if own else "ckpt"),
                           run_dir / f"metrics-node{node.rank}", run_dir.name), *script]


def _run(cfg: Configuration, work: Workload, run_dir: Path, steps: int, warmup: int, timeout_s: float,
         pair: tuple[Node, Node], port: int, procs: list) -> tuple[figures.RunFigures, int]:
    total = 2 * steps + TAIL if cfg.kind == "ckptrun" else steps
    argvs = [_argv(cfg, work, run_dir, node, pair[0].addr, port, total) for node in pair]
    env, deadline = run_env(), time.monotonic() + timeout_s
    for node, argv in zip(pair, argvs, strict=True):
        procs.append(node.popen(argv, run_dir, env, run_dir / f"node{node.rank}.log"))
    sampler = PeakMemory(procs[0].pid, include_root=cfg.kind == "baseline").start()
    try:
        if cfg.kind == "ckptrun":
            _lose_node1(cfg, run_dir, steps, total, pair, procs, argvs, env, deadline)
        for p in procs:
            _wait(p, run_dir, deadline)
    finally:
        mem = sampler.stop()
    first = figures.attempts(run_dir / "timing-node0.jsonl")[0]
    first.steps = [s for s in first.steps if s["step"] <= steps]
    if cfg.kind == "baseline":
        return figures.reference_figures(first, warmup, mem, sampler.cpu), first.params
    result = figures.ckptrun_figures(first, run_dir / "metrics-node0", warmup, mem, sampler.cpu)
    events = MetricsTailer(run_dir / "metrics-node0").poll()
    timed = first.window(warmup)[0]
    result.shipped_per_step = (sum(e["bytes"] for e in events if e.get("type") == "replica_sent"
                                   and timed[0]["step"] <= e["step"] <= timed[-1]["step"]) / len(timed)
                               if "--replicas" in cfg.flags else None)
    lost = MetricsTailer(run_dir / "metrics-node1").poll()
    restart = figures.ckptrun_recovery(result, lost)
    if "--replicas" in cfg.flags:
        back = [e for e in lost if e.get("type") == "replica_restored"]
        if not back:
            raise RunFailed(f"node 1 took no state back from node 0's memory; log {run_dir / 'node1.log'}")
        # the engine took it back while the worker set up: what the worker waited for of it is restore
        waited = min(back[0]["seconds"], restart.get("hello_wait_s", 0.0))
        result.restore_s += waited
        result.setup_s = None if result.setup_s is None else result.setup_s - waited
    return result, first.params


def _lose_node1(cfg: Configuration, run_dir: Path, steps: int, total: int, pair: tuple[Node, Node], procs: list,
                argvs: list, env: dict[str, str], deadline: float) -> None:
    """Once node 0 has committed step `steps` (and holds node 1's copy of it, with --replicas)
    and its worker's metrics hold every timed step: node 1 killed, its state lost (see the
    module docstring) and started again."""
    metrics, copies = run_dir / "metrics-node0", "--replicas" in cfg.flags
    tail = MetricsTailer(metrics)
    committed = held = stepped = -1
    while min(committed, stepped) < steps or (copies and held < steps):
        for e in tail.poll():
            if e.get("type") == "step":
                stepped = max(stepped, e["step"])
            elif e.get("type") == "commit":
                committed = max(committed, e["step"])
            elif e.get("type") == "replica_held" and e.get("owner") == 1:
                held = max(held, e["step"])
        for p in procs:
            if p.poll() is not None:
                raise RunFailed(f"a node exited ({p.returncode}) before step {steps} was committed"
                                f"{' and held by node 0' if copies else ''}:\n{log_tail(run_dir / 'node0.log')}")
        if time.monotonic() > deadline:
            raise RunFailed(f"step {steps} was not committed in time:\n{log_tail(run_dir / 'node0.log')}")
        time.sleep(0.02)
    if stepped >= total - 2:  # (its agent would then wait at the exit barrier, never rejoin)
        raise RunFailed(f"node 0 trained to the end before node 1 could be lost mid-run ({stepped} of {total} "
                        "steps): a larger --steps gives it more time, or an --every that divides --steps "
                        "where the strategy commits less often")
    pair[1].kill()
    procs[1].wait()
    if copies:
        shutil.rmtree(run_dir / "ckpt-node1")
    else:
        with contextlib.suppress(OSError):  # (root: the new node reads its state from the disk)
            DROP_CACHES.write_text("3\n")
    procs[1] = pair[1].popen(argvs[1], run_dir, env, run_dir / "node1.log")


def _wait(p: subprocess.Popen, run_dir: Path, deadline: float) -> None:
    try:
        rc = p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RunFailed(f"the two-node run timed out; logs {run_dir}/node0.log, node1.log") from None
    if rc != 0:
        raise RunFailed(f"a node exited with code {rc}:\n{log_tail(run_dir / 'node0.log')}\n"
                        f"{log_tail(run_dir / 'node1.log')}")
