"""Engine side of `lowdiff+`: the CPU replica (§VI-B, Insight 2: incremental merging).

The replica is a full state (parameters, optimizer state, buffers, RNG, schedulers, ...) in this
process's memory, started from a real full snapshot (`Base`) and stepped forward by each step's
`Grads` with an optimizer of the trainer's class, its hyper-parameters set to that step's
(`ckptrun.restore.replay.apply_diff`, the replay lowdiff's restore uses). On CPU training the
replica is bit-exact. It is written to disk as an ordinary full record when the trainer says the
step is due (`persist`): copied into one persist buffer, allocated once, then written by the
engine's writer threads while the next steps are applied. The replica's tensors live in one
shared-memory file (`Arena`, re-laid out when the set of tensors changes, e.g. when Adam creates
its moments at the first step): a worker restarted after a crash maps it and loads from it
(`fetch`): no disk read and no copy in the engine.

Call order: Base first (or after a failed update), then Grads of consecutive steps; a Base of
the replica's own step replaces it (a re-base).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...engine.handlers import EngineContext, EngineHandler
from ...ipc.messages import RecordSpec, StrategyMessage
from ...ipc.staging import EngineSlot
from ...restore.recovery import build_optimizer, optimizer_classes
from ...restore.replay import apply_diff, warm_up_in_background
from ...storage import writeonce
from ...storage.layout import Layout, TensorSpec, view
from ...storage.store import full_name
from ...storage.tree import flatten, unflatten
from .messages import Base, Grads

POST_STEP = ("rng", "schedulers", "scalers", "extra")  # replaced whole by each step's diff


class Arena:
    """Tensors laid out in one shared-memory file (the run's leftovers cleanup removes it)."""

    def __init__(self, path: Path, layout: Layout) -> None:
        self.file = EngineSlot(path, layout.nbytes)
        self.layout = layout
        self.nbytes = layout.nbytes
        self.buf = torch.frombuffer(self.file.view, dtype=torch.uint8)[: layout.nbytes]
        self.specs = {spec.key: spec for spec in layout.specs}
        self.views = {key: view(self.buf, spec) for key, spec in self.specs.items()}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for key, t in tensors.items():
                self.views[key].copy_(t)

    def fits(self, tensors: dict[str, torch.Tensor]) -> bool:
        return tensors.keys() == self.views.keys() and all(
            (t.dtype, t.shape) == (self.views[k].dtype, self.views[k].shape) for k, t in tensors.items())

    def holds(self, t: torch.Tensor) -> bool:
        start = self.buf.data_ptr()
        return start <= t.data_ptr() < start + self.nbytes

    def close(self) -> None:
        del self.buf, self.views
        self.file.close()


@dataclass
class Replica:
    step: int
    state: dict  # the nested full state; its tensors are the replica's own memory
    optimizer: torch.optim.Optimizer
    meta: dict  # the record metadata of the newest step (rank, world size, optimizer classes)
    exact: bool  # updated with the trainer's arithmetic (CPU training)
    time: float  # when the trainer finished the step
    skeleton: Any = None  # of `full_state()`, whose tensors are all in the arena (after `settle`)

    def full_state(self) -> dict:
        """The state as the trainer's full snapshot of this step holds it."""
        return {**self.state, "optimizers": {"optimizer": self.optimizer.state_dict()}}


class LowDiffPlusHandler(EngineHandler):
    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        torch.set_num_threads(1)  # the update runs beside training: one core (paper §VII-B)
        self.replica: Replica | None = None
        self.arena: Arena | None = None
        self.generation = 0
        self.classes = optimizer_classes()
        self.persist_buf: torch.Tensor | None = None  # one buffer, reused by every write
        self.replicated: list[int] = []  # (Base.replicated: what one rank writes under DDP)
        self.shared: list[int] = []  # (Base.shared: what every rank writes, named in the index)
        self.idle = threading.Event()  # no write of the persist buffer in flight
        self.idle.set()
        warm_up_in_background()

    def handle(self, msg: StrategyMessage) -> None:
        if not isinstance(msg, Base | Grads):
            super().handle(msg)
        step = msg.spec.step
        try:
            (self._rebase if isinstance(msg, Base) else self._apply)(msg)
        except Exception as e:  # noqa: BLE001 - reported; the trainer sends a full snapshot again
            self.replica = None
            self.ctx.save_error(step, full_name(step), f"replica update failed ({type(e).__name__}: {e}); "
                                                       "re-basing from a full snapshot")
            return
        finally:
            self.ctx.free_slot(msg.slot)
        self.ctx.in_memory(step, self.arena.nbytes)
        if msg.persist or self.ctx.write_fault_due(step):
            self._persist()

    def _slot_tree(self, slot: int, spec: RecordSpec) -> dict:
        buf = torch.frombuffer(self.ctx.slot_view(slot), dtype=torch.uint8)
        return unflatten(spec.skeleton, {k: view(buf, TensorSpec.from_json(k, t)) for k, t in spec.tensors.items()})

    def _rebase(self, msg: Base) -> None:
        """Start the replica from a full snapshot (the slot's bytes, then moved into an arena)."""
        spec = msg.spec
        state = self._slot_tree(msg.slot, spec)
        self.replicated, self.shared = msg.replicated, msg.shared
        self.replica = Replica(spec.step, state, self._optimizer(spec.meta, state), spec.meta, msg.exact,
                               spec.meta["snapshot_time"])
        self._relayout()

    def _apply(self, msg: Grads) -> None:
        """Step the replica with one step's gradients and hyper-parameters; take its post-step state."""
        spec, r = msg.spec, self.replica
        if r is None or r.step != spec.step - 1:
            raise ValueError(f"the replica holds step {r.step if r else 'none'}")
        diff = self._slot_tree(msg.slot, spec)
        with torch.no_grad():
            for clip in diff["scales"]:  # as the script's clipping did to the trainer's gradients
                for i in clip["params"]:
                    diff["grads"][i].mul_(clip["coef"])
        apply_diff(r.optimizer, diff)
        for group, late in zip(r.optimizer.param_groups, diff["param_groups"]["optimizer"], strict=True):
            group.update({k: v for k, v in late.items() if k != "params"})  # as a scheduler left them
        with torch.no_grad():
            for name, buffers in diff["buffers"].items():
                for key, value in buffers.items():
                    r.state["models"][name][key].copy_(value)
        r.state.update(_own({k: diff[k] for k in POST_STEP}))
        r.step, r.meta, r.time = spec.step, spec.meta, spec.meta["snapshot_time"]
        self._settle()

    def _optimizer(self, meta: dict, state: dict) -> torch.optim.Optimizer:
        """The trainer's optimizer class over `state`'s tensors (its own, not copies)."""
        info = meta["optimizers"]["optimizer"]
        optimizer, params = build_optimizer(self.classes[info["class"]], info, state)
        for p, aliases in zip(params, info["params"], strict=True):
            for model, key in aliases:  # a tied weight is one tensor in the replica too
                state["models"][model][key] = p
        return optimizer

    def _relayout(self) -> None:
        """Move the replica into a new arena of its current tensors and rebuild its optimizer
        over them (torch's `load_state_dict` keeps tensors of the parameter's dtype and device)."""
        r = self.replica
        skeleton, tensors = flatten(r.full_state())
        self.generation += 1
        arena = Arena(self.ctx.shared_file(f"replica{self.generation}"), Layout.of(tensors))
        arena.load(tensors)
        r.state = unflatten(skeleton, dict(arena.views))
        r.optimizer = self._optimizer(r.meta, r.state)
        r.skeleton = skeleton
        old, self.arena = self.arena, arena
        if old is not None:
            old.close()
        stray = [k for k, t in flatten(r.full_state())[1].items() if not arena.holds(t)]
        if stray:
            raise RuntimeError(f"the optimizer copied {stray[0]} on load instead of keeping the replica's tensor")
        self.ctx.emit(type="replica", rank=self.ctx.rank, step=r.step, nbytes=arena.nbytes)

    def _settle(self) -> None:
        """Bring the arena up to date after a step: tensors the step replaced rather than updated
        in place (RNG states, tracked objects) are copied in; new or reshaped ones (an optimizer's
        state created at its first step) re-lay it out."""
        r = self.replica
        skeleton, tensors = flatten(r.full_state())
        if not self.arena.fits(tensors):
            self._relayout()
            return
        with torch.no_grad():
            for key, t in tensors.items():
                place = self.arena.views[key]
                if t.data_ptr() != place.data_ptr():
                    place.copy_(t)
        r.skeleton = skeleton

    def _persist(self) -> None:
        """Copy the arena into the persist buffer (waiting for the previous write) and queue its
        write as the full record of the replica's step; under DDP, without the replicated tensors
        another rank writes (storage/writeonce.py)."""
        r, arena = self.replica, self.arena
        self.idle.wait()
        skeleton, layout, tensors = r.skeleton, arena.layout, None
        aliases = r.meta["optimizers"]["optimizer"]["params"]
        state = r.full_state() if self.replicated or self.shared else {}  # (read only under DDP)
        if self.replicated:
            skeleton, tensors = writeonce.split_state(state, self.replicated, aliases, self.ctx.rank,
                                                      self.ctx.world_size)
            layout = Layout.of(tensors)
        if self.persist_buf is None or self.persist_buf.numel() < layout.nbytes:
            self.persist_buf = torch.empty(layout.nbytes, dtype=torch.uint8)
            self.ctx.emit(type="replica_buffer", rank=self.ctx.rank, nbytes=layout.nbytes)
        with torch.no_grad():
            if tensors is None:
                self.persist_buf[: layout.nbytes].copy_(arena.buf)
            else:
                for s in layout.specs:
                    view(self.persist_buf, s).copy_(tensors[s.key])
        meta = {**writeonce.with_shared_keys(r.meta, state, self.shared, aliases), "step": r.step,
                "snapshot_time": r.time}
        spec = RecordSpec(record=full_name(r.step), kind="full", step=r.step, skeleton=skeleton,
                          tensors={s.key: s.to_json() for s in layout.specs}, meta=meta)
        self.idle.clear()
        self.ctx.run(self._write, spec, memoryview(self.persist_buf.numpy())[: layout.nbytes])

    def _write(self, spec: RecordSpec, data: memoryview) -> None:
        try:
            self.ctx.write_now(spec, data)
        finally:
            self.idle.set()

    def flush(self) -> None:
        self.idle.wait()

    def close(self) -> None:
        """Its worker came back as another rank: the replica is the old rank's state. Dropped (a
        new handler starts from the new rank's records)."""
        self.restart()
        arena, self.replica, self.arena = self.arena, None, None
        if arena is not None:
            arena.close()

    def held(self) -> tuple[int, int] | None:
        if self.replica is None:
            return None
        return self.replica.step, self.arena.nbytes

    def fetch(self) -> dict:
        r, arena = self.replica, self.arena
        self.ctx.emit(type="replica_fetch", rank=self.ctx.rank, step=r.step, nbytes=arena.nbytes)
        return {"step": r.step, "path": str(arena.file.path), "skeleton": r.skeleton,
                "tensors": {k: s.to_json() for k, s in arena.specs.items()}, "exact": r.exact}


def _own(tree: Any) -> Any:
    """`tree` with private copies of its tensors (they are views of a staging slot until then)."""
    skeleton, tensors = flatten(tree)
    return unflatten(skeleton, {k: t.clone() for k, t in tensors.items()})
