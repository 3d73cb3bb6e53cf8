"""Split nested state (state_dicts, RNG states) into a JSON skeleton and a list of tensors.

Checkpoints must load without unpickling (DESIGN invariant 4): every tensor goes to raw
bytes, and everything else must be a JSON-representable value. Tuples, non-string dict keys
and numpy arrays are tagged so that the structure round-trips exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

TENSOR = "__tensor__"
TUPLE = "__tuple__"
ITEMS = "__items__"
NDARRAY = "__ndarray__"
FLOAT = "__float__"


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


def _flatten(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
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
        return {"__dtype__": str(obj).removeprefix("torch.")}
    raise TypeError(
        f"cannot checkpoint a {type(obj).__name__} at {path!r}: state must be tensors, numbers, "
        "strings, lists, tuples and dicts (give the object a state_dict() returning those)"
    )


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `flatten`: rebuild the nested state, taking tensors from `tensors`."""
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if TENSOR in skeleton:
        return tensors[skeleton[TENSOR]]
    if NDARRAY in skeleton:
        return tensors[skeleton[NDARRAY]].numpy()
    if FLOAT in skeleton:
        return float(skeleton[FLOAT])
    if TUPLE in skeleton:
        return tuple(unflatten(v, tensors) for v in skeleton[TUPLE])
    if ITEMS in skeleton:
        return {unflatten(k, tensors): unflatten(v, tensors) for k, v in skeleton[ITEMS]}
    if "__dtype__" in skeleton:
        return getattr(torch, skeleton["__dtype__"])
    return {k: unflatten(v, tensors) for k, v in skeleton.items()}


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
