"""--replicas with lowdiff+ under DDP: a partner's copy of a data-parallel peer's replica holds
only what is the owner's own (for diffs, the data-parallel short-cut dpshared.py is for
snapshots). Every data-parallel rank's replica holds the same parameters and optimizer state,
stepped by the same all-reduced gradients: the owner ships its replica thin (those tensors'
bytes left out, their xxh3 in its index) and each step's diff thin (its gradients' xxh3, not
their bytes). The partner checks the shared tensors against its own replica's of the same step
and each diff's update against its own diff of that step (`update_print`; copies.py), steps
only the per-rank state with the diff (buffers, RNG, schedulers, hyper-parameters: no optimizer
update), and to give the copy back reads the shared tensors from its own replica standing at
that step. A step costs the network kilobytes and the partner no second update."""

from __future__ import annotations

import json
from typing import Any

import torch

from ...engine.held_copies import HeldCopy, cut, spec_of
from ...errors import CorruptCheckpoint
from ...ipc.messages import RecordSpec
from ...storage.layout import Layout, dtype_from_name, view
from ...storage.schema import RankIndex, checksum
from ...storage.store import full_name
from ...storage.tiers.dpshared import kept_tensors, shared_keys
from ...storage.tree import TENSOR, flatten, unflatten
from .replica import POST_STEP

UPDATE = ("grads", "scales", "groups")  # what of a diff the optimizer's update depends on


def update_print(index: RankIndex) -> str:
    """What of a diff the update of the replicated state depends on (`UPDATE`, each tensor by
    its xxh3): equal for two data-parallel ranks' diffs of one step."""
    def sub(node: Any) -> Any:
        if isinstance(node, list):
            return [sub(v) for v in node]
        if isinstance(node, dict):
            if TENSOR in node:  # (a key it does not hold, or no key: no rank's print matches)
                t = index.tensors.get(node[TENSOR]) if isinstance(node[TENSOR], str) else None
                return t.xxh3 if t is not None else None
            return {k: sub(v) for k, v in node.items()}
        return node

    skeleton = index.skeleton if isinstance(index.skeleton, dict) else {}
    return json.dumps({k: sub(skeleton.get(k)) for k in UPDATE}, sort_keys=True)


def thin_tree(copy: HeldCopy, spec: RecordSpec) -> dict:
    """The nested state of thin `copy` (checked; `spec`, its `spec_of`): its own tensors from
    its bytes, each shared one a placeholder on the meta device (its dtype and shape, no memory)."""
    index = copy.index
    shared = shared_keys(index)
    tensors, pos = {}, 0
    for key, t in kept_tensors(index, shared):
        raw = bytearray(copy.data[pos : pos + t.nbytes])
        dtype = dtype_from_name(t.dtype)
        tensors[key] = torch.frombuffer(raw, dtype=dtype).reshape(t.shape) if t.nbytes else \
            torch.empty(t.shape, dtype=dtype)
        pos += t.nbytes
    for key in shared:
        t = index.tensors[key]
        tensors[key] = torch.empty(t.shape, dtype=dtype_from_name(t.dtype), device="meta")
    return unflatten(spec.skeleton, tensors)


class PerRankReplica:
    """A peer's replica less its shared tensors (placeholders), stepped like `SteppedReplica`
    less the optimizer's update (`KeptBack` steps it). Call order: rebase_from, then apply_copy
    of each next step."""

    def __init__(self) -> None:
        self.state: dict | None = None  # the full state's tree
        self.meta: dict = {}
        self.time = 0.0
        self._step: int | None = None

    @property
    def step(self) -> int | None:
        return self._step

    def rebase_from(self, copy: HeldCopy, what: str) -> None:
        """Start from a thin whole replica (checked; a partner's, untrusted: whatever does not
        hold together is CorruptCheckpoint)."""
        try:
            spec = spec_of(copy)
            state = thin_tree(copy, spec)
            if not isinstance(state["optimizers"]["optimizer"]["param_groups"], list):
                raise TypeError("its optimizer has no parameter groups")
            self.state, self._step = state, copy.step
            self._took(spec.meta)
        except Exception as e:  # noqa: BLE001 - untrusted input: any failure refuses it
            self.drop()
            raise CorruptCheckpoint(f"{what}: not a replica's per-rank state ({type(e).__name__}: {e})") from e

    def apply_copy(self, spec: RecordSpec, diff: HeldCopy, *, owned: bool) -> None:
        """Take a thin diff's per-rank post-step state and hyper-parameters (as SteppedReplica's
        `apply` and `apply_diff` leave them); the shared state moves with this engine's own
        replica. A diff not of the next step is refused (ValueError)."""
        if self._step is None or self._step != spec.step - 1:
            raise ValueError(f"the copy holds step {self._step}, not {spec.step - 1}")
        d = thin_tree(diff, spec)  # (`spec`: the diff's, as KeptBack kept it)
        groups = self.state["optimizers"]["optimizer"]["param_groups"]
        for group, hp, late in zip(groups, d["groups"], d["param_groups"]["optimizer"], strict=True):
            group.update(hp)
            group.update({k: v for k, v in late.items() if k != "params"})
        for name, buffers in d["buffers"].items():
            self.state["models"][name].update(buffers)
        self.state.update({k: d[k] for k in POST_STEP})
        self._step = spec.step
        self._took(spec.meta)

    def _took(self, meta: dict) -> None:
        self.meta = {k: v for k, v in meta.items() if k != "shared"}  # (shared: of the copy shipped)
        self.time = meta["snapshot_time"]

    def sums(self) -> dict[str, str]:
        """The xxh3 of its own tensors (not the placeholders)."""
        return {k: checksum(t.detach().reshape(-1).view(torch.uint8).numpy())
                for k, t in flatten(self.state)[1].items() if not t.is_meta}

    def shared_keys(self) -> list[str]:
        return [k for k, t in flatten(self.state)[1].items() if t.is_meta]

    def whole(self, rank: int, own: dict, meta: dict) -> HeldCopy:
        """Rank `rank`'s replica whole: its shared tensors, and its optimizer's state (all of it
        shared, made at the first step), are `own`'s, this engine's own replica's full state at
        the same step; `meta` added to the index."""
        opt = self.state["optimizers"]["optimizer"]
        state = {**self.state, "optimizers": {**self.state["optimizers"],
                                              "optimizer": {**opt, "state": own["optimizers"]["optimizer"]["state"]}}}
        skeleton, tensors = flatten(state)
        mine = flatten(own)[1]
        for key, t in tensors.items():
            if t.is_meta:
                o = mine.get(key)
                if o is None or (o.dtype, o.shape) != (t.dtype, t.shape):
                    raise CorruptCheckpoint(f"{key} of rank {rank}'s replica: this engine's own replica holds no "
                                            "tensor like it")
                tensors[key] = o
        layout = Layout.of(tensors)
        buf = bytearray(layout.nbytes)
        flat = torch.frombuffer(buf, dtype=torch.uint8)
        with torch.no_grad():
            for s in layout.specs:
                view(flat, s).copy_(tensors[s.key])
        spec = RecordSpec(record=full_name(self._step), kind="full", step=self._step, skeleton=skeleton,
                          tensors={s.key: s.to_json() for s in layout.specs},
                          meta={**self.meta, "step": self._step, "snapshot_time": self.time, **meta})
        return cut(rank, spec, memoryview(buf), thin=False)

    def flip(self) -> None:
        """One bit of its largest own tensor flipped (the `corrupt-replica` fault)."""
        t = max((t for t in flatten(self.state)[1].values() if not t.is_meta), key=lambda t: t.nbytes)
        t.reshape(-1).view(torch.uint8)[t.nbytes // 2] ^= 1

    def drop(self) -> None:
        self.state, self._step = None, None
