"""Rolling optimizer state forward by re-applying recorded gradients (differential checkpoints).

Exactness (DESIGN invariant 1) rests on replaying exactly the gradient the optimizer consumed,
with exactly the hyper-parameters of that step, in order, through the same optimizer class.
A recorded gradient is a dense tensor, None (the parameter had no gradient), or a sparse
{"idx", "val"} pair (top-k compression) that is rebuilt exactly as training built it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

SPARSE = "sparse"


def densify(idx: torch.Tensor, val: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The dense gradient a sparse (indices, values) pair stands for: zeros, then scatter."""
    out = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
    out[idx.to(device=like.device, dtype=torch.long)] = val.to(device=like.device, dtype=like.dtype)
    return out.view_as(like)


def decode_grad(recorded: Any, param: torch.Tensor) -> torch.Tensor | None:
    if recorded is None:
        return None
    if isinstance(recorded, dict):
        return densify(recorded["idx"], recorded["val"], param)
    return recorded.to(device=param.device, dtype=param.dtype)


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def apply_diff(optimizer: torch.optim.Optimizer, diff: dict) -> None:
    """One recorded step: its hyper-parameters, its gradients, then optimizer.step()."""
    for group, hp in zip(optimizer.param_groups, diff["groups"], strict=True):
        group.update(hp)
    params = optimizer_params(optimizer)
    for p, g in zip(params, diff["grads"], strict=True):
        p.grad = decode_grad(g, p)
    with torch.no_grad():
        optimizer.step()
    for p in params:
        p.grad = None


def replay(optimizer: torch.optim.Optimizer, diffs: Iterable[dict]) -> dict | None:
    """Apply every diff in order; returns the last one (its post-step state finishes the restore)."""
    last = None
    for diff in diffs:
        apply_diff(optimizer, diff)
        last = diff
    return last
