"""Every monkey-patch ckptrun makes, in one place.

Constructors of optimizers, LR schedulers and GradScalers are wrapped so that the runtime
learns of each object the moment it exists, and restores its checkpointed state right then
("restored when constructed"). The wrapper fires once, after the most-derived __init__ returns.
In multi-rank runs the `env://` rendezvous is wrapped so that each restart attempt's process
group uses its own keys in torchrun's job-wide store. `torch.autograd.backward` is wrapped until
an optimizer exists, to stop a script that trains without one within its first steps. Gradient
clipping (`torch.nn.utils.clip_grad_norm_`) and GradScaler's unscaling go through the strategy,
which learns the one coefficient every gradient is multiplied by (lowdiff+ then need not copy
them again).
Framework integrations (ckptrun/worker/integrations/) hook in when the script imports the framework.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from ..log import log
from . import integrations

_MARK = "_ckptrun_wrapped"
BACKWARDS_WITHOUT_OPTIMIZER = 10  # a few, for scripts that run a backward pass or two before making it


def _subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


def _wrap_init(cls: type, callback: Callable[[Any], None]) -> None:
    orig = cls.__dict__.get("__init__")
    if orig is None or getattr(orig, _MARK, False):
        return

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        if type(self).__init__ is __init__:
            callback(self)

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__


def _patch_family(base: type, callback: Callable[[Any], None]) -> None:
    """Wrap `base` and all its subclasses, including ones defined later by the script."""
    for cls in _subclasses(base):
        _wrap_init(cls, callback)
    parent_hook = base.__dict__.get("__init_subclass__")

    def __init_subclass__(cls, **kwargs):
        if parent_hook is not None:
            parent_hook.__func__(cls, **kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)
        _wrap_init(cls, callback)

    base.__init_subclass__ = classmethod(__init_subclass__)


def _isolate_attempt(attempt: str) -> None:
    """Scope the script's `env://` process-group keys to this restart attempt.

    torchrun's agent keeps one TCPStore for the whole job, and a process group's keys (a gloo
    peer's address, an NCCL id) do not name the attempt: a restarted worker can read a dead
    peer's address from the previous attempt and fail to connect (pytorch/pytorch#135712).
    `attempt`: jobstore.attempt's name of it, the same on every node.
    """
    import torch.distributed as dist

    rdzv = importlib.import_module("torch.distributed.rendezvous")  # `dist.rendezvous` is a function
    env_handler = rdzv._rendezvous_handlers["env"]

    def handler(url: str, **kwargs: Any):
        for store, rank, world_size in env_handler(url, **kwargs):
            yield dist.PrefixStore(f"ckptrun/attempt-{attempt}", store), rank, world_size

    rdzv._rendezvous_handlers["env"] = handler


def _watch_backward(rt: Any) -> None:
    """Count backward passes (`Tensor.backward` calls `torch.autograd.backward`) while no optimizer
    is registered; stop the script at the next one after BACKWARDS_WITHOUT_OPTIMIZER of them. The
    wrapper takes itself out at the first backward pass after an optimizer exists."""
    from ..errors import AbortRun, no_optimizer

    orig = torch.autograd.backward
    seen = 0

    @functools.wraps(orig)
    def backward(*args: Any, **kwargs: Any):
        nonlocal seen
        if rt.state.optimizers:
            if torch.autograd.backward is backward:
                torch.autograd.backward = orig
        elif seen >= BACKWARDS_WITHOUT_OPTIMIZER:
            raise AbortRun(no_optimizer(f"the script ran {seen} backward passes without creating a "
                                        "torch.optim optimizer"))
        seen += 1
        return orig(*args, **kwargs)

    torch.autograd.backward = backward


def _route_clipping(strategy: Any) -> None:
    """`clip_grad_norm_` multiplies every gradient in place by min(max_norm / (total_norm + 1e-6),
    1), a GradScaler's unscaling by 1/scale (and moves no version counter): both run inside the
    strategy's `on_grad_scale(params, coefficient, scale)`, the coefficient computed exactly as
    torch computes it."""
    from torch.nn.utils import clip_grad

    def clipping(orig: Callable) -> Callable:
        def scale_by_norm(parameters: Any, max_norm: float, total_norm: torch.Tensor, foreach: Any = None) -> None:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            coefficient = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
            strategy.on_grad_scale(params, coefficient, lambda: orig(params, max_norm, total_norm, foreach))

        return scale_by_norm

    def unscaling(orig: Callable) -> Callable:
        def unscale_grads(scaler: Any, optimizer: Any, inv_scale: torch.Tensor, *args: Any, **kwargs: Any):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            found: list[Any] = []
            strategy.on_grad_scale(params, inv_scale, lambda: found.append(orig(scaler, optimizer, inv_scale, *args,
                                                                                **kwargs)))
            return found[0]

        return unscale_grads

    _replace_once(clip_grad, "_clip_grads_with_norm_", clipping)
    _replace_once(torch.amp.GradScaler, "_unscale_grads_", unscaling)


def _watch_skipped_steps(rt: Any) -> None:
    """A GradScaler that finds inf/NaN gradients skips the optimizer's step: the runtime hears of
    it (`skipped_step`), since no optimizer hook fires."""

    def watched(orig: Callable) -> Callable:
        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            before = rt.step
            out = orig(scaler, optimizer, *args, **kwargs)
            if optimizer is rt.state.primary and rt.step == before and scaler.is_enabled():
                rt.skipped_step()
            return out

        return step

    _replace_once(torch.amp.GradScaler, "step", watched)


def _watch_added_groups(rt: Any) -> None:
    """A param group added to a registered optimizer (`add_param_group` after its constructor:
    a layer unfrozen mid-run) is not checkpointed as the script would need: the modules owning
    its parameters were discovered when the optimizer was made, and a resume loads the state
    into an optimizer made without it. Said once, with the fix."""
    told = False

    def watched(orig: Callable) -> Callable:
        def add_param_group(opt: Any, group: dict) -> Any:
            nonlocal told
            out = orig(opt, group)
            if not told and opt in rt.state.optimizers and rt.rank == 0:
                told = True
                log.warning(f"warning: the script added a param group to its {type(opt).__name__} after making "
                            "it: ckptrun does not resume a group added mid-run (a resume after this step fails: "
                            "the optimizer is made without it); give the optimizer every group when it is made "
                            "(lr 0, or requires_grad False, until the layer is unfrozen)")
            return out

        return add_param_group

    _replace_once(torch.optim.Optimizer, "add_param_group", watched)


def _replace_once(owner: Any, name: str, wrapper: Callable[[Callable], Callable]) -> None:
    """Set `owner.name` to `wrapper(original)` (its name and docstring kept), unless ckptrun did
    already (a second install in one process)."""
    orig = getattr(owner, name)
    if getattr(orig, _MARK, False):
        return
    new = functools.wraps(orig)(wrapper(orig))
    setattr(new, _MARK, True)
    setattr(owner, name, new)


def install(rt: Any) -> None:
    if rt.world_size > 1 and torch.distributed.is_available():
        from .jobstore import attempt

        _isolate_attempt(attempt(rt.restart_count))
    _patch_family(torch.optim.Optimizer, rt.on_optimizer)
    _watch_added_groups(rt)
    _watch_backward(rt)
    _patch_family(torch.optim.lr_scheduler.LRScheduler, rt.on_scheduler)
    if not issubclass(torch.optim.lr_scheduler.ReduceLROnPlateau, torch.optim.lr_scheduler.LRScheduler):
        _patch_family(torch.optim.lr_scheduler.ReduceLROnPlateau, rt.on_scheduler)
    _patch_family(torch.amp.GradScaler, rt.on_scaler)
    _watch_skipped_steps(rt)
    _patch_family(torch.nn.parallel.DistributedDataParallel, rt.on_ddp)
    _route_clipping(rt)  # (its on_grad_scale: the strategy's, once it has started)
    integrations.install(rt)
