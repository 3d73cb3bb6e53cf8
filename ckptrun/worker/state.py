"""What a worker saves: the objects a script trains (found, not declared) and the state of step t.

Runs at two moments. When an object is constructed (the patched constructors, `ckptrun.track`,
a DDP wrapper), it joins the registries here. After optimizer step t and at the seal, capture
(ckptrun/worker/capture.py) asks for the state of step t: `early_state` as right after the step
(parameters, optimizer state, buffers, RNG), `late_state` as after what the script updates after
the step (schedulers, scaler, tracked objects). Under DDP, `write_once` says which replicated
tensors another rank writes (storage/writeonce.py), or with `mark_shared` which ones every rank
holds alike (a partner's copy leaves them out: storage/tiers/dpshared.py).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..log import log
from ..restore import replay
from ..storage import writeonce
from ..storage.tree import orphans_key
from . import discovery

# In a checkpoint's tracked objects once a GradScaler has skipped a step: {"count": the steps it
# skipped before this one}. The script's loop resumes step t at its iteration t + count.
SKIPPED = "ckptrun.skipped_steps"


def skipped_steps(state: dict) -> int:
    """The count SKIPPED holds in a restored `state` (0 without it)."""
    held = state.get("extra", {}).get(SKIPPED)
    if held is None:
        return 0
    count = held.get("count") if isinstance(held, dict) else None
    if type(count) is not int or count < 0:
        raise ValueError(f"{SKIPPED} in the checkpoint's state is not a count of steps: {held!r}")
    return count


def indexed(base: str, i: int) -> str:
    """The name of the i-th optimizer (or such) in a checkpoint: `base`, `base_1`, ..."""
    return base if i == 0 else f"{base}_{i}"


def _ident(t: torch.Tensor) -> tuple:
    """What makes two tensors the same values in memory (a state_dict entry is its parameter detached)."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device


class TrainingState:
    """The registries of what is saved, and the state built from them. `write_once`: the
    strategy may leave replicated tensors to the rank that writes them (`Entry.write_once`).
    `mark_shared`: every rank writes them, and their keys go into the index (`shared_keys`)."""

    def __init__(self, rank: int, world_size: int, write_once: bool, mark_shared: bool = False) -> None:
        self.rank, self.world_size, self._write_once_ok = rank, world_size, write_once
        self._mark_shared = mark_shared
        self.optimizers: list[torch.optim.Optimizer] = []
        self.models: dict[str, torch.nn.Module] = {}
        self.replicated: list[torch.nn.parallel.DistributedDataParallel] = []  # (`_replicated_params`)
        self.schedulers: list[Any] = []
        self.scalers: list[Any] = []
        self.tracked: dict[str, Any] = {}
        self.optimizer_info: dict[str, dict] = {}
        self._generators: dict[str, torch.Tensor] = {}  # tracked Generators as of the last step
        self.volatile: set[int] = set()  # data_ptrs of module buffers: the next forward changes them
        self._buffer_keys: dict[str, list[str]] | None = None  # per model: its state_dict keys that are buffers
        self._lazy_ok: bool | None = None  # every such key names a module buffer (a lazy capture can take them)
        self.skipped = 0  # iterations whose optimizer step a GradScaler skipped (`skipped_step`)
        self._late_at_skip: dict | None = None  # the late state as the first skip since the last step found it

    @property
    def primary(self) -> torch.optim.Optimizer | None:
        return self.optimizers[0] if self.optimizers else None

    # ---- discovery ---------------------------------------------------------------------
    def alias(self, opt: torch.optim.Optimizer) -> bool:
        """Whether `opt` only delegates to optimizers already registered (accelerate's
        AcceleratedOptimizer, ZeRO-style wrappers: every parameter it updates is already another
        optimizer's): the same logical optimizer, whose state is stored once."""
        known = {id(p) for o in self.optimizers for p in replay.optimizer_params(o)}
        params = replay.optimizer_params(opt)
        return bool(known and params and all(id(p) in known for p in params))

    def add_optimizer(self, opt: torch.optim.Optimizer) -> int:
        """Register `opt` and the models owning its parameters; returns its index. Parameters no
        module owns are tracked as an object of their own (`track` them: returned by name)."""
        idx = len(self.optimizers)
        self.optimizers.append(opt)
        for m in discovery.owning_modules(opt):
            if all(m is not known for known in self.models.values()):
                self.models["model" if not self.models else f"model_{len(self.models)}"] = m
        self.volatile = discovery.module_buffers(list(self.models.values()))
        self._buffer_keys = self._lazy_ok = None
        self.optimizer_info[indexed("optimizer", idx)] = self._describe(opt)
        return idx

    def orphans(self, idx: int) -> tuple[str, discovery.OrphanParams] | None:
        """(name, object) for optimizer `idx`'s parameters that no discovered module owns, if any."""
        orphans = discovery.orphan_params(self.optimizers[idx], list(self.models.values()))
        return (orphans_key(indexed("optimizer", idx)), discovery.OrphanParams(orphans)) if orphans else None

    def _describe(self, opt: torch.optim.Optimizer) -> dict:
        """What offline replay needs: the optimizer class, each parameter's state_dict keys, and
        the device type its parameters live on (replay there is the run's own arithmetic)."""
        aliases: dict[int, list[list[str]]] = {}
        for name, m in self.models.items():
            for key, p in m.named_parameters(remove_duplicate=False):
                aliases.setdefault(id(p), []).append([name, key])
        cls = type(opt)
        params = replay.optimizer_params(opt)
        types = {p.device.type for p in params}
        return {"class": f"{cls.__module__}.{cls.__qualname__}", "params": [aliases.get(id(p), []) for p in params],
                **({"device": types.pop()} if len(types) == 1 else {})}

    def track(self, name: str, obj: Any) -> None:
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")) \
                and not isinstance(obj, torch.Generator):
            raise TypeError(f"ckptrun.track({name}=...): needs state_dict()/load_state_dict() "
                            f"or a torch.Generator, got {type(obj).__name__}")
        self.tracked[name] = obj

    def stepped(self) -> None:
        """Optimizer step t is done: tracked Generators are taken now, before the next batch draws."""
        self._generators = {n: o.get_state() for n, o in self.tracked.items() if isinstance(o, torch.Generator)}
        self._late_at_skip = None

    def skipped_step(self) -> None:
        """A GradScaler skipped the primary optimizer's step: the iteration ran, the parameters did
        not move. The state of step t is the top of the iteration after it, so its late state is
        taken now, before this iteration's scaler update and scheduler step (sealed at the next
        optimizer step, it would hold theirs); a resume starts the script's loop at t + skipped."""
        if self._late_at_skip is None:
            self._late_at_skip = copy.deepcopy(self.late_state())
        self.skipped += 1

    # ---- the state of step t -----------------------------------------------------------
    def early_state(self, taken: dict | None = None) -> dict:
        """Parameters, optimizer state, buffers and RNG; `taken`: buffers and RNG taken earlier
        (`volatile_now`), in place of the live ones."""
        models = {n: m.state_dict() for n, m in self.models.items()}
        if taken is not None:
            models = {n: {k: taken["buffers"][n].get(k, v) for k, v in sd.items()} for n, sd in models.items()}
        return {
            "models": models,
            "optimizers": {indexed("optimizer", i): o.state_dict() for i, o in enumerate(self.optimizers)},
            "rng": discovery.rng_state() if taken is None else taken["rng"],
        }

    def late_state(self) -> dict:
        """State the script updates after optimizer.step(): schedulers (and the lr they set in
        the optimizer's param_groups), scalers, tracked objects. A tracked Generator is an RNG
        state: it is taken as it was right after the step, before the next batch drew from it.
        After a skipped step, as that skip found it (`skipped_step`)."""
        if self._late_at_skip is not None:
            return self._late_at_skip
        extra = {n: (self._generators.get(n, o.get_state()) if isinstance(o, torch.Generator) else o.state_dict())
                 for n, o in self.tracked.items()}
        if self.skipped:  # (every skip so far came before the step this state is of)
            extra[SKIPPED] = {"count": self.skipped}
        return {
            "param_groups": {indexed("optimizer", i): o.state_dict()["param_groups"]
                             for i, o in enumerate(self.optimizers)},
            "schedulers": [s.state_dict() for s in self.schedulers],
            "scalers": [s.state_dict() for s in self.scalers],
            "extra": extra,
        }

    def post_step_state(self) -> dict:
        """What a replay of the step's gradients cannot rebuild: module buffers (changed by the
        forward) and RNG, as they are right after the step."""
        return {"buffers": {n: {k: v for k, v in self.models[n].state_dict().items() if k in keys}
                            for n, keys in self.buffer_keys().items()},
                "rng": discovery.rng_state()}

    def buffer_keys(self) -> dict[str, list[str]]:
        if self._buffer_keys is None:
            self._buffer_keys = {n: [k for k in m.state_dict() if k not in dict(m.named_parameters(
                remove_duplicate=False))] for n, m in self.models.items()}
        return self._buffer_keys

    def can_be_lazy(self) -> bool:
        """Whether every buffer in the models' state_dicts is a module buffer by its key (a module
        with extra state or state_dict hooks is captured the ordinary way)."""
        if self._lazy_ok is None:
            try:
                for n, keys in self.buffer_keys().items():
                    for k in keys:
                        self.models[n].get_buffer(k)
                self._lazy_ok = True
            except (AttributeError, TypeError):
                self._lazy_ok = False
                log.info("lazy capture off: a model's state_dict holds entries that are not module buffers")
        return self._lazy_ok

    def volatile_now(self) -> dict:
        """What the next forward changes: module buffers (copied now) and RNG."""
        with torch.no_grad():
            buffers = {n: {k: self.models[n].get_buffer(k).detach().clone() for k in keys}
                       for n, keys in self.buffer_keys().items()}
        return {"buffers": buffers, "rng": discovery.rng_state()}

    # ---- write once (DDP) --------------------------------------------------------------
    def write_once(self, skeleton: Any, tensors: dict[str, torch.Tensor],
                   rotate: int = 0) -> tuple[Any, dict[str, torch.Tensor]]:
        """Leave out the replicated tensors another rank writes (storage/writeonce.py), when the
        strategy supports it."""
        if not self._writes_once():
            return skeleton, tensors
        return writeonce.split(skeleton, tensors, self._replicated_keys(tensors), self.rank, self.world_size, rotate)

    def shared_keys(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """The keys of `tensors` that are replicated, with `mark_shared` (else none): a partner's
        copy of this rank's part leaves them out, since every data-parallel peer holds them."""
        if not (self._mark_shared and self.world_size > 1 and self.replicated):
            return []
        return self._replicated_keys(tensors)

    def _replicated_keys(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Replicated are exactly the parameters of DDP's modules, their gradients at the
        optimizer step (all-reduced by then) and the optimizer state tensors over them, found by
        storage (data_ptr, shape, dtype), not by name: anything else (buffers, which DDP syncs
        only in the next forward; RNG; tracked objects) is per rank."""
        params = self._replicated_params()
        same = {_ident(p) for p in params.values()} | {_ident(p.grad) for p in params.values() if p.grad is not None}
        for opt in self.optimizers:
            for p in replay.optimizer_params(opt):
                if params.get(p.data_ptr()) is p:
                    same |= {_ident(v) for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)}
        return [k for k, t in tensors.items() if _ident(t) in same]

    def _replicated_params(self) -> dict[int, torch.Tensor]:
        """The parameters DDP keeps identical on every rank, by data pointer: those of its
        wrappers' modules, less any it was told to ignore (`_ddp_params_and_buffers_to_ignore`),
        which each rank trains on its own."""
        return {p.data_ptr(): p for ddp in self.replicated for name, p in ddp.module.named_parameters()
                if name not in ddp.parameters_to_ignore}

    def _writes_once(self) -> bool:
        return self.world_size > 1 and bool(self.replicated) and self._write_once_ok

    def replicated_positions(self) -> list[int]:
        """Positions of the primary optimizer's parameters that DDP keeps identical on every rank,
        when replicated state is written once (else none)."""
        return self._ddp_positions() if self._writes_once() else []

    def shared_positions(self) -> list[int]:
        """The same positions when their tensors are named as shared instead (`shared_keys`)."""
        return self._ddp_positions() if self._mark_shared and self.world_size > 1 else []

    def _ddp_positions(self) -> list[int]:
        if self.primary is None or not self.replicated:
            return []
        params = self._replicated_params()
        return [i for i, p in enumerate(replay.optimizer_params(self.primary)) if params.get(p.data_ptr()) is p]
