"""The worker's Hello to its engine, sent before the worker imports the rest of ckptrun and torch.

The engine answers a Hello once it has flushed the old worker's writes and, where the round
needs it, met its partners' engines (--replicas: a replaced node's engine takes its ranks'
parts back from their memory first) and the round's commit keys (--node-local-dir). Sent first,
that runs while the worker imports instead of after; the Runtime waits for the answer only
where it still runs. The engines meet through the job store, which rank 0's worker hosts: where
the Hello names it, it is up before the Hello goes (torch.distributed imported first); else
the Hello goes before torch is imported. Torch-free itself.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .. import faults
from ..config import RunConfig
from ..ipc.client import EngineClient
from ..ipc.messages import Hello
from ..strategies import REGISTRY
from . import jobstore


def hello(cfg: RunConfig, rank: int, world_size: int, restart_count: int) -> Hello:
    """This worker's Hello: what its engine needs to serve it, and to meet the round's engines."""
    fault = faults.from_env(rank, restart_count)
    replication = None
    if cfg.replicas > 1:
        replication = {**jobstore.address(restart_count), "replicas": cfg.replicas, "jump": cfg.replica_jump,
                       "local": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))}
    return Hello(rank=rank, world_size=world_size, restart_count=restart_count, dir=cfg.dir, keep=cfg.keep,
                 strategy=cfg.strategy, engine_handler=REGISTRY[cfg.strategy].engine_handler, writers=cfg.writers,
                 io_threads=cfg.io_threads, fault=fault.text if fault else None, io_engine=cfg.io_engine,
                 replication=replication,
                 node_local=jobstore.address(restart_count) if cfg.node_local_dir and world_size > 1 else None)


def store_up(msg: Hello) -> None:
    """Before `msg` is sent: an engine meets its round through the job store, which rank 0's
    worker hosts (this imports torch.distributed). Up first, so that no engine waits on it: a
    store client that finds no server retries with growing pauses (0.25-0.4 s late, measured)."""
    if msg.replication is not None or msg.node_local is not None:
        jobstore.endpoint(msg.restart_count)


@dataclass
class Greeting:
    """A Hello sent and not yet answered; `reply` waits for the answer."""

    client: EngineClient
    request: int
    waited_s: float = 0.0  # how long `reply` waited: the engine's set-up the worker's own did not hide

    def reply(self) -> dict:
        t0 = time.perf_counter()
        body = self.client.answer(self.request, "hello")
        self.waited_s = time.perf_counter() - t0
        return body


def greet(cfg: RunConfig, rank: int, local_rank: int, world_size: int, restart_count: int) -> Greeting:
    """Connect to this rank's engine and send the Hello (the job store up first, where it names
    it), without waiting for the answer."""
    client, msg = EngineClient(cfg.engine_address(local_rank), bytes.fromhex(cfg.authkey)), hello(
        cfg, rank, world_size, restart_count)
    store_up(msg)
    return Greeting(client, client.ask(msg))
