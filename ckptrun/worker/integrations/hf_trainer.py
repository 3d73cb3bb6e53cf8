"""HF `transformers.Trainer`: a restarted worker continues HF's own loop at the resumed step.

ckptrun restores the model, optimizer, scheduler, scaler and RNG when HF constructs them; what it
tracks here is the loop's position: the `TrainerState` HF writes as trainer_state.json (global
step, epoch, log history, callback states) plus what the loop accumulated since its last log
(loss sum, flops), so that even the logged losses continue as in an uninterrupted run. On a
restart, `Trainer.train` runs through HF's own resume path from a private folder that holds only
that trainer_state.json, so HF sets the global step and epoch and skips the consumed batches
itself; for that call HF's loaders of weights, optimizer, scheduler and scaler do nothing (ckptrun
restored them; the folder has none), and where HF would load its RNG file the RNG state ckptrun
restored is put back. A script that passes `resume_from_checkpoint` itself resumes from HF's
checkpoint as it asked: its position is tracked, nothing else changes.

Relies on these internals of transformers 5.x (checked against 5.23; older versions are left
alone, with a warning): `Trainer.train`'s `resume_from_checkpoint`, the loaders
`_load_from_checkpoint`, `_load_optimizer_and_scheduler`, `_load_scaler`, `_load_rng_state`, the
loop's logging accumulators `_tr_loss` (an attribute since 5.0), `_globalstep_last_logged`,
`_total_loss_scalar` and `current_flos`, reset by the loop just before `on_train_begin`, and
`TrainerState`'s JSON form with its `stateful_callbacks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import itertools
import json
import os
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

from transformers.trainer_callback import ExportableState, TrainerCallback, TrainerState

from ...log import log
from .. import discovery
from . import LoopPosition, resumed_position

NAME = "transformers.Trainer"  # tracked as NAME, NAME_1, ... for each Trainer that trains
_LOADERS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler")


class _Position(TrainerCallback):
    """A trainer's loop position: its `TrainerState` and what it has accumulated since the last
    log (loss sum, flops, step of that log), so that the next logged entry comes out as in an
    uninterrupted run. Read when ckptrun seals a checkpoint, i.e. at the next optimizer pre-step,
    after that step's forward and backward have added to the counters: those are taken as they
    were at the top of the step (`on_step_begin`). On a restart they are put back once HF's loop
    has reset them (`on_train_begin`)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.saved: dict | None = None  # the position to resume at, if any
        self.top: dict | None = None  # the counters at the top of the current step; None: live

    def _counters(self) -> dict:
        t = self.trainer
        return {"num_input_tokens_seen": t.state.num_input_tokens_seen, "current_flos": t.current_flos,
                "tr_loss": t._tr_loss.detach().clone(), "globalstep_last_logged": t._globalstep_last_logged}

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        if self.saved is not None:
            t, since = self.trainer, self.saved["since_log"]
            t.current_flos = since["current_flos"]
            t._tr_loss.fill_(since["tr_loss"])
            t._globalstep_last_logged = since["globalstep_last_logged"]
            # the end-of-train summary averages the loss of this call's steps, as after HF's own resume
            t._total_loss_scalar = -since["tr_loss"]

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self.top = self._counters()

    def finished(self) -> None:
        """The loop returned: its counters are final as they are."""
        self.top = None

    def read(self) -> dict:
        trainer = self.trainer
        state = dataclasses.asdict(trainer.state)
        # as `Trainer._save_checkpoint` does: the callbacks' states as they are now
        exportable = [cb for cb in trainer.callback_handler.callbacks + [trainer.control]
                      if isinstance(cb, ExportableState)]
        state["stateful_callbacks"] = TrainerState(stateful_callbacks=exportable).stateful_callbacks
        since = dict(self.top or self._counters())
        state["num_input_tokens_seen"] = since.pop("num_input_tokens_seen")
        since["tr_loss"] = since["tr_loss"].item()
        return {"trainer_state": state, "since_log": since}


@contextlib.contextmanager
def _resuming(rt: Any, trainer: Any, saved: dict, state_name: str) -> Iterator[str]:
    """A folder for HF's `resume_from_checkpoint` holding only the saved trainer state; while it
    is in use HF's loaders of state ckptrun restored do nothing on `trainer`, and its RNG loader
    puts back ckptrun's restored RNG (read when called: lowdiff's replay settles it only once the
    optimizer exists)."""
    patches = {name: _nothing for name in _LOADERS}
    patches["_load_rng_state"] = lambda checkpoint: discovery.set_rng_state(rt.resume.state["rng"])
    with tempfile.TemporaryDirectory(prefix="ckptrun-hf-") as folder:
        with open(os.path.join(folder, state_name), "w", encoding="utf-8") as f:
            json.dump(saved["trainer_state"], f)
        vars(trainer).update(patches)
        try:
            yield folder
        finally:
            for name in patches:
                vars(trainer).pop(name, None)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def install(rt: Any, module: Any) -> None:
    """Wrap `Trainer.train` (module `transformers.trainer`): track each trainer's position under
    its own name and, on a restart, bring HF's loop to the resumed step."""
    version = importlib.metadata.version("transformers")
    if int(version.split(".")[0]) < 5:
        if rt.rank == 0:
            log.warning(f"warning: transformers {version}: the Trainer integration needs 5.x; a restarted "
                        "Trainer starts its loop over")
        return
    orig = module.Trainer.train
    names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    numbers = itertools.count()

    @functools.wraps(orig)
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        if self not in names:
            n = next(numbers)
            names[self] = NAME if n == 0 else f"{NAME}_{n}"
        position = _Position(self)
        if resume_from_checkpoint in (None, False):
            position.saved = resumed_position(rt, names[self], position.read)
        else:  # the script resumes from HF's checkpoint itself: that is what it gets
            rt.track(names[self], LoopPosition(position.read))
        self.add_callback(position)
        try:
            if position.saved is None:
                result = orig(self, resume_from_checkpoint, *args, **kwargs)
            else:
                with _resuming(rt, self, position.saved, module.TRAINER_STATE_NAME) as folder:
                    result = orig(self, folder, *args, **kwargs)
        finally:
            self.remove_callback(position)
        position.finished()  # (after ckptrun's StopRun, the last seal reads the top of the step not taken)
        return result

    module.Trainer.train = train
