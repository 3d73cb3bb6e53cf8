"""Find what a script's training state is made of, without the script telling us.

Models are the top-level nn.Modules that own an optimizer's parameters (found once, when the
optimizer is created). RNG states cover python, numpy (if imported), torch CPU and CUDA.
"""

from __future__ import annotations

import gc
import random
import sys
import warnings
import weakref
from typing import Any

import torch
from torch import nn

_WRAPPER_ATTRS = ("module", "_orig_mod")
# A weakref.proxy passes isinstance() for what it refers to, and raises ReferenceError once that
# is gone (torch.compile leaves such proxies behind): never a module of its own.
_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)


def unwrap(module: nn.Module) -> nn.Module:
    """The user's model inside DDP / torch.compile wrappers, whose keys it saves itself."""
    while True:
        inner = next((getattr(module, a) for a in _WRAPPER_ATTRS
                      if isinstance(getattr(module, a, None), nn.Module)
                      and type(module).__name__ in ("DistributedDataParallel", "OptimizedModule",
                                                     "DataParallel")), None)
        if inner is None:
            return module
        module = inner


def owning_modules(optimizer: torch.optim.Optimizer) -> list[nn.Module]:
    """Top-level modules holding `optimizer`'s parameters, ordered by their first parameter."""
    order = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    holders: dict[int, nn.Module] = {}
    with warnings.catch_warnings():  # isinstance() on deprecated lazy module attributes warns
        warnings.simplefilter("ignore")
        modules = [obj for obj in gc.get_objects() if type(obj) not in _PROXIES and isinstance(obj, nn.Module)]
    for obj in modules:
        m = unwrap(obj)
        if any(id(p) in order for p in m.parameters()):
            holders[id(m)] = m
    descendants = {id(c) for r in holders.values() for c in r.modules() if c is not r}
    roots = [r for r in holders.values() if id(r) not in descendants]
    return sorted(roots, key=lambda r: min(order.get(id(p), len(order)) for p in r.parameters()))


def orphan_params(optimizer: torch.optim.Optimizer, models: list[nn.Module]) -> dict[int, torch.Tensor]:
    """Parameters the optimizer updates that no discovered module owns, by optimizer index."""
    owned = {id(p) for m in models for p in m.parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {i: p for i, p in enumerate(params) if id(p) not in owned}


class OrphanParams:
    """Checkpoints free-standing optimized tensors (no module owns them), restored in place."""

    def __init__(self, params: dict[int, torch.Tensor]) -> None:
        self.params = params

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {str(i): p.detach() for i, p in self.params.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for i, p in self.params.items():
                p.copy_(state[str(i)])


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def module_buffers(models: list[nn.Module]) -> set[int]:
    """data_ptrs of buffers: they change in the next forward, so they are copied at once."""
    return {b.data_ptr() for m in models for b in m.buffers()}
