"""A worker's `Persist`: its staging slot written as a record (engine/commit_path.py), and with a
snapshot strategy's --persist-every, held in memory first as the newest step (the memory tier,
engine/held.py), written only every P steps; the slot goes back to the worker once neither
holds it. `ls` shows the step held (storage/memory_status.py); with --replicas, each step held
is shipped to the partners, and they read and refill the held slots through `HeldSlots`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..ipc.messages import InMemory, Persist, RecordSpec
from ..storage import memory_status
from ..storage.layout import align
from .commit_path import CommitPath
from .engine_state import EngineState
from .held import HeldSnapshot
from .staging_slots import StagingSlots
from .step_clock import StepClock


class Persister:
    """The memory tier's state: the step held (`memory`), the time of a step (`step_time`), and
    whether `ls` shows it (`holds_memory`)."""

    def __init__(self, state: EngineState, slots: StagingSlots, commits: CommitPath) -> None:
        self.state, self.slots, self.commits = state, slots, commits
        self.memory = HeldSnapshot()  # a snapshot strategy's newest step, held in its slot (--persist-every)
        self.step_time = StepClock()  # of the steps held (--replicas: their copies wait one step's time)
        self.holds_memory = False  # a handler said it holds a step in memory (memory_status)

    def persist(self, msg: Persist) -> None:
        """Write the slot as its record; with `hold` (the memory tier), keep it as the newest
        state in memory (replacing the one held before at once), written only when `write` says
        so, or when a crash-matrix write fault is due at its step (engine/held.py)."""
        state, slots = self.state, self.slots
        write = msg.write or state.faults.write_due(msg.spec.step)
        if msg.hold:
            if state.replicator is not None:  # (the writer thread waits, so the next slot comes later)
                since = self.step_time.since(msg.spec.meta.get("snapshot_time") or 0.0)
                state.replicator.shipper.wait_held_shipped(since)
            held, back = self.memory.hold(msg.slot, msg.spec, msg.nbytes, writing=write)
            if held:
                self.in_memory(msg.spec.step, msg.nbytes)
                if state.replicator is not None:
                    state.replicator.shipper.offer_held(msg.spec.step)
            slots.give_back(back)
        if write:
            try:
                self.commits.write_part(msg.spec, slots.view(msg.slot)[: msg.nbytes])
            finally:
                slots.give_back(self.memory.written(msg.slot) if msg.hold else [msg.slot])
        elif not msg.hold:  # (neither written nor held: nothing keeps the slot)
            slots.give_back([msg.slot])

    def in_memory(self, step: int, nbytes: int) -> None:
        """This engine holds `step` in memory: the worker told, `ls` shows it."""
        self.state.link.send(InMemory(step=step))
        self.publish(step, nbytes)

    def publish(self, step: int, nbytes: int) -> None:
        """`ls` shows the step this rank's engine holds in memory (of its own --dir only)."""
        state = self.state
        try:
            state.store.check_owned()
            memory_status.publish(state.store.root, state.rank, step, nbytes)
        except OSError as e:  # only `ls` misses it
            state.log.emit(type="warning", rank=state.rank, error=f"in-memory status: {e}")
        self.holds_memory = True

    def withdraw(self) -> None:
        """`ls` no longer shows a step this engine holds (a file named by rank alone: in --dir
        only while it is the run's own, never another run's)."""
        if self.holds_memory and self.state.store.owned():
            memory_status.withdraw(self.state.store.root, self.state.rank)
        self.holds_memory = False


class HeldSlots:
    """The steps a snapshot strategy's engine holds in its staging slots, as the replicator reads
    them (to copy them to partners, or to make a partner's copy whole) and refills them (a
    replaced node's engine, from a partner's copy): `held_copies.HeldMemory`."""

    def __init__(self, persister: Persister) -> None:
        self._persister = persister

    def held_steps(self) -> list[int]:
        return [step for step, _ in self._persister.memory.held()]

    @contextlib.contextmanager
    def pinned(self, step: int) -> Iterator[tuple[RecordSpec, memoryview] | None]:
        """The spec and bytes of `step`, if held; its slot goes back to the worker (if replaced
        meanwhile) only once this is done with it."""
        p = self._persister
        got = p.memory.pin(step)
        if got is None:
            yield None
            return
        slot, spec, nbytes = got
        view = p.slots.view(slot)[:nbytes]
        try:
            yield spec, view
        finally:
            view.release()
            p.slots.give_back(p.memory.unpin(slot))

    def install(self, spec: RecordSpec, data: bytes | bytearray) -> None:
        """Hold `data`, the state of `spec` a partner gave back, in a new staging slot (before the
        worker's Hello is answered: the reply hands it over, in use)."""
        p = self._persister
        (i,) = p.slots.new(1, align(len(data)))
        p.slots.view(i)[: len(data)] = data
        _, back = p.memory.hold(i, spec, len(data))
        p.slots.give_back(back)  # (none: it asked, holding no step)
        p.publish(spec.step, len(data))
