"""Loading the resumed step into the script's objects, each as it is constructed.

Runs from the patched constructors (ckptrun/worker/patches.py) and `ckptrun.track`, between
the script's start and its first optimizer step: models and optimizer state when the first
optimizer exists (then the recorded steps are replayed through it, for the differential
strategies), schedulers, scalers and tracked objects when they are made. The state read comes
from the records on disk (ckptrun/restore/recovery.py, chosen in bootstrap) or from the engine's
memory (`fetch_held`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import AbortRun, CheckpointMismatch, CkptrunError, CorruptCheckpoint
from ..ipc.client import EngineClient
from ..ipc.messages import FetchHeld
from ..log import log
from ..restore import replay
from ..restore.recovery import finish_state
from ..storage.layout import TensorSpec, view
from ..storage.tree import unflatten
from . import discovery, sharded
from .state import TrainingState, indexed


@dataclass
class ResumeState:
    """What the worker restores, keyed like the live registries."""

    step: int
    record: str
    state: dict
    world_size: int
    diffs: Iterator[dict] | None = None  # recorded steps to replay after loading the base
    restored: set = field(default_factory=set)
    source: str = "disk"  # or "memory": the engine's copy (no disk read)


class Loader:
    """Loads `resume` (None: a fresh start, nothing is loaded) into the objects of `state` as
    they come. `replaying` is set while replay drives the optimizer (its steps are not training
    steps); `observe_replay(steps, seconds)` hears how long the replay took."""

    def __init__(self, state: TrainingState, ckpt_dir: str, observe_replay: Callable[[int, float], None]) -> None:
        self.state, self.dir, self._observe_replay = state, ckpt_dir, observe_replay
        self.resume: ResumeState | None = None
        self.restore_s = 0.0  # ckptrun's own restore: decide, read, validate, load, replay
        self.replaying = False

    def optimizer(self, opt: torch.optim.Optimizer, idx: int) -> None:
        """The optimizer `idx` was registered: load it (the first one: the models too, then replay)."""
        t0 = time.perf_counter()
        try:
            self._load_into(opt, idx)
        except CorruptCheckpoint as e:  # a record read for replay failed its checks: past the script's handlers
            raise AbortRun(e) from None
        finally:
            self.restore_s += time.perf_counter() - t0

    def _load_into(self, opt: torch.optim.Optimizer, idx: int) -> None:
        saved = self.resume.state
        for name, model in self.state.models.items():
            if name in self.resume.restored:
                continue
            if name not in saved["models"]:
                raise CheckpointMismatch(f"checkpoint {self.resume.record} has no {name!r}; "
                                         "use another --dir or --no-resume")
            self._load_model(name, model, saved["models"][name])
            self.resume.restored.add(name)
        oname = indexed("optimizer", idx)
        if oname in saved["optimizers"]:
            try:
                opt.load_state_dict(sharded.optimizer_state(saved["optimizers"][oname], replay.optimizer_params(opt)))
            except ValueError as e:  # torch's own check: another number or size of param groups
                raise CheckpointMismatch(f"checkpoint {self.resume.record} holds another {oname} ({e}): the script "
                                         "makes its optimizer otherwise than the run that saved it (param groups "
                                         "added after it was made are not resumed); pass a new --dir, or "
                                         "--no-resume after removing it") from None
        if idx != 0:
            return
        if self.resume.diffs is not None:
            self.replaying = True
            t0 = time.perf_counter()
            try:
                last = replay.replay(opt, self.resume.diffs)
            finally:
                self.replaying = False
            self._observe_replay(self.resume.step - int(self.resume.record.split("-")[-1]), time.perf_counter() - t0)
            for name, model in self.state.models.items():
                model.load_state_dict({**model.state_dict(), **last["buffers"].get(name, {})})
            saved = self.resume.state = finish_state(saved, last)
            self._reapply_hyperparams(opt)
        discovery.set_rng_state(saved["rng"])

    def _load_model(self, name: str, model: torch.nn.Module, saved: dict) -> None:
        live = model.state_dict()
        saved = sharded.model_state(saved, live)
        missing, extra = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
        shapes = [k for k in live if k in saved and tuple(live[k].shape) != tuple(saved[k].shape)]
        if missing or extra or shapes:
            what = (f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}" if extra
                    else f"shape of {shapes[0]!r} is {tuple(saved[shapes[0]].shape)} there, "
                         f"{tuple(live[shapes[0]].shape)} here")
            raise CheckpointMismatch(
                f"checkpoint dir {self.dir} holds another model ({name}: {what}); "
                "pass a new --dir, or --no-resume after removing it")
        model.load_state_dict(saved)

    def scheduler(self, sched: Any, idx: int) -> None:
        if self.resume and idx < len(self.resume.state["schedulers"]):
            sched.load_state_dict(self.resume.state["schedulers"][idx])
            self._reapply_hyperparams(sched.optimizer)

    def _reapply_hyperparams(self, opt: torch.optim.Optimizer) -> None:
        """A scheduler's constructor re-sets the lr; put back the checkpointed values. Its optimizer
        may be a wrapper around a registered one (HF Trainer builds its scheduler on accelerate's
        AcceleratedOptimizer): the values go to the registered optimizer it updates."""
        optimizers = self.state.optimizers
        if opt not in optimizers:
            params = {id(p) for p in replay.optimizer_params(opt)}
            opt = next((o for o in optimizers if params <= {id(p) for p in replay.optimizer_params(o)}), None)
            if opt is None:
                return
        saved = self.resume.state["optimizers"].get(indexed("optimizer", optimizers.index(opt)))
        if saved:
            for group, sgroup in zip(opt.param_groups, saved["param_groups"], strict=True):
                group.update({k: v for k, v in sgroup.items() if k != "params"})

    def scaler(self, scaler: Any, idx: int) -> None:
        if self.resume and idx < len(self.resume.state["scalers"]):
            scaler.load_state_dict(self.resume.state["scalers"][idx])

    def tracked(self, name: str, obj: Any) -> None:
        extra = self.resume.state.get("extra", {}) if self.resume else {}
        if name in extra:
            if isinstance(obj, torch.Generator):
                obj.set_state(extra[name])
            else:
                obj.load_state_dict(extra[name])


def fetch_held(client: EngineClient, step: int, nbytes: int, rank: int, world_size: int) -> ResumeState:
    """The state of `step` the engine holds in memory, read from the shared-memory file it
    keeps it in: a restart that reads nothing from disk and copies once. Model tensors stay
    views of that file (`load_state_dict` copies them into the model before the engine may
    change it, at the next step's gradients); the rest is cloned (an optimizer keeps the
    tensors it loads)."""
    body = client.request(FetchHeld(step=step))
    if "error" in body:
        raise CkptrunError(f"the checkpoint engine could not hand over step {step} from memory ({body['error']})")
    buf = torch.from_file(body["path"], shared=True, size=max(1, nbytes), dtype=torch.uint8)
    tensors = {k: view(buf, TensorSpec.from_json(k, t)) for k, t in body["tensors"].items()}
    tensors = {k: t if k.startswith("models/") else t.clone() for k, t in tensors.items()}
    if not body.get("exact", True) and rank == 0:
        log.warning(f"warning: resumed step {step} from the engine's CPU replica: it was updated on the CPU "
                    "and may differ from the device's own arithmetic by rounding (re-based from a real "
                    "snapshot every --rebase-every steps)")
    return ResumeState(body["step"], "memory", unflatten(body["skeleton"], tensors), world_size, source="memory")
