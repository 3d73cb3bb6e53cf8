"""How big the first snapshot will be, judged when the optimizer is made: its staging slots are
made then, in the background (slots.py `Staging.prepare`), not by the first checkpoint.

The models' tensors are known then; the optimizer's state mostly is not (torch's optimizers make
it in their first step), so it is predicted from the optimizer's kind: a state it already holds
(resumed, or made at construction as Adagrad's) counts as it is. A wrong guess costs only what
it saved: slots too small are grown by the first checkpoint, as without a guess.
"""

from __future__ import annotations

import torch

from ..storage.layout import ALIGN, Layout, align
from ..storage.tree import flatten
from .state import TrainingState

# What each optimizer's first step adds to its state per parameter, by class name (torch.optim's):
# (tensors shaped like the parameter, scalar tensors); SGD's and RMSprop's depend on their group's
# settings (`per_param`). A class named nowhere in its ancestry is taken as Adam-like: the common case.
PER_PARAM = {"Adam": (2, 1), "AdamW": (2, 1), "NAdam": (2, 2), "RAdam": (2, 1), "Adamax": (2, 1),
             "Adadelta": (2, 1), "Rprop": (2, 1), "SparseAdam": (2, 1), "Adagrad": (1, 1), "ASGD": (1, 3),
             "Adafactor": (0, 1), "LBFGS": (0, 0)}
ADAM_LIKE = (2, 1)


def per_param(opt: torch.optim.Optimizer, group: dict) -> tuple[int, int]:
    """(parameter-sized tensors, scalar tensors) `opt` keeps per parameter of `group`."""
    for cls in type(opt).__mro__:
        if cls.__name__ == "SGD":
            return (1 if group.get("momentum") else 0), 0
        if cls.__name__ == "RMSprop":
            return 1 + bool(group.get("momentum")) + bool(group.get("centered")), 1
        if cls.__name__ in PER_PARAM:
            return PER_PARAM[cls.__name__]
    return ADAM_LIKE


def first_snapshot_bytes(state: TrainingState, opt: torch.optim.Optimizer) -> int:
    """The bytes of this rank's full snapshot once `opt` has stepped: what it writes of the state
    known now (replicated tensors another rank writes left out), and the optimizer state still
    to come for the parameters it writes."""
    _, tensors = state.write_once(*flatten(state.early_state()))
    written = {t.data_ptr() for t in tensors.values()}
    more = 0
    for group in opt.param_groups:
        tensors_per, scalars_per = per_param(opt, group)
        for p in group["params"]:
            if p.data_ptr() in written and not opt.state.get(p):
                more += tensors_per * align(p.numel() * p.element_size()) + scalars_per * ALIGN
    return Layout.of(tensors).nbytes + more


def cuda_device(params: list[torch.Tensor]) -> int | None:
    """The CUDA device the optimizer's parameters are on (the slots are page-locked for it), or
    None (on the CPU)."""
    return next((p.device.index for p in params if p.is_cuda), None)
