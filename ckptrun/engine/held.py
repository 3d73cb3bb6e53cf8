"""The memory tier of a snapshot strategy (`--persist-every`): the newest snapshot a worker handed
over, kept in its staging slot. The engine outlives a crashed worker, so the restarted worker
resumes from the slot (`fetch`: the slot's file and its layout) without reading the disk, as
lowdiff+'s does from its replica. Nothing is copied: the slot is simply not given back until a
newer step replaces it. A step held is also written every P steps; it replaces the one held
before as it arrives, not once written, so that the next capture never waits for a write.
Snapshots reach `hold` from several writer threads, so an older one that arrives late is given
back at once (once written, if it is written).
"""

from __future__ import annotations

import threading
from pathlib import Path

from ..ipc.messages import RecordSpec


class HeldSnapshot:
    """Call order per snapshot: `hold` as it arrives (what it returns goes back to the worker at
    once), then, if the step is written too, `written` once its write is done (a slot being
    written goes back only then, never while the writer reads it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.slot: int | None = None
        self.spec: RecordSpec | None = None
        self.nbytes = 0
        self._writing: set[int] = set()  # slots whose write is running
        self._replaced: set[int] = set()  # of them, no longer held: given back once written

    def hold(self, slot: int, spec: RecordSpec, nbytes: int, *, writing: bool = False) -> tuple[bool, int | None]:
        """Keep `slot` as the newest state held, unless a newer one is held already. Returns
        (held, the slot to give back now: the one replaced, or `slot` itself; None when that
        one is being written)."""
        with self._lock:
            if writing:
                self._writing.add(slot)
            if self.spec is not None and self.spec.step >= spec.step:
                return False, self._release(slot)
            old, self.slot, self.spec, self.nbytes = self.slot, slot, spec, nbytes
            return True, None if old is None else self._release(old)

    def written(self, slot: int) -> int | None:
        """`slot`'s write is done: the slot to give back now (it was replaced meanwhile), or None."""
        with self._lock:
            self._writing.discard(slot)
            if slot in self._replaced:
                self._replaced.discard(slot)
                return slot
            return None

    def _release(self, slot: int) -> int | None:
        if slot in self._writing:
            self._replaced.add(slot)
            return None
        return slot

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
