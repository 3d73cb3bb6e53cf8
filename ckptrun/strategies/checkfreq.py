"""`checkfreq` (CheckFreq, FAST'21): snapshot to host during the next forward/backward, persist
in the engine; the next optimizer update waits only for the snapshot, never for the disk."""

from __future__ import annotations

from .base import SnapshotStrategy


class CheckFreq(SnapshotStrategy):
    name = "checkfreq"
    background = True
    wait_durable = False
