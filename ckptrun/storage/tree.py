"""Split nested state (state_dicts, RNG states) into a JSON skeleton and a list of tensors.

Checkpoints must load without unpickling (DESIGN invariant 4): every tensor goes to raw
bytes, and everything else must be a JSON-representable value. Tuples, non-string dict keys
and numpy arrays are tagged so that the structure round-trips exactly.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from typing import Any

import torch

from .layout import dtype_from_name
from .sharding import DTENSOR, Sharded, placement_names
from .skeleton import DTYPE, FLOAT, ITEMS, NDARRAY, REMOTE, TENSOR, TUPLE

ORPHANS = "ckptrun.orphan_params."


def orphans_key(optimizer: str) -> str:
    """Where an optimizer's module-less parameters are tracked (under "extra")."""
    return ORPHANS + optimizer


def flatten(obj: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Return (skeleton, tensors): tensors keyed by their path; the skeleton names them."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(obj, prefix, tensors)
    return skeleton, tensors


def _key(path: str, tensors: dict[str, torch.Tensor]) -> str:
    key, n = path or "_", 1
    while key in tensors:
        key, n = f"{path}~{n}", n + 1
    return key


def dtensor_type() -> type | None:
    """DTensor's class if torch.distributed.tensor is loaded (no DTensor can exist otherwise)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def _flatten_dtensor(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> dict:
    """A DTensor as this rank's shard plus where it lies (storage/sharding.py)."""
    mesh = obj.device_mesh
    coord = mesh.get_coordinate()
    try:
        placements = placement_names(obj.placements)
    except ValueError as e:
        raise TypeError(f"cannot checkpoint the DTensor at {path!r}: {e}") from None
    if coord is None:
        raise TypeError(f"cannot checkpoint the DTensor at {path!r}: this rank is outside its mesh")
    local = _flatten(obj.to_local(), path, tensors)
    return {DTENSOR: {"local": local, "shape": list(obj.shape), "mesh": list(mesh.shape), "coord": list(coord),
                      "placements": placements}}


def _flatten(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(obj, dtensor):
        return _flatten_dtensor(obj, path, tensors)
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.is_quantized:
            raise TypeError(f"cannot checkpoint {obj.layout} tensor at {path!r}: only dense tensors")
        key = _key(path, tensors)
        tensors[key] = obj
        return {TENSOR: key}
    if type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray":
        key = _key(path, tensors)
        tensors[key] = torch.from_numpy(obj)
        return {NDARRAY: key}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {FLOAT: repr(obj)}
    if type(obj).__module__ == "numpy" and hasattr(obj, "item"):
        return _flatten(obj.item(), path, tensors)
    if isinstance(obj, tuple):
        return {TUPLE: [_flatten(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_flatten(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        def sub(k: Any) -> str:
            return f"{path}/{k}" if path else str(k)

        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _flatten(v, sub(k), tensors) for k, v in obj.items()}
        return {ITEMS: [[_flatten(k, path, {}), _flatten(v, sub(k), tensors)] for k, v in obj.items()]}
    if isinstance(obj, torch.dtype):
        return {DTYPE: str(obj).removeprefix("torch.")}
    raise TypeError(
        f"cannot checkpoint a {type(obj).__name__} at {path!r}: state must be tensors, numbers, "
        "strings, lists, tuples and dicts (give the object a state_dict() returning those)"
    )


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor],
              remote: dict[tuple[int, str], torch.Tensor] | None = None) -> Any:
    """Inverse of `flatten`: rebuild the nested state, taking tensors from `tensors`, and those
    other ranks wrote from `remote` ((rank, key) -> tensor)."""
    if isinstance(skeleton, list):
        return [unflatten(v, tensors, remote) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if TENSOR in skeleton:
        return tensors[skeleton[TENSOR]]
    if REMOTE in skeleton:
        return remote[tuple(skeleton[REMOTE])]
    if NDARRAY in skeleton:
        return tensors[skeleton[NDARRAY]].numpy()
    if FLOAT in skeleton:
        return float(skeleton[FLOAT])
    if TUPLE in skeleton:
        return tuple(unflatten(v, tensors, remote) for v in skeleton[TUPLE])
    if ITEMS in skeleton:
        return {unflatten(k, tensors): unflatten(v, tensors, remote) for k, v in skeleton[ITEMS]}
    if DTYPE in skeleton:
        return dtype_from_name(skeleton[DTYPE])  # the known dtypes only, never getattr(torch, ...)
    if DTENSOR in skeleton:
        meta = skeleton[DTENSOR]
        return Sharded.of(meta, unflatten(meta["local"], tensors))
    return {k: unflatten(v, tensors, remote) for k, v in skeleton.items()}


def tensor_keys(skeleton: Any) -> Iterator[str]:
    """Every tensor key a skeleton refers to, in order."""
    if isinstance(skeleton, list):
        for v in skeleton:
            yield from tensor_keys(v)
    elif isinstance(skeleton, dict):
        for tag in (TENSOR, NDARRAY):
            if tag in skeleton:
                yield skeleton[tag]
                return
        for v in skeleton.values():
            yield from tensor_keys(v)


def tagged(skeleton: Any, tag: str) -> Iterator[Any]:
    """The value of every node of a (checked) skeleton tagged `tag`, not looking inside them."""
    stack = [skeleton]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict) and tag in node:
            yield node[tag]
        elif isinstance(node, dict):
            stack.extend(node.values())


def shards_of(skeleton: Any, specs: dict[str, dict]) -> Iterator[Sharded]:
    """Every sharded tensor a (checked) skeleton holds, its shard on the meta device (no bytes):
    what `verify` checks across ranks without reading data."""
    for meta in tagged(skeleton, DTENSOR):
        spec = specs[meta["local"][TENSOR]]
        yield Sharded.of(meta, torch.empty(spec["shape"], dtype=dtype_from_name(spec["dtype"]), device="meta"))
