"""Engine side of `lowdiff+`: the CPU replica (§VI-B, Insight 2: incremental merging).

The replica is a full state (parameters, optimizer state, buffers, RNG, schedulers, ...) in this
process's memory, started from a real full snapshot (`Base`) and stepped forward by each step's
`Grads` with an optimizer of the trainer's class, its hyper-parameters set to that step's
(`ckptrun.restore.replay.apply_diff`, the replay lowdiff's restore uses). On CPU training the
replica is bit-exact. It is written to disk as an ordinary full record when the trainer says the
step is due (`persist`): copied into one persist buffer, allocated once, then written by the
engine's writer threads while the next steps are applied. A worker restarted after a crash is
handed the replica through a staging slot (`fetch`): no disk read.

Call order: Base first (or after a failed update), then Grads of consecutive steps; a Base of
the replica's own step replaces it (a re-base).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from ...engine.handlers import EngineContext, EngineHandler
from ...ipc.messages import RecordSpec, StrategyMessage
from ...restore.recovery import build_optimizer, optimizer_classes
from ...restore.replay import apply_diff
from ...storage.layout import Layout, TensorSpec, view
from ...storage.store import full_name
from ...storage.tree import flatten, unflatten
from .messages import Base, Grads

POST_STEP = ("rng", "schedulers", "scalers", "extra")  # replaced whole by each step's diff


@dataclass
class Replica:
    step: int
    state: dict  # the nested full state; its tensors are the replica's own memory
    optimizer: torch.optim.Optimizer
    meta: dict  # the record metadata of the newest step (rank, world size, optimizer classes)
    exact: bool  # updated with the trainer's arithmetic (CPU training)
    time: float  # when the trainer finished the step
    nbytes: int  # of the full snapshot it started from (about its size)

    def full_state(self) -> dict:
        """The state as the trainer's full snapshot of this step holds it."""
        return {**self.state, "optimizers": {"optimizer": self.optimizer.state_dict()}}


class LowDiffPlusHandler(EngineHandler):
    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        torch.set_num_threads(1)  # the update runs beside training: one core (paper §VII-B)
        self.replica: Replica | None = None
        self.classes = optimizer_classes()
        self.persist_buf: torch.Tensor | None = None  # one buffer, reused by every write
        self.idle = threading.Event()  # no write of the persist buffer in flight
        self.idle.set()
        # The first optimizer step of a process imports and initialises much of torch (about a
        # second): pay it now, while the trainer starts, not when the first step's gradients come.
        threading.Thread(target=_warm_up, name="ckptrun-replica-warmup", daemon=True).start()

    def handle(self, msg: StrategyMessage) -> None:
        if isinstance(msg, Base):
            self._rebase(msg)
        elif isinstance(msg, Grads):
            self._apply(msg)
        else:
            super().handle(msg)

    def _slot_tree(self, slot: int, spec: RecordSpec) -> dict:
        buf = torch.frombuffer(self.ctx.slot_view(slot), dtype=torch.uint8)
        return unflatten(spec.skeleton, {k: view(buf, TensorSpec.from_json(k, t)) for k, t in spec.tensors.items()})

    def _rebase(self, msg: Base) -> None:
        spec = msg.spec
        try:
            state = _own(self._slot_tree(msg.slot, spec))
        finally:
            self.ctx.free_slot(msg.slot)
        info = spec.meta["optimizers"]["optimizer"]
        optimizer, params = build_optimizer(self.classes[info["class"]], info, state)
        for p, aliases in zip(params, info["params"], strict=True):
            for model, key in aliases:  # a tied weight is one tensor in the replica too
                state["models"][model][key] = p
        self.replica = Replica(spec.step, state, optimizer, spec.meta, msg.exact, spec.meta["snapshot_time"],
                               msg.nbytes)
        self.ctx.emit(type="replica", rank=self.ctx.rank, step=spec.step, nbytes=msg.nbytes)
        self.ctx.in_memory(spec.step, msg.nbytes)
        if msg.write or self.ctx.write_fault_due(spec.step):
            self._persist()

    def _apply(self, msg: Grads) -> None:
        spec, r = msg.spec, self.replica
        try:
            if r is None or r.step != spec.step - 1:
                raise ValueError(f"the replica holds step {r.step if r else 'none'}")
            diff = self._slot_tree(msg.slot, spec)
            apply_diff(r.optimizer, diff)
            for group, late in zip(r.optimizer.param_groups, diff["param_groups"]["optimizer"], strict=True):
                group.update({k: v for k, v in late.items() if k != "params"})  # as a scheduler left them
            for name, buffers in diff["buffers"].items():
                for key, value in buffers.items():
                    r.state["models"][name][key].copy_(value)
            r.state.update(_own({k: diff[k] for k in POST_STEP}))
        except Exception as e:  # noqa: BLE001 - reported; the trainer sends a full snapshot again
            self.replica = None
            self.ctx.save_error(spec.step, full_name(spec.step),
                                f"replica update failed ({type(e).__name__}: {e}); re-basing from a full snapshot")
            return
        finally:
            self.ctx.free_slot(msg.slot)
        r.step, r.meta, r.time = spec.step, spec.meta, spec.meta["snapshot_time"]
        self.ctx.in_memory(spec.step, r.nbytes)
        if msg.persist or self.ctx.write_fault_due(spec.step):
            self._persist()

    def _persist(self) -> None:
        """Copy the replica into the persist buffer (waiting for the previous write) and queue
        its write as the full record of its step."""
        r = self.replica
        skeleton, tensors = flatten(r.full_state())
        layout = Layout.of(tensors)
        self.idle.wait()
        if self.persist_buf is None or self.persist_buf.numel() < layout.nbytes:
            self.persist_buf = torch.empty(layout.nbytes, dtype=torch.uint8)
            self.ctx.emit(type="replica_buffer", rank=self.ctx.rank, nbytes=layout.nbytes)
        _copy_into(self.persist_buf, layout, tensors)
        r.nbytes = layout.nbytes
        spec = RecordSpec(record=full_name(r.step), kind="full", step=r.step, skeleton=skeleton,
                          tensors={s.key: s.to_json() for s in layout.specs},
                          meta={**r.meta, "step": r.step, "snapshot_time": r.time})
        self.idle.clear()
        self.ctx.run(self._write, spec, memoryview(self.persist_buf.numpy())[: layout.nbytes])

    def _write(self, spec: RecordSpec, data: memoryview) -> None:
        try:
            self.ctx.write_now(spec, data)
        finally:
            self.idle.set()

    def flush(self) -> None:
        self.idle.wait()

    def held(self) -> tuple[int, int] | None:
        if self.replica is None:
            return None
        return self.replica.step, Layout.of(flatten(self.replica.full_state())[1]).nbytes

    def fetch(self, slot: int) -> dict:
        r = self.replica
        skeleton, tensors = flatten(r.full_state())
        layout = Layout.of(tensors)
        buf = torch.frombuffer(self.ctx.slot_view(slot), dtype=torch.uint8)
        if layout.nbytes > buf.numel():
            raise ValueError(f"the replica ({layout.nbytes} bytes) does not fit the slot ({buf.numel()} bytes)")
        _copy_into(buf, layout, tensors)
        self.ctx.emit(type="replica_fetch", rank=self.ctx.rank, step=r.step, nbytes=layout.nbytes)
        return {"step": r.step, "skeleton": skeleton, "tensors": {s.key: s.to_json() for s in layout.specs},
                "exact": r.exact}


def _warm_up() -> None:
    p = torch.zeros(1, requires_grad=True)
    p.grad = torch.zeros(1)
    torch.optim.AdamW([p]).step()


def _copy_into(buf: torch.Tensor, layout: Layout, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for spec in layout.specs:
            view(buf, spec).copy_(tensors[spec.key])


def _own(tree: Any) -> Any:
    """`tree` with private copies of its tensors (they are views of a staging slot until then)."""
    skeleton, tensors = flatten(tree)
    return unflatten(skeleton, {k: t.clone() for k, t in tensors.items()})
