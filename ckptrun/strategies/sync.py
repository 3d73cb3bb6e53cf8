"""`sync`: the torch.save baseline: copy, write and fsync on the training path."""

from __future__ import annotations

from .base import SnapshotStrategy


class Sync(SnapshotStrategy):
    name = "sync"
    background = False
    wait_durable = True
