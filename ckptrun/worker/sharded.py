"""Sharded state (DTensor: FSDP2, tensor parallel) on the worker: back into DTensors on resume.

A checkpoint holds a DTensor as the rank's shard plus where it lies (storage/sharding.py); a
resumed worker reads it as a `Sharded`. Here it becomes a DTensor again, on the live mesh of
the parameter it belongs to: the saved shard itself when the mesh, coordinate and placements
are the saved ones (resume at the same world size: bit-exact), or this rank's slice of the full
tensor when restore assembled one (resume at another world size: resharded).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointMismatch
from ..storage.sharding import Sharded, placement_names, shard_of
from ..storage.tree import dtensor_type


def is_dtensor(t: Any) -> bool:
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def _placements(names: tuple[str, ...]) -> list:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if n == "R" else Shard(int(n[1:])) for n in names]


def to_dtensor(value: Sharded, like: Any, placements: tuple[str, ...], stride: tuple[int, ...], where: str) -> Any:
    """`value` as a DTensor laid out by `placements` on the mesh of the live DTensor `like`
    (this rank's part, on the device of `like`'s)."""
    from torch.distributed.tensor import DTensor

    mesh = like.device_mesh
    shape, coord = tuple(mesh.shape), tuple(mesh.get_coordinate())
    if value.full is not None:
        local = shard_of(value.full, shape, coord, placements)
    elif (value.mesh, value.coord, value.placements) == (shape, coord, placements):
        local = value.local
    else:
        raise CheckpointMismatch(
            f"{where} was saved on mesh {list(value.mesh)} at coordinate {list(value.coord)} as "
            f"{list(value.placements)}; this rank has mesh {list(shape)}, coordinate {list(coord)}, "
            f"{list(placements)}: launch it as it was saved, or export it with `ckptrun restore`")
    return DTensor.from_local(local.to(like.to_local().device), mesh, _placements(placements), run_check=False,
                              shape=torch.Size(value.shape), stride=stride)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, n = [], 1
    for size in reversed(shape):
        stride.append(n)
        n *= max(size, 1)
    return tuple(reversed(stride))


def model_state(saved: dict, live: dict[str, Any]) -> dict:
    """A model's saved state_dict with each sharded entry made a DTensor like the live one."""
    out = dict(saved)
    for key, value in saved.items():
        if not isinstance(value, Sharded):
            continue
        target = live.get(key)
        if not is_dtensor(target):
            raise CheckpointMismatch(f"model entry {key!r} is sharded in the checkpoint, not in this run")
        out[key] = to_dtensor(value, target, tuple(placement_names(target.placements)),
                              target.stride(), f"model entry {key!r}")
    return out


def optimizer_state(saved: dict, params: list[torch.Tensor]) -> dict:
    """An optimizer's saved state_dict with each sharded state tensor made a DTensor on the mesh of
    its parameter (`params`: the optimizer's parameters in state_dict order), laid out as saved."""
    state = {}
    for i, entry in saved.get("state", {}).items():
        param = params[int(i)] if 0 <= int(i) < len(params) else None
        state[i] = dict(entry)
        for name, value in entry.items():
            if not isinstance(value, Sharded):
                continue
            if not is_dtensor(param) or param.device_mesh.ndim != len(value.placements):
                raise CheckpointMismatch(f"optimizer state {name!r} of parameter {i} is sharded in the checkpoint "
                                         "over another mesh than its parameter in this run")
            state[i][name] = to_dtensor(value, param, value.placements, _contiguous(value.shape),
                                        f"optimizer state {name!r} of parameter {i}")
    return {**saved, "state": state}
