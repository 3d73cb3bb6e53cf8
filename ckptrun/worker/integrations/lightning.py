"""Lightning `Trainer` integration (`lightning.pytorch` or `pytorch_lightning`, whichever the
script imports; everything is reached through the module given to `install`).

Recorded: after every callback's `on_train_batch_end` of a batch that stepped the optimizer
(where `ModelCheckpoint(every_n_train_steps=...)` dumps, checkpoint callbacks running last),
Lightning's own loop and callback state, plus the torch RNG state the epoch's train iterator was
made from. ckptrun seals step N inside batch N+1, so `read` returns that copy, not the live loops.

Resumed: in the first `fit` without `ckpt_path`, after the optimizer exists (ckptrun has restored
model, optimizer, schedulers, scaler and RNG when they were built: a LowDiff step is only known
once replayed), the recorded loops and callbacks are loaded through Lightning's own
`restore_callbacks`/`restore_loops`. Lightning's restore of the model, optimizer and schedulers
is not run: it would load again what ckptrun just restored. A resume mid-epoch gets the data
Lightning alone cannot give a plain DataLoader: the epoch's iterator is made again from its RNG
state and the consumed batches are drawn and dropped, so the next batch is the uninterrupted
run's. A `fit(ckpt_path=...)` is left entirely to Lightning.
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

import torch
import wrapt

from ...log import log
from . import resumed_position
from .jsontensors import from_json, to_json

NAME = "ckptrun.lightning"
# Lightning warns that a mid-epoch resume restarts a plain DataLoader; the fast-forward prevents it
_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


def install(rt: Any, module: ModuleType) -> None:
    """Patch the Lightning package whose `trainer.trainer` module is `module`."""
    tracker = _Tracker(rt, module)
    wrapt.wrap_function_wrapper(module.call, "_call_callback_hooks", tracker.callback_hooks)
    wrapt.wrap_function_wrapper(module._CheckpointConnector, "restore_training_state", tracker.restore_training_state)
    wrapt.wrap_function_wrapper(module._FitLoop, "setup_data", tracker.setup_data)
    wrapt.wrap_function_wrapper(module._TrainingEpochLoop, "on_run_start", tracker.epoch_start)


class _Tracker:
    """The position of the `fit` under way, and the resume of the first one."""

    def __init__(self, rt: Any, module: ModuleType) -> None:
        self.rt, self.module = rt, module
        self.tracking = False
        self.position: dict | None = None  # as of the last optimizer step's train-batch end
        self.recorded_step = -1
        self.epoch_rng: Any = None  # to_json of the RNG state the current epoch's train iterator was made from
        self.resume_at: tuple[torch.Tensor, int] | None = None  # (epoch RNG, batches consumed): to fast-forward
        self.warned: set[str] = set()

    # ---- recording ---------------------------------------------------------------------
    def callback_hooks(self, wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        trainer, hook = args[0], args[1]
        if hook == "on_train_batch_end" and self.tracking and self.rt.step != self.recorded_step:
            self.recorded_step = self.rt.step  # a batch that only accumulated gradients is no step's end
            self.position = self._position(trainer)
        return result

    def _position(self, trainer: Any) -> dict:
        """What Lightning's `dump_checkpoint` holds besides model, optimizer, schedulers and
        precision state (ckptrun's own), as JSON."""
        return {"pytorch-lightning_version": self.module.pl.__version__, "epoch": trainer.current_epoch,
                "global_step": trainer.global_step,
                "loops": to_json(trainer._checkpoint_connector._get_loops_state_dict()),
                "callbacks": self._callbacks(trainer), "epoch_rng": self.epoch_rng}

    def _callbacks(self, trainer: Any) -> dict:
        out = {}
        for key, state in self.module.call._call_callbacks_state_dict(trainer).items():
            try:
                out[key] = to_json(state)
            except TypeError as e:  # loud, not fatal: that callback starts afresh on a resume
                if key not in self.warned:
                    self.warned.add(key)
                    log.warning(f"the state of Lightning callback {key} holds {e}, which ckptrun does "
                                "not checkpoint; a resumed run starts that callback afresh")
        return out

    def setup_data(self, wrapped, fit_loop, args, kwargs):
        """Called when `fit` starts and at each epoch start (Lightning may reload the data)."""
        rng, old = torch.get_rng_state(), _train_iterator(fit_loop)
        result = wrapped(*args, **kwargs)
        self._iterator_made(fit_loop, old, rng)
        return result

    def epoch_start(self, wrapped, epoch_loop, args, kwargs):
        """Called at each epoch start, after the sampler's `set_epoch`; makes the iterator of an
        epoch after the first."""
        if self.resume_at is not None:
            self._fast_forward(args[0])
            return wrapped(*args, **kwargs)
        rng, old = torch.get_rng_state(), _train_iterator(epoch_loop.trainer.fit_loop)
        result = wrapped(*args, **kwargs)
        self._iterator_made(epoch_loop.trainer.fit_loop, old, rng)
        return result

    def _iterator_made(self, fit_loop: Any, old: Any, rng: torch.Tensor) -> None:
        """If the epoch's train iterator was just made (drawing from `rng`), record `rng`."""
        if _train_iterator(fit_loop) is old:
            return
        if self.resume_at is not None:
            torch.set_rng_state(rng)  # made again in `epoch_start`, as the uninterrupted run made it
        else:
            self.epoch_rng = to_json(rng)

    # ---- resuming ----------------------------------------------------------------------
    def restore_training_state(self, wrapped, connector, args, kwargs):
        trainer = connector.trainer
        if trainer.state.fn != self.module.TrainerFn.FITTING or connector._ckpt_path:
            return wrapped(*args, **kwargs)
        saved = self._start()
        if saved is None:
            return wrapped(*args, **kwargs)
        loops = from_json(saved["loops"])
        connector._loaded_checkpoint = {
            "epoch": saved["epoch"], "global_step": saved["global_step"], "loops": loops,
            "pytorch-lightning_version": saved["pytorch-lightning_version"], "callbacks": from_json(saved["callbacks"]),
        }
        connector.restore_callbacks()
        connector.restore_loops()
        progress = trainer.fit_loop.epoch_loop.batch_progress
        stateful_data = "combined_loader" in loops["fit_loop"]["state_dict"]  # Lightning positions it itself
        if saved["epoch_rng"] is not None and progress.current.ready and not progress.is_last_batch \
                and not stateful_data:
            self.resume_at = (from_json(saved["epoch_rng"]), progress.current.ready)
            warnings.filterwarnings("ignore", message=_NOT_RESUMABLE)
        return None

    def _start(self) -> dict | None:
        """Track the position from the first `fit` on; the saved one if ckptrun resumed a step."""
        if self.tracking:
            return None
        self.tracking = True
        return resumed_position(self.rt, NAME, lambda: self.position)

    def _fast_forward(self, fetcher: Any) -> None:
        """Remake the resumed epoch's iterator from the RNG state the uninterrupted run made it
        from (after the sampler's `set_epoch`), and draw the batches it had consumed."""
        (rng, consumed), self.resume_at = self.resume_at, None
        now = torch.get_rng_state()
        torch.set_rng_state(rng)
        iter(fetcher)
        for _ in range(consumed):
            next(fetcher)
        fetcher.fetched -= consumed  # the epoch loop adds the batches consumed before the resume itself
        torch.set_rng_state(now)
        self.epoch_rng = to_json(rng)


def _train_iterator(fit_loop: Any) -> Any:
    loader = fit_loop._combined_loader
    return None if loader is None else loader._iterator
