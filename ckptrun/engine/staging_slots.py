"""The staging slots the engine owns: shared-memory files the worker copies snapshots into
(ipc/staging.py). The engine makes them (a generation per Alloc), so they outlive a crashed
worker, hands their list to each new worker, and gives each back (`SlotFree`) once what it held
is written, or, held in memory, replaced."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..ipc.messages import SlotFree
from ..ipc.staging import EngineSlot
from ..storage.leftovers import staging_path
from .worker_link import WorkerLink


class StagingSlots:
    """This engine's slots by index (`slots`), their files named by the run's tag and the local rank."""

    def __init__(self, tag: str, local_rank: int, link: WorkerLink) -> None:
        self.tag, self.local_rank, self._link = tag, local_rank, link
        self.slots: dict[int, EngineSlot] = {}

    def new(self, n: int, nbytes: int) -> range:
        """Make `n` staging slots of `nbytes` each; their indices."""
        first = max(self.slots, default=-1) + 1
        for i in range(first, first + n):
            self.slots[i] = EngineSlot(staging_path(self.tag, self.local_rank, i), nbytes)
        return range(first, first + n)

    def retire(self, indices: Iterable[int]) -> None:
        """The worker retired these (an older generation, freed up)."""
        for i in indices:
            slot = self.slots.pop(i, None)
            if slot is not None:
                slot.close()

    def keep_newest(self, held: Callable[[int], bool]) -> None:
        """A new worker gets only the newest generation's slots, and those `held` in memory."""
        newest = max((s.nbytes for s in self.slots.values()), default=0)
        self.retire([i for i, s in self.slots.items() if s.nbytes < newest and not held(i)])

    def listed(self, indices: Iterable[int]) -> list[tuple[int, str, int]]:
        """(index, file, bytes) of each slot, as a reply to the worker names them."""
        return [(i, str(self.slots[i].path), self.slots[i].nbytes) for i in indices]

    def view(self, slot: int) -> memoryview:
        return self.slots[slot].view

    def give_back(self, slots: Iterable[int]) -> None:
        """The worker may fill these slots again."""
        for slot in slots:
            self._link.send(SlotFree(slot=slot))

    def close(self) -> None:
        for s in self.slots.values():
            s.close()
