"""State providers (DataStates-LLM §V-A3): each kind of a rank's state as a stream of chunks.

A provider knows one kind of state: which tensors are its (they stream to the engine as
zero-copy chunks, at fixed file offsets, in the provider's order) and which of its values are
objects (serialized to JSON off the training thread, appended to the file's log), and whether
they are final right after the step (early) or only once the script has stepped its schedulers
(late). Providers compose: `Composite` puts its children's tensors one after another and
concatenates their objects, so the engine sees one stream and knows nothing of the state's
kinds. An object names the path in the skeleton its value goes to; the reader rebuilds the
skeleton from those paths (`storage/rankfile.py`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import torch

Path = tuple[str, ...]


class StateProvider:
    """One kind of state. `prefixes`: the skeleton's top-level keys (and tensor key prefixes) it
    owns; `late`: the keys one level below that settle only after the step."""

    prefixes: tuple[str, ...] = ()
    late: frozenset[str] = frozenset()

    def owns(self, key: str) -> bool:
        return key.split("/", 1)[0] in self.prefixes

    def tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Its tensors, in the order they stream (zero-copy: the live tensors themselves)."""
        return {k: t for k, t in tensors.items() if self.owns(k)}

    def objects(self, skeleton: dict, *, late: bool) -> list[tuple[Path, Any]]:
        """(path, value) of its objects present in `skeleton`, early or late ones."""
        found = []
        for top in self.prefixes:
            node = skeleton.get(top)
            if node is None:
                continue
            found += self._split((top,), node, late)
        return found

    def _split(self, path: Path, node: Any, late: bool) -> list[tuple[Path, Any]]:
        return [(path, node)] if late == (path[0] in self.late) else []


class ModelState(StateProvider):
    """The models' state_dicts: one object per model (the skeleton naming its tensors)."""

    prefixes = ("models",)

    def _split(self, path: Path, node: Any, late: bool) -> list[tuple[Path, Any]]:
        return [] if late else [((*path, name), sd) for name, sd in node.items()]


class OptimizerState(StateProvider):
    """The optimizers: per optimizer its state (early) and its param_groups (late: a scheduler
    sets their lr after the step)."""

    prefixes = ("optimizers",)

    def _split(self, path: Path, node: Any, late: bool) -> list[tuple[Path, Any]]:
        return [((*path, name, key), value) for name, sd in node.items() for key, value in sd.items()
                if (key == "param_groups") == late]


class ExtraState(StateProvider):
    """RNG states (early), schedulers and scalers (late)."""

    prefixes = ("rng", "schedulers", "scalers")
    late = frozenset({"schedulers", "scalers"})


class TrackedState(StateProvider):
    """What the script tracks (`ckptrun.track`, framework loop positions): one object per tracked
    object (late: the script updates them after the step)."""

    prefixes = ("extra",)

    def _split(self, path: Path, node: Any, late: bool) -> list[tuple[Path, Any]]:
        if not late:
            return []
        return [((*path, name), state) for name, state in node.items()] or [(path, {})]


class Composite(StateProvider):
    """Children's streams one after another; state no child owns is its own (tensors last,
    objects late: nothing is left out)."""

    def __init__(self, children: Iterable[StateProvider]) -> None:
        self.children = tuple(children)

    def owns(self, key: str) -> bool:
        return True

    def tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ordered: dict[str, torch.Tensor] = {}
        for child in self.children:
            ordered.update(child.tensors(tensors))
        return {**ordered, **{k: t for k, t in tensors.items() if k not in ordered}}

    def objects(self, skeleton: dict, *, late: bool) -> list[tuple[Path, Any]]:
        found = [o for child in self.children for o in child.objects(skeleton, late=late)]
        if late:
            claimed = {p for child in self.children for p in child.prefixes}
            found += [((top,), node) for top, node in skeleton.items() if top not in claimed]
        return found


def rank_state() -> Composite:
    """The provider tree of a training process's state: model, optimizer, the rest."""
    return Composite([ModelState(), OptimizerState(), ExtraState(), TrackedState()])


def serialize(objects: list[tuple[Path, Any]]) -> list[tuple[Path, bytes]]:
    """Each object's JSON (keys in insertion order: the state_dicts' own order is restored)."""
    return [(path, json.dumps(value).encode()) for path, value in objects]
