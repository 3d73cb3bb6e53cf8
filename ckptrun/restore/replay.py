"""Rolling optimizer state forward by re-applying recorded gradients (differential checkpoints).

Exactness (DESIGN invariant 1) rests on replaying exactly the gradient the optimizer consumed,
with exactly the hyper-parameters of that step, in order, through the same optimizer class.
A recorded gradient is a dense tensor, None (the parameter had no gradient), or a sparse
{"idx", "val"} pair (top-k compression) that is rebuilt exactly as training built it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

from ..log import log

SPARSE = "sparse"


def densify(idx: torch.Tensor, val: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The dense gradient a sparse (indices, values) pair stands for: zeros, then scatter. A pair
    training cannot have recorded is refused: indexing would wrap a negative index, truncate a
    float one and broadcast a single value."""
    if idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1 or val.shape != idx.shape:
        raise ValueError(f"sparse gradient: {idx.dtype} indices of shape {tuple(idx.shape)} for values of shape "
                         f"{tuple(val.shape)}; expected as many int32/int64 indices as values")
    if idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < like.numel()):
        raise ValueError(f"sparse gradient: indices outside a parameter of {like.numel()} elements")
    out = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
    out[idx.to(device=like.device, dtype=torch.long)] = val.to(device=like.device, dtype=like.dtype)
    return out.view_as(like)


def decode_grad(recorded: Any, param: torch.Tensor) -> torch.Tensor | None:
    """A recorded gradient as `param`'s dense gradient; ValueError where it does not fit `param`."""
    if recorded is None:
        return None
    if isinstance(recorded, dict):
        return densify(recorded["idx"], recorded["val"], param)
    if recorded.shape != param.shape:
        raise ValueError(f"recorded gradient of shape {tuple(recorded.shape)} for a parameter of shape "
                         f"{tuple(param.shape)}")
    return recorded.to(device=param.device, dtype=param.dtype)


# torch.optim's optimizers whose update of a parameter reads only that parameter's gradient and state,
# element by element: any part of a parameter can be stepped on its own (lightcheck's layer-wise
# update, gockpt's roll-forward of parameter blocks) and give the whole step's values.
ELEMENTWISE = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD"))


def not_elementwise(opt: torch.optim.Optimizer) -> str | None:
    """Why `opt`'s update cannot be run on parts of its parameters (None: it can)."""
    if type(opt) not in ELEMENTWISE:
        return f"{type(opt).__name__} is not one of torch.optim's per-parameter optimizers"
    return None


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def apply_diff(optimizer: torch.optim.Optimizer, diff: dict) -> None:
    """One recorded step: its hyper-parameters, its gradients, then optimizer.step(). A diff that
    does not fit the optimizer is refused (ValueError) before anything changes."""
    params = optimizer_params(optimizer)
    if len(diff["groups"]) != len(optimizer.param_groups) or len(diff["grads"]) != len(params):
        raise ValueError(f"diff of {len(diff['grads'])} gradients in {len(diff['groups'])} groups for an optimizer "
                         f"of {len(params)} parameters in {len(optimizer.param_groups)}")
    grads = [decode_grad(g, p) for p, g in zip(params, diff["grads"], strict=True)]
    for group, hp in zip(optimizer.param_groups, diff["groups"], strict=True):
        group.update(hp)
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    with torch.no_grad():
        optimizer.step()
    for p in params:
        p.grad = None


def replay_device(trained_on: str | None) -> torch.device:
    """Where offline replay steps the optimizer: on the device type the run trained on
    (`trained_on`, from its index), whose arithmetic it repeats bit for bit; on the CPU where
    this machine has none of that type. A GPU's kernels round differently from the CPU's, so
    that replay may differ from the run by rounding: said once per process."""
    if trained_on is None or trained_on == "cpu":
        return torch.device("cpu")
    here = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if here is not None and here.type == trained_on:
        return torch.device(trained_on)
    if trained_on not in _said_cpu:
        _said_cpu.add(trained_on)
        log.warning(f"warning: the run trained on {trained_on}, which this machine lacks; its recorded steps "
                    "are replayed on the CPU and may differ from the run's by rounding (restore where "
                    f"{trained_on} is, for the run's own bits)")
    return torch.device("cpu")


_said_cpu: set[str] = set()


def cpu_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` with its state tensors on the CPU (a replay on a GPU): what a
    read record holds."""
    saved = optimizer.state_dict()
    saved["state"] = {i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for i, s in saved["state"].items()}
    return saved


def replay(optimizer: torch.optim.Optimizer, diffs: Iterable[dict]) -> dict | None:
    """Apply every diff in order; returns the last one (its post-step state finishes the restore)."""
    last = None
    for diff in diffs:
        apply_diff(optimizer, diff)
        last = diff
    return last


def warm_up_in_background() -> None:
    """A process's first optimizer imports `torch._dynamo` and initialises much of torch (1.4 s
    of CPU here). An engine that steps optimizers mid-run (lowdiff+'s replica, gockpt's cohorts)
    pays it at its start, on a thread of its own, while the trainer starts: paid at the first
    message instead, it stalled gockpt's trainer 1.3 s at its first spread (the worker waited
    for an answer behind it). Once per process."""
    global _warming
    with _warm_lock:
        if _warming:
            return
        _warming = True
    threading.Thread(target=_warm_up, name="ckptrun-optimizer-warmup", daemon=True).start()


_warm_lock = threading.Lock()
_warming = False


def _warm_up() -> None:
    """Best effort: an engine told to stop while this runs (the worker refused the script at once)
    is shutting its interpreter down under the import; only the time it would save is lost."""
    try:
        p = torch.zeros(1, requires_grad=True)
        p.grad = torch.zeros(1)
        torch.optim.AdamW([p]).step()
    except Exception:  # the warm-up changes no state that anything reads
        return
