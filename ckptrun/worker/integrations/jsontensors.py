"""Framework state that is JSON except for a few tensors (a callback's best score, an RNG state),
as JSON: a loop position is tracked as JSON (`LoopPosition`), and a checkpoint directory is
untrusted input, so decoding checks the dtype it names and imports nothing."""

from __future__ import annotations

import base64
from typing import Any

import torch

from ...errors import CheckpointMismatch
from ...storage.layout import dtype_from_name, dtype_name

_TENSOR = "__tensor__"


def to_json(obj: Any) -> Any:
    """`obj` with every tensor as {"__tensor__": base64 bytes, "dtype", "shape"}; a new structure
    (nothing shared with `obj`). Raises TypeError on anything else that JSON cannot hold."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {_TENSOR: base64.b64encode(raw).decode(), "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"a dict with non-string keys ({[k for k in obj if not isinstance(k, str)][:3]})")
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return obj
    raise TypeError(f"a value of type {type(obj).__name__}")


def from_json(obj: Any) -> Any:
    """Inverse of `to_json` (tuples come back as lists)."""
    if isinstance(obj, dict):
        return _tensor(obj) if _TENSOR in obj else {k: from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    return obj


def _tensor(spec: dict) -> torch.Tensor:
    try:
        dtype = dtype_from_name(str(spec.get("dtype")))
    except ValueError:
        raise CheckpointMismatch(f"a saved tensor names an unknown dtype {spec.get('dtype')!r}") from None
    raw = bytearray(base64.b64decode(spec[_TENSOR], validate=True))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(spec["shape"])
