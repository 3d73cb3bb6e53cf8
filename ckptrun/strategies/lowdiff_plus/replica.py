"""A lowdiff+ replica: a full state stepped forward by each step's gradients with an optimizer of
the trainer's class (`ckptrun.restore.replay.apply_diff`, the replay lowdiff's restore uses). The
engine keeps its rank's own (engine.py); with --replicas, partners keep one per owner, stepped by
the same diffs the owner ships (copies.py). On CPU training both are bit-exact."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ...engine.held_copies import HeldCopy, cut
from ...errors import CorruptCheckpoint
from ...ipc.messages import RecordSpec
from ...ipc.staging import EngineSlot
from ...restore.recovery import build_optimizer
from ...restore.replay import apply_diff
from ...storage.layout import Layout, TensorSpec, view
from ...storage.schema import checksum
from ...storage.store import full_name
from ...storage.tree import flatten, unflatten

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
    real: bool = False  # the trainer's own snapshot, not stepped since (its bits, whatever the device)

    def full_state(self) -> dict:
        """The state as the trainer's full snapshot of this step holds it."""
        return {**self.state, "optimizers": {"optimizer": self.optimizer.state_dict()}}


def tree_of(spec: RecordSpec, buf: torch.Tensor) -> dict:
    """The nested state `spec` lays out in `buf` (its tensors are views of it)."""
    return unflatten(spec.skeleton, {k: view(buf, TensorSpec.from_json(k, t)) for k, t in spec.tensors.items()})


class SteppedReplica:
    """A full state in an arena of its own, started from a real full state (`rebase`) and stepped
    by consecutive diffs (`apply`). Call order: rebase, then apply of each next step; a rebase
    replaces it whole. `new_arena(layout)` makes the arena (a shared-memory file)."""

    def __init__(self, classes: dict[str, type], new_arena: Callable[[Layout], Arena]) -> None:
        self.classes = classes
        self.new_arena = new_arena
        self.replica: Replica | None = None
        self.arena: Arena | None = None

    @property
    def step(self) -> int | None:
        return self.replica.step if self.replica is not None else None

    def rebase(self, spec: RecordSpec, state: dict, exact: bool, *, real: bool = False) -> None:
        """Start from `state`, the full state of `spec`'s step (copied into a new arena); `real`:
        the trainer's own snapshot (`Replica.real`)."""
        self.replica = Replica(spec.step, state, self._optimizer(spec.meta, state), spec.meta, exact,
                               spec.meta["snapshot_time"], real=real)
        self._relayout()

    def apply(self, spec: RecordSpec, diff: dict, *, owned: bool = True) -> None:
        """Step with one step's gradients and hyper-parameters (`diff`); take its post-step
        state. `owned`: the diff's tensors may be changed (clipping scales them in place), else
        they are left as they are (bytes also on their way to partners). A diff not of the next
        step is refused (ValueError)."""
        r = self.replica
        if r is None or r.step != spec.step - 1:
            raise ValueError(f"the replica holds step {r.step if r else 'none'}, not {spec.step - 1}")
        grads = diff["grads"] if owned else list(diff["grads"])
        for clip in diff["scales"]:  # as the script's clipping did to the trainer's gradients
            for i in clip["params"]:
                grads[i] = grads[i].mul_(clip["coef"]) if owned else grads[i] * clip["coef"]
        diff = {**diff, "groups": _own(diff["groups"]), "param_groups": _own(diff["param_groups"])}  # (no view
        apply_diff(r.optimizer, {**diff, "grads": grads})  # of the diff's bytes outlives the step)
        for group, late in zip(r.optimizer.param_groups, diff["param_groups"]["optimizer"], strict=True):
            group.update({k: v for k, v in late.items() if k != "params"})  # as a scheduler left them
        with torch.no_grad():
            for name, buffers in diff["buffers"].items():
                for key, value in buffers.items():
                    r.state["models"][name][key].copy_(value)
        r.state.update(_own({k: diff[k] for k in POST_STEP}))
        r.step, r.meta, r.time, r.real = spec.step, spec.meta, spec.meta["snapshot_time"], False
        self._settle()

    def apply_copy(self, spec: RecordSpec, diff: HeldCopy, *, owned: bool) -> None:
        """`apply` the diff a copy holds whole (its bytes laid out as `spec` says)."""
        self.apply(spec, tree_of(spec, torch.frombuffer(diff.data, dtype=torch.uint8)), owned=owned)

    def rebase_from(self, spec: RecordSpec, data: bytes | bytearray, exact: bool, what: str) -> None:
        """`rebase` from a whole copy's bytes (`spec` its checked index): a partner's, untrusted,
        so whatever fails is CorruptCheckpoint (an optimizer it names that is not known here, a
        state that does not fit it)."""
        buf = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8)
        try:
            self.rebase(spec, tree_of(spec, buf), exact)
        except Exception as e:  # noqa: BLE001 - untrusted input: any failure refuses it
            self.drop()
            raise CorruptCheckpoint(f"{what}: not a replica this engine can step ({type(e).__name__}: {e})") from e

    def spec(self, meta: dict | None = None) -> RecordSpec:
        """The full record of the replica's step, as its arena lays it out (`meta` added)."""
        r = self.replica
        return RecordSpec(record=full_name(r.step), kind="full", step=r.step, skeleton=r.skeleton,
                          tensors={k: s.to_json() for k, s in self.arena.specs.items()},
                          meta={**r.meta, "step": r.step, "snapshot_time": r.time, **(meta or {})})

    def copy(self, rank: int, meta: dict | None = None, *, thin: bool = False) -> HeldCopy:
        """A copy of the replica for a partner: its bytes and index (each tensor's xxh3); `thin`:
        without the tensors `meta`'s "shared" names (dpshared.py)."""
        return cut(rank, self.spec(meta), memoryview(self.arena.buf.numpy()), thin=thin)

    def sums(self, keys: Iterable[str] | None = None) -> dict[str, str]:
        """The xxh3 of the arena's tensors (`keys` of them; None: all), as an index has them."""
        data = memoryview(self.arena.buf.numpy())
        specs = self.arena.specs
        return {k: checksum(data[specs[k].offset : specs[k].offset + specs[k].nbytes])
                for k in (specs if keys is None else keys)}

    def flip(self) -> None:
        """One bit of its largest tensor flipped, as memory going bad would (the `corrupt-replica`
        fault)."""
        s = max(self.arena.specs.values(), key=lambda s: s.nbytes)
        self.arena.buf[s.offset + s.nbytes // 2] ^= 1

    def drop(self) -> None:
        arena, self.replica, self.arena = self.arena, None, None
        if arena is not None:
            arena.close()

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
        arena = self.new_arena(Layout.of(tensors))
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


def _own(tree: Any) -> Any:
    """`tree` with private copies of its tensors (they are views of a staging slot until then)."""
    skeleton, tensors = flatten(tree)
    return unflatten(skeleton, {k: t.clone() for k, t in tensors.items()})


KEPT_BACK = 3  # diffs a replica keeps unapplied at most (--replicas)


class Stepped(Protocol):
    """What `KeptBack` steps: a replica (`SteppedReplica`), or a partner's per-rank part of one
    (perrank.py)."""

    @property
    def step(self) -> int | None: ...

    def apply_copy(self, spec: RecordSpec, diff: HeldCopy, *, owned: bool) -> None: ...

    def sums(self) -> dict[str, str]: ...

    def flip(self) -> None: ...

    def drop(self) -> None: ...


class KeptBack:
    """A replica and the newest diffs after its step, not applied yet (--replicas): it can stand
    at its own step or any of theirs. The owner's engine and a partner each apply a diff only
    once the other side has one of that step too (`apply`'s `upto`), or when more than
    KEPT_BACK wait: so the owner's replica and a partner's copy of a lost node's can still meet
    on one step, whichever of them lagged (engine.py, copies.py)."""

    def __init__(self, replica: Stepped, *, owned: bool, done: Callable[[HeldCopy], None] | None = None) -> None:
        self.stepped = replica
        self.owned = owned  # the diffs' bytes are its own (else shared with the copies being shipped)
        self.done = done  # called with each diff applied or dropped (its buffer may be used again)
        self.diffs: deque[tuple[RecordSpec, HeldCopy]] = deque()

    def newest(self) -> int | None:
        """(Read by the other side's thread too: a diff applied meanwhile is no longer the last.)"""
        try:
            return self.diffs[-1][0].step
        except IndexError:
            return self.stepped.step

    def steps(self) -> list[int]:
        """The steps it can stand at, newest first."""
        if self.stepped.step is None:
            return []
        return [spec.step for spec, _ in reversed(self.diffs)] + [self.stepped.step]

    def add(self, spec: RecordSpec, diff: HeldCopy) -> None:
        """Keep the diff of `spec.step` (the step after one it can stand at; any newer are
        dropped: the trainer resumed before them); else ValueError."""
        if spec.step - 1 not in self.steps():
            raise ValueError(f"the replica can stand at steps {self.steps()}, not {spec.step - 1}")
        while self.diffs and self.diffs[-1][0].step >= spec.step:
            self._done(self.diffs.pop()[1])
        self.diffs.append((spec, diff))

    def apply(self, upto: float = float("inf"), each: Callable[[int], None] | None = None) -> bool:
        """Apply the diffs of steps up to `upto`, and older ones past KEPT_BACK (`each(step)`
        after each of them); True if any."""
        applied = False
        while self.diffs and (self.diffs[0][0].step <= upto or len(self.diffs) > KEPT_BACK):
            spec, diff = self.diffs.popleft()
            try:
                self.stepped.apply_copy(spec, diff, owned=self.owned)
            finally:
                self._done(diff)
            applied = True
            if each is not None:
                each(spec.step)
        return applied

    def stand_at(self, step: int, each: Callable[[int], None] | None = None) -> None:
        """Apply the diffs up to `step` (as `apply`), drop the newer ones; ValueError if it
        cannot stand there."""
        if step not in self.steps():
            raise ValueError(f"the replica can stand at steps {self.steps()}, not {step}")
        self.apply(step, each)
        self.clear()

    def clear(self) -> None:
        while self.diffs:
            self._done(self.diffs.pop()[1])

    def _done(self, diff: HeldCopy) -> None:
        if self.done is not None:
            self.done(diff)
