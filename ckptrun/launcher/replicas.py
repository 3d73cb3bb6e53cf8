"""--replicas / --replica-jump at the start of a run: refused in one line (exit 2) where the
strategy or the node count cannot honour them, before anything starts."""

from __future__ import annotations

from ..config import RunConfig
from ..errors import UsageError
from ..storage.tiers.group import ReplicationGroup, check_flags


def check(cfg: RunConfig, nnodes: str) -> None:
    from ..strategies import REGISTRY, names_where

    if cfg.replicas == 1 and cfg.replica_jump == 1:
        return
    check_flags(cfg.replicas, cfg.replica_jump)
    if cfg.replicas > 1 and not REGISTRY[cfg.strategy].replicas:
        raise UsageError(f"--replicas {cfg.replicas}: {cfg.strategy}'s records cannot be restored from one rank's "
                         f"copy; use one of: {names_where(lambda e: e.replicas)}")
    low, _, high = nnodes.partition(":")
    most = int(high or low)
    if cfg.replicas > most:
        raise UsageError(f"--replicas {cfg.replicas} puts copies on {cfg.replicas} nodes; the run has at most "
                         f"{most} (--nnodes {nnodes})")
    if not high or low == high:
        ReplicationGroup(most, 1, cfg.replicas, cfg.replica_jump)
