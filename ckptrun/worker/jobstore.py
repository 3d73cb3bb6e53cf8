"""The job's key-value store: how the ranks of one attempt agree on small decisions (the step to
resume from, the interval `--every auto` chose) without touching the script's process group."""

from __future__ import annotations

import functools
import os
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist


def agent_store() -> bool:
    """Whether the workers' MASTER_ADDR:MASTER_PORT is the elastic agent's store, which lives for
    the whole job (torch elastic's default), rather than one worker rank 0 hosts for its attempt
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which the launcher sets for several nodes)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "True") == "True"


def attempt(restart_count: int) -> str:
    """The part of the job store's keys that names this attempt, the same on every rank of it.

    In the agent's store, which outlives attempts, that is the restart count: one agent restarts
    all of its workers together. Across nodes the agents' counts differ (a replaced node starts
    again at 0, and an agent restarts healthy workers for a waiting node without counting it),
    so there every attempt has a store of its own, on a port the rendezvous chose for it."""
    return str(restart_count) if agent_store() else f"port-{os.environ['MASTER_PORT']}"


@functools.cache
def _server_or_client() -> dist.TCPStore:
    """One connection per process. Without the agent's store, rank 0 hosts the attempt's store
    (multi-tenant: the script's own `init_process_group` later shares the same server) and keeps
    it for as long as the process lives, since the other ranks may still be reading from it."""
    import torch.distributed as dist

    host = not agent_store() and os.environ.get("RANK") == "0"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=host,
                         multi_tenant=host, timeout=timedelta(minutes=10))


def _prefix(restart_count: int) -> str:
    return f"ckptrun/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{attempt(restart_count)}"


def job_store(restart_count: int, namespace: str = "") -> dist.PrefixStore:
    """A client of the job's TCPStore, keyed per run and attempt (and `namespace`)."""
    import torch.distributed as dist

    prefix = _prefix(restart_count)
    return dist.PrefixStore(f"{prefix}/{namespace}" if namespace else prefix, _server_or_client())


def meet(restart_count: int, name: str, rank: int, world_size: int, *, wait: bool, timeout_s: float) -> bool:
    """Say `name` for this rank; with `wait`, wait until every rank has said it (False: not
    within `timeout_s`)."""
    kv = job_store(restart_count)
    kv.set(f"{name}/{rank}", "1")
    if not wait:
        return True
    try:
        kv.wait([f"{name}/{r}" for r in range(world_size)], timedelta(seconds=timeout_s))
    except RuntimeError:  # (torch's DistStoreError: the wait timed out)
        return False
    return True


def address(restart_count: int) -> dict:
    """Where another process of this node (the engine) finds this attempt's store: its address,
    port and key prefix (torch-free; the store may not be up yet: `endpoint`)."""
    return {"addr": os.environ["MASTER_ADDR"], "port": int(os.environ["MASTER_PORT"]),
            "prefix": _prefix(restart_count)}


def endpoint(restart_count: int) -> dict:
    """`address`, once the store is up (rank 0 hosts it without the agent's)."""
    _server_or_client()
    return address(restart_count)
