"""The optimizer step hooks that drive a worker's checkpoints, step by step.

Run by torch around every optimizer step of the script (`register_optimizer_step_pre_hook` /
`..._post_hook`, installed by ckptrun/worker/runtime.py). Before step t+1 of the primary
optimizer: stop if asked, then the strategy's `before_step` once the gradients are final
(after the closure, if the step has one). After step t: count it, decide a stop, run the
strategy's `after_step` (which captures and hands off through its context), and close the
step's metrics. All the time a strategy hook blocks the trainer is stall.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

from .. import faults
from ..config import RunConfig
from ..errors import CkptrunError
from ..faults import Fault
from ..log import log
from ..restore import replay
from ..strategies import checkpoints_every_optimizer, names_where
from ..strategies.base import Strategy
from ..strategies.save_policy import IntervalPolicy
from .capture import Capture
from .decisions import Retuner, within_budget
from .handoff import Handoff
from .loading import Loader
from .metrics import WorkerMetrics
from .slot_size import cuda_device, first_snapshot_bytes
from .slots import Staging
from .state import TrainingState


class StopRun(BaseException):
    """Raised at the pre-step hook once `--max-steps` optimizer steps are done, or at the agreed
    step after SIGTERM/SIGINT. A BaseException, so the script's own `except Exception` does not
    swallow it; bootstrap then finishes the checkpoints as after a normal exit (the last step's
    state is complete: its scheduler stepped)."""

    def __init__(self, step: int, reason: str, signum: int | None = None) -> None:
        super().__init__(step, reason)
        self.step, self.reason, self.signum = step, reason, signum


class StepHooks:
    """The step hooks of the worker's Runtime (a mixin: the Runtime makes the parts below)."""

    cfg: RunConfig
    rank: int
    world_size: int
    restart_count: int
    fault: Fault | None
    metrics: WorkerMetrics
    retuner: Retuner
    state: TrainingState
    loading: Loader
    staging: Staging
    capture: Capture
    handoff: Handoff
    strategy: Strategy
    hook_grads: Callable[[list], list]

    def __init__(self, interval: IntervalPolicy) -> None:
        self.step = 0  # completed optimizer steps of the primary optimizer
        self.interval = interval  # the run's save decision (`due`): --every N or auto, or the strategy's own
        self.recovery_started: float | None = None  # set on resume: time to the first resumed step
        self.setup_s: float | None = None  # of it, process start and the script's set-up up to its first optimizer
        self.hello_wait_s = 0.0  # of that, waiting for the engine's answer to the Hello (worker/greeting.py)
        self.stop_signal: int | None = None  # SIGTERM/SIGINT received: stop at the agreed step
        self._stop_at: int | None = None
        self._stopping: tuple[str, int | None] | None = None  # (why, signal): stop before the next step
        self.script_resumes = False  # the script asked ckptrun.resume_step() (it starts its loop there)
        self._restart_checked = False
        self._optim_t0 = 0.0
        self.update_s = 0.0  # this step's update time a strategy hook spent (split updates)
        self.unhooked: list = []  # optimized parameters not requiring grad yet (`hook_grads`)
        self.strategy_started = False  # its `on_ready` ran (`start_strategy`)
        self._skipped_at: int | None = None  # the step whose due snapshot was skipped last (`_disk_behind`)

    def pre_step_hook(self, optimizer, args, kwargs) -> tuple[tuple, dict] | None:
        """Before the primary optimizer's step. With `step(closure)` (Lightning, LBFGS), forward
        and backward run inside the step: the gradients are final only once the closure has
        returned, so the strategy's `before_step` runs there (the closure is wrapped)."""
        if self.loading.replaying:
            return None
        if optimizer is not self.state.primary:
            if optimizer in self.state.optimizers:  # its update must not race a snapshot still being copied
                self.capture.wait_copies()
            return None
        if self.cfg.max_steps and self.step >= self.cfg.max_steps:
            raise StopRun(self.step, "--max-steps")
        if self._stopping is not None:
            raise StopRun(self.step, *self._stopping)
        if self.loading.resume is not None and not self.script_resumes and not self._restart_checked:
            self._restarted_from_the_top()
        self.handoff.check()
        # `args` is (optimizer, closure?) as `Optimizer.step` was called
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._gradients_final(self.step + 1)
            return None
        wrapped = self._wrap_closure(closure, self.step + 1)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": wrapped}
        return (args[0], wrapped, *args[2:]), kwargs

    def _restarted_from_the_top(self) -> None:
        """The script resumed at a committed step never asked `ckptrun.resume_step()`: its loop
        starts over on top of the restored state (more steps than an uninterrupted run;
        schedulers run past their end). --on-restart says what to do (`fresh` acts earlier:
        nothing is restored)."""
        self._restart_checked = True
        resumed = self.loading.resume.step
        what = (f"the script does not call ckptrun.resume_step(), so its loop starts again from its first "
                f"iteration on top of the restored step {resumed}")
        fix = ("make its loop start at ckptrun.resume_step(), or pass --on-restart fresh (restart from "
               "scratch)")
        if self.cfg.on_restart == "fail":
            raise CkptrunError(f"{what} (--on-restart fail); {fix}", exit_code=2)
        if self.rank == 0:
            log.warning(f"warning: {what}: it will take {resumed} more optimizer steps than an "
                        f"uninterrupted run; {fix}")

    def skipped_step(self) -> None:
        """A GradScaler skipped the primary optimizer's step (inf/NaN gradients): no optimizer
        hook fired, the iteration counts all the same (`TrainingState.skipped_step`)."""
        if not self.loading.replaying:
            self.state.skipped_step()

    def _gradients_final(self, step: int) -> None:
        """The gradients optimizer step `step` consumes are final: the strategy may take them."""
        if step > self.retuner.probe_until:
            self._timed(self.strategy.before_step, step)
        if self.fault and self.fault.target == "kill" and self.fault.phase == "compute" \
                and self.fault.step == step:
            self.metrics.flush()
            faults.die()
        self._optim_t0 = time.perf_counter()

    def _wrap_closure(self, closure: Callable[[], Any], step: int) -> Callable[[], Any]:
        calls = 0

        def wrapped():
            nonlocal calls
            loss = closure()
            calls += 1
            if calls == 1:
                self._gradients_final(step)
            elif self.strategy.single_optimizer:
                raise CkptrunError(
                    f"--strategy {self.cfg.strategy} replays the gradient of each step, and this optimizer "
                    f"evaluated its closure {calls} times in step {step} (LBFGS-style); use --strategy "
                    f"{names_where(checkpoints_every_optimizer)}")
            return loss

        return wrapped

    def post_step_hook(self, optimizer, args, kwargs) -> None:
        if optimizer is not self.state.primary or self.loading.replaying:
            return
        self.metrics.optim_s = time.perf_counter() - self._optim_t0 + self.update_s
        self.update_s = 0.0
        self.step += 1
        self.state.stepped()
        if self.unhooked:  # (one unfrozen since: its gradients come in backward from now on)
            self.unhooked = self.hook_grads(self.unhooked)
        if self.cfg.max_steps and self.step >= self.cfg.max_steps:
            self._stopping = ("--max-steps", None)
        elif self.stop_signal is not None and self._stop_here():
            self._stopping = (signal.Signals(self.stop_signal).name, self.stop_signal)
        self._strategy_after(self.step)
        if self.recovery_started is not None:
            resume = self.loading.resume
            self.metrics.emit(type="restart", restart_count=self.restart_count,
                              resume_step=resume.step if resume else 0,
                              recovery_s=time.time() - self.recovery_started, restore_s=self.loading.restore_s,
                              setup_s=self.setup_s, hello_wait_s=self.hello_wait_s)
            self.recovery_started = None
        self.staging.report(self.step)
        record = self.metrics.end_step(self.step)
        self.retuner.after_step(self.step, record)

    def _strategy_after(self, step: int) -> None:
        """The strategy's `after_step`; during a fresh run's probe of the no-checkpoint step
        (worker/budget.py) nothing, and at its last step (or a stop during it) the strategy
        starts, as if the run began at this step."""
        probe = self.retuner.probe_until
        if step > probe:
            self._timed(self.strategy.after_step, step)
        elif step == probe or self._stopping is not None:
            self.retuner.watch.end_probe(step)
            self._timed(lambda _step: self.start_strategy(), step)

    def on_grad_ready(self, param) -> None:
        """A parameter's gradient is final (backward): the strategy's, once it has started."""
        if self.step >= self.retuner.probe_until:
            self.strategy.on_grad_ready(param)

    def on_grad_scale(self, params: list, coefficient, scale: Callable[[], None]) -> None:
        """The script clips or unscales gradients: through the strategy, once it has started."""
        if self.step >= self.retuner.probe_until:
            self.strategy.on_grad_scale(params, coefficient, scale)
        else:
            scale()

    def start_strategy(self) -> None:
        """The strategy's `on_ready` at the step training (re)starts from, once; and its staging
        slots set up in the background from then (after a probe's steps, which it would slow)."""
        if not self.strategy_started:
            self.strategy_started = True
            self.strategy.on_ready(self.step)
            opt = self.state.primary  # (its slots, made on the set-up thread before its first checkpoint)
            self.staging.prepare(self.strategy.staged_bytes(first_snapshot_bytes(self.state, opt)),
                                 cuda_device(replay.optimizer_params(opt)))

    def _stop_here(self) -> bool:
        """After SIGTERM/SIGINT: is the step just finished the one every rank stops after?

        Decided right after a step, so that its state is captured then, exactly (the next
        forward changes RNG and buffers). One rank alone stops at once. Ranks agree through the
        job store: the first to ask proposes the step after its own (compare-and-set, so every
        rank gets the same answer); no rank in lock-step training (DDP) can be past it, and none
        blocks waiting for another, so no collective is left half-done."""
        if self.world_size == 1:
            return True
        if self._stop_at is None:
            from .jobstore import job_store

            kv = job_store(self.restart_count, "stop")
            self._stop_at = int(kv.compare_set("step", "", str(self.step + 1)).decode())
        if self.step > self._stop_at:
            log.info(f"rank {self.rank} is past the agreed stop step {self._stop_at} (it trains without "
                     f"collectives); stopping after step {self.step}")
        return self.step >= self._stop_at

    def due(self, step: int) -> bool:
        """Is a checkpoint of `step` due? Always for the step the run stops after."""
        if self._stopping is not None:
            return True
        return self.interval.due(step) and not self._disk_behind(step)

    def _disk_behind(self, step: int) -> bool:
        """Under --max-overhead, with the interval the run's to choose (never an explicit --every)
        and one rank (ranks must checkpoint the same steps): a snapshot due at the step just taken
        that finds every staging slot still on its way to disk is skipped, not waited for; the
        next due step's is the newest (DESIGN §6: the disk is paced, never waited on)."""
        cfg, pool = self.cfg, self.staging.pool
        if not (cfg.max_overhead > 0 and cfg.interval_auto and self.world_size == 1 and step == self.step):
            return False
        # Until a checkpoint's cost was measured, one at a time: the first ones would otherwise come
        # every step, each slowing the next steps while its write runs (the drain bound, applied early).
        early = self.retuner.watch is not None and not self.retuner.watch.measured
        with pool.cond:
            behind = bool(pool.buffers) and (not pool.free or (early and pool.inflight > 0))
        if behind and self._skipped_at != step:
            self._skipped_at = step
            self.metrics.emit(type="skipped", step=step, reason="every staging slot still being written")
        return behind

    def use_interval(self, policy: IntervalPolicy) -> None:
        """A strategy's own `--every auto` rule replaces the run's (Daly's)."""
        self.retuner.policies.remove(self.interval)
        self.interval = self.retuner.add(within_budget(self, policy))

    def _timed(self, hook: Callable[[int], None], step: int) -> None:
        """Run a strategy hook; all the time it blocks training is stall. Whatever the inner timers
        (back-pressure, sync write) did not claim is the snapshot's (state building, copies, sends)."""
        claimed, update = sum(self.metrics.stall.values()), self.update_s
        t0 = time.perf_counter()
        hook(step)
        spent = time.perf_counter() - t0 - (self.update_s - update)
        self.metrics.add_stall("snapshot", max(0.0, spent - (sum(self.metrics.stall.values()) - claimed)))

