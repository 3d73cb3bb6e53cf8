"""`ckptrun restore`: one committed step of one rank as a single self-contained file.

Sharded tensors (DTensor: FSDP2, tensor parallel) are written whole, assembled from every rank's
shards; the rest (RNG, unsharded state) is the chosen rank's.

`torch` format: `torch.load(FILE, weights_only=True)` gives {"step", "model", "optimizer",
"schedulers", "scaler", "rng", "extra"} where "model" is exactly the script's
`model.state_dict()` and "optimizer" has the structure of `optimizer.state_dict()` (further
models/optimizers, if any, sit in "extra" under their names). `safetensors` format: every
tensor under its path, and the rest of the structure as JSON in the metadata.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import CkptrunError
from ..storage.sharding import as_full
from ..storage.store import Store
from ..storage.tree import flatten
from .consolidate import consolidate
from .recovery import Plan, find, load_state, optimizer_classes, plans


def _weights_only_safe(obj: Any) -> Any:
    """numpy arrays (numpy's RNG state) become tensors: weights_only loading rejects ndarrays."""
    import torch

    if type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray":
        return torch.from_numpy(obj.copy())
    if isinstance(obj, dict):
        return {k: _weights_only_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_weights_only_safe(v) for v in obj)
    return obj


def _unshared(tensors: dict) -> dict:
    """Contiguous tensors, each with its own storage: safetensors refuses shared ones, and
    replay gives tied parameters (one tensor under two names) a single tensor."""
    seen: set[int] = set()
    out = {}
    for key, t in tensors.items():
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[key] = t.clone() if ptr in seen and t.numel() else t
        seen.add(ptr)
    return out


def as_torch_dict(state: dict, step: int) -> dict[str, Any]:
    models, optimizers = dict(state["models"]), dict(state["optimizers"])
    extra = dict(state.get("extra", {}))
    extra.update({k: v for k, v in models.items() if k != "model"})
    extra.update({k: v for k, v in optimizers.items() if k != "optimizer"})
    scalers = state.get("scalers", [])
    return {"step": step, "model": models.get("model", {}), "optimizer": optimizers.get("optimizer", {}),
            "schedulers": state.get("schedulers", []), "scaler": scalers[0] if scalers else None,
            "rng": _weights_only_safe(state.get("rng", {})), "extra": extra}


def export(directory: Path | Store, step: int | str, out: Path, fmt: str, rank: int = 0,
           trusted_optimizers: list[str] | None = None) -> Plan:
    """Write one committed step of one rank of `directory` (a path, or the Store a reading
    command opened) to `out`; `trusted_optimizers` (pkg.mod:Class) may be constructed for
    offline replay besides torch.optim's classes."""
    store = directory if isinstance(directory, Store) else Store.existing(directory)
    classes = optimizer_classes(trusted_optimizers or [])
    newest = plans(store).get(max(plans(store), default=-1) if step == "latest" else int(step))
    if newest is not None and not 0 <= rank < newest.base.world_size:
        raise CkptrunError(f"--rank {rank}: step {newest.step} has ranks 0..{newest.base.world_size - 1}", exit_code=2)
    plan = find(store, step, classes, rank)
    state = as_full(consolidate(store, plan.base, load_state(store, plan, rank, classes)))
    full = as_torch_dict(state, plan.step)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if fmt == "torch":
            import torch

            torch.save(full, tmp)
        else:
            from safetensors.torch import save_file

            skeleton, tensors = flatten(full)
            save_file(_unshared(tensors), str(tmp),
                      metadata={"ckptrun.skeleton": json.dumps(skeleton), "ckptrun.step": str(plan.step)})
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return plan
