"""The memory tier of a snapshot strategy (`--persist-every`): the newest snapshot a worker handed
over, kept in its staging slot. The engine outlives a crashed worker, so the restarted worker
resumes from the slot (`fetch`: the slot's file and its layout) without reading the disk, as
lowdiff+'s does from its replica. Nothing is copied: the slot is simply not given back until a
newer step replaces it. Snapshots reach `hold` from several writer threads, so an older one that
arrives late is given back at once.
"""

from __future__ import annotations

import threading
from pathlib import Path

from ..ipc.messages import RecordSpec


class HeldSnapshot:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.slot: int | None = None
        self.spec: RecordSpec | None = None
        self.nbytes = 0

    def hold(self, slot: int, spec: RecordSpec, nbytes: int) -> int | None:
        """Keep `slot` as the newest state held, unless a newer one is held already; returns the
        slot given back (the one replaced, or `slot` itself), or None."""
        with self._lock:
            if self.spec is not None and self.spec.step >= spec.step:
                return slot
            old, self.slot, self.spec, self.nbytes = self.slot, slot, spec, nbytes
            return old

    def held(self) -> tuple[int, int] | None:
        """(step, bytes) held, if any."""
        with self._lock:
            return None if self.spec is None else (self.spec.step, self.nbytes)

    def holds(self, slot: int) -> bool:
        with self._lock:
            return self.slot == slot

    def drop(self) -> int | None:
        """Let go of what is held (its worker came back as another rank); returns its slot."""
        with self._lock:
            slot, self.slot, self.spec, self.nbytes = self.slot, None, None, 0
            return slot

    def fetch(self, path: Path) -> dict:
        """Where the held state is, in `EngineHandler.fetch`'s terms (`path`: the slot's file)."""
        with self._lock:
            if self.spec is None:
                raise RuntimeError("no snapshot is held in memory")
            return {"step": self.spec.step, "path": str(path), "skeleton": self.spec.skeleton,
                    "tensors": self.spec.tensors, "exact": True}
