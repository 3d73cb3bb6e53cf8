"""Per-layer update points for an unmodified `torch.optim` optimizer.

`optimizer.step()` updates every parameter in one call, so there is no point between layers
at which to wait. `LayerSteps` makes one: it runs the optimizer's own step function (the class's,
without the step hooks) over part of its parameters at a time, by narrowing each param group's
"params" list for the call; the real `step()` that follows finds no gradients (they are set
aside until its post-hook) and updates nothing. For optimizers whose update of a parameter reads
only that parameter's gradient and state (`ckptrun.restore.replay.ELEMENTWISE`) every call computes exactly what the
whole step would (tests/test_lightcheck.py checks it bit for bit, foreach on and off). Anything
else (another class, fused steps taking AMP arguments, extra step hooks) keeps the whole step
and waits for the whole copy first (`why_not`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim import optimizer as optim_mod

from ...restore.replay import not_elementwise


def why_not(opt: torch.optim.Optimizer) -> str | None:
    """Why `opt`'s step cannot be split by layer (None: it can)."""
    if (why := not_elementwise(opt)) is not None:
        return why
    if not getattr(type(opt).step, "hooked", False) or not hasattr(type(opt).step, "__wrapped__"):
        return "its step function is not torch's hooked one"
    if getattr(opt, "_step_supports_amp_scaling", False):
        return "its fused step takes the AMP scaler's arguments"
    hooks = [*opt._optimizer_step_pre_hooks.values(), *opt._optimizer_step_post_hooks.values(),
             *optim_mod._global_optimizer_pre_hooks.values(), *optim_mod._global_optimizer_post_hooks.values()]
    if any(not getattr(h, "__module__", "").startswith("ckptrun.") for h in hooks):
        return "optimizer step hooks other than ckptrun's are registered (they expect one update)"
    if any(p.grad is not None and p.grad.is_sparse for g in opt.param_groups for p in g["params"]):
        return "it has sparse gradients"
    return None


class LayerSteps:
    """One optimizer step as calls over consecutive parameters ("layers", in param_groups order).

    Call order per step: `run(ready)` in the optimizer's pre-step hook (updates every layer as
    `ready` allows and sets the gradients aside), then the real step (updates nothing), then
    `restore()` in its post-step hook.
    """

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        self._inner = type(opt).step.__wrapped__  # the step without the hooks (torch's profile_hook_step)
        self._aside: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for g in self.opt.param_groups for p in g["params"]]

    def run(self, ready: Callable[[int], int]) -> int:
        """Update layers [i, ready(i)) for i = 0, ... : `ready(i)` blocks until layer i may be
        updated and returns how many leading layers may. Returns how many calls it took."""
        params = self.params
        calls, i = 0, 0
        while i < len(params):
            j = ready(i)
            self._step_part(params[i:j])
            calls, i = calls + 1, j
        self._aside = [(p, p.grad) for p in params]
        for p in params:
            p.grad = None
        return calls

    def restore(self) -> None:
        for p, g in self._aside:
            p.grad = g
        self._aside = []

    def _step_part(self, part: list[torch.Tensor]) -> None:
        ids = {id(p) for p in part}
        groups = self.opt.param_groups
        full = [g["params"] for g in groups]
        try:
            for g, params in zip(groups, full, strict=True):
                g["params"] = [p for p in params if id(p) in ids]
            self._inner(self.opt)
        finally:
            for g, params in zip(groups, full, strict=True):
                g["params"] = params
