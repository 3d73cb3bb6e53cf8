"""Built-in integrations with training frameworks that run their own loop (HF `Trainer`,
Lightning `Trainer`).

ckptrun restores parameters, optimizer state, schedulers and RNG by itself; what it cannot see is
the framework's loop position (global step, epoch, batches consumed, callback state). An
integration tracks that position as part of every checkpoint and, on a restart of a script that
does not resume itself, brings the framework's loop there, through the framework's own
resume-from-checkpoint path. Integrations are installed at start-up as post-import hooks: they
patch a framework when the script imports it, and ckptrun never imports one itself.
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import wrapt


@dataclass(frozen=True)
class Integration:
    module: str  # the framework module whose import triggers `install`
    install: str  # "package.module:function", called as function(rt, module)


INTEGRATIONS = (
    Integration("transformers.trainer", "ckptrun.worker.integrations.hf_trainer:install"),
    Integration("lightning.pytorch.trainer.trainer", "ckptrun.worker.integrations.lightning:install"),
    Integration("pytorch_lightning.trainer.trainer", "ckptrun.worker.integrations.lightning:install"),
)


def install(rt: Any) -> None:
    """Register every integration's post-import hook (it runs at once if already imported)."""
    for it in INTEGRATIONS:
        wrapt.register_post_import_hook(functools.partial(_install_one, it, rt), it.module)


def _install_one(it: Integration, rt: Any, module: Any) -> None:
    path, func = it.install.split(":")
    getattr(importlib.import_module(path), func)(rt, module)


class LoopPosition:
    """A framework loop's position as a tracked object: `read()` is called when a checkpoint is
    sealed (after the step's scheduler update and callbacks); it must return JSON-representable
    data. The value saved in the checkpoint being resumed is kept in `saved`."""

    def __init__(self, read: Callable[[], Any]) -> None:
        self.read = read
        self.saved: Any = None

    def state_dict(self) -> dict:
        return {"json": json.dumps(self.read())}

    def load_state_dict(self, state: dict) -> None:
        self.saved = json.loads(state["json"])


def resumed_position(rt: Any, name: str, read: Callable[[], Any]) -> Any:
    """Track the loop position under `name`. Return the position saved at the resumed step when
    the integration must bring the framework's loop there (ckptrun restored a step and the script
    did not ask `ckptrun.resume_step()`), else None. Returning it tells the runtime that the loop
    starts at the resumed step (no --on-restart warning)."""
    pos = LoopPosition(read)
    rt.track(name, pos)
    if rt.resume is None or rt.script_resumes or pos.saved is None:
        return None
    rt.script_resumes = True
    return pos.saved
