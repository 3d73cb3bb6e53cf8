"""--replicas / --replica-jump / --node-local-dir at the start of a run: refused in one line (exit
2) where the strategy or the node count cannot honour them, before anything starts."""

from __future__ import annotations

from ..config import RunConfig
from ..errors import UsageError
from ..storage.tiers.group import ReplicationGroup, check_flags


def check(cfg: RunConfig, nnodes: str) -> None:
    if cfg.node_local_dir:
        _part_restores_alone(cfg, "--node-local-dir")
    if cfg.replicas == 1 and cfg.replica_jump == 1:
        return
    check_flags(cfg.replicas, cfg.replica_jump)
    if cfg.replicas > 1:
        _part_restores_alone(cfg, f"--replicas {cfg.replicas}")
    low, _, high = nnodes.partition(":")
    most = int(high or low)
    if cfg.replicas > most:
        raise UsageError(f"--replicas {cfg.replicas} puts copies on {cfg.replicas} nodes; the run has at most "
                         f"{most} (--nnodes {nnodes})")
    if not high or low == high:
        ReplicationGroup(most, 1, cfg.replicas, cfg.replica_jump)


def _part_restores_alone(cfg: RunConfig, flag: str) -> None:
    """Refuse `flag` unless the strategy's records are folders one rank's part restores alone."""
    from ..strategies import REGISTRY, names_where

    if not REGISTRY[cfg.strategy].replicas:
        raise UsageError(f"{flag}: {cfg.strategy}'s records cannot be restored from one rank's copy; use one of: "
                         f"{names_where(lambda e: e.replicas)}")
