"""The memory tier of a snapshot strategy (`--persist-every`): the newest snapshot a worker handed
over, kept in its staging slot. The engine outlives a crashed worker, so the restarted worker
resumes from the slot (`fetch`: the slot's file and its layout) without reading the disk, as
lowdiff+'s does from its replica. Nothing is copied: the slot is simply not given back until a
newer step replaces it. A step held is also written every P steps; it replaces the one held
before as it arrives, not once written, so that the next capture never waits for a write.
Snapshots reach `hold` from several writer threads, so an older one that arrives late is given
back at once (once written, if it is written).

With --replicas (`keep` 2) the step before the newest stays held too: a partner's copy of a
lost node's newest step may not have left it when the node died, and the ranks then agree on
the step before, which the survivors must still hold (engine/replicate.py).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ..ipc.messages import RecordSpec


class HeldSnapshot:
    """Call order per snapshot: `hold` as it arrives (what it returns goes back to the worker at
    once), then, if the step is written too, `written` once its write is done. A slot being
    read (written, or copied for a partner between `pin` and `unpin`) goes back only once the
    last reader is done, never while one reads it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.keep = 1  # steps held: 2 with --replicas
        self._held: list[tuple[int, RecordSpec, int]] = []  # (slot, spec, bytes), newest first
        self._readers: Counter[int] = Counter()  # slots being read
        self._replaced: set[int] = set()  # of them, no longer held: given back once read

    def hold(self, slot: int, spec: RecordSpec, nbytes: int, *, writing: bool = False) -> tuple[bool, list[int]]:
        """Keep `slot` as the newest state held, unless a newer one is held already. Returns
        (held, the slots to give back now: those no longer held, or `slot` itself; not those
        being read)."""
        with self._lock:
            if writing:
                self._readers[slot] += 1
            if self._held and self._held[0][1].step >= spec.step:
                return False, self._release([slot])
            self._held.insert(0, (slot, spec, nbytes))
            gone, self._held = self._held[self.keep :], self._held[: self.keep]
            return True, self._release([s for s, _, _ in gone])

    def written(self, slot: int) -> list[int]:
        """`slot`'s write is done: the slots to give back now (it, if it was replaced meanwhile)."""
        return self.unpin(slot)

    def pin(self, step: int) -> tuple[int, RecordSpec, int] | None:
        """(slot, spec, bytes) of `step` if it is held, kept from going back until `unpin`."""
        with self._lock:
            for slot, spec, nbytes in self._held:
                if spec.step == step:
                    self._readers[slot] += 1
                    return slot, spec, nbytes
            return None

    def unpin(self, slot: int) -> list[int]:
        """A reader of `slot` is done: the slots to give back now."""
        with self._lock:
            self._readers[slot] -= 1
            if self._readers[slot] > 0:
                return []
            del self._readers[slot]
            if slot in self._replaced:
                self._replaced.discard(slot)
                return [slot]
            return []

    def _release(self, slots: list[int]) -> list[int]:
        back = [s for s in slots if not self._readers[s]]
        self._replaced.update(s for s in slots if self._readers[s])
        for s in back:
            self._readers.pop(s, None)
        return back

    def held(self) -> list[tuple[int, int]]:
        """(step, bytes) of each state held, newest first."""
        with self._lock:
            return [(spec.step, nbytes) for _, spec, nbytes in self._held]

    def holds(self, slot: int) -> bool:
        with self._lock:
            return any(s == slot for s, _, _ in self._held)

    def drop(self) -> None:
        """Let go of what is held (its worker came back as another rank)."""
        with self._lock:
            self._held = []

    def fetch(self, step: int | None, path_of: Callable[[int], Path]) -> dict:
        """Where the held state of `step` (None: the newest) is, in `EngineHandler.fetch`'s terms
        (`path_of(slot)`: the slot's file)."""
        with self._lock:
            found = [(s, spec) for s, spec, _ in self._held if step is None or spec.step == step]
            if not found:
                raise RuntimeError(f"no snapshot of step {step} is held in memory")
            slot, spec = found[0]
            return {"step": spec.step, "path": str(path_of(slot)), "skeleton": spec.skeleton,
                    "tensors": spec.tensors, "exact": True}
