"""The strategy interface, and the shared snapshot-then-persist mechanism.

A strategy decides *what* moves *when*; the runtime, engine, store and restore are shared.
Trainer-side hook points (all optional):

- `on_ready(step)`: the optimizer exists and state is restored (training starts at `step`).
- `on_ddp(ddp)`: a DistributedDataParallel wrapper was created (communication hooks).
- `on_grad_ready(param)`: a parameter's gradient is final for this step (layer-wise capture);
  the runtime registers per-parameter hooks only for strategies with `wants_grad_hooks`.
- `on_grad_scale(params, coefficient, scale)`: the script clips gradients (`clip_grad_norm_`)
  or a GradScaler unscales them: `scale()` multiplies each of `params`' gradients in place by
  the 0-d tensor `coefficient`; the strategy runs it (default: just that).
- `before_step(step)`: the optimizer is about to take step `step` (gradients are final, after
  the script's clipping/unscaling/all-reduce; with `step(closure)`, after the closure's first
  evaluation). The blocking point for "the update must wait".
- `after_step(step)`: step `step` is complete (parameters and optimizer state are new).
- `on_event(msg)`: an event pushed by this strategy's engine-side handler.
- `finish()`: the script returned; hand over whatever is pending.

Several checkpoints in flight come from the slot pool (`--max-inflight`); spreading one
checkpoint over several steps, a CPU replica or a persistent region live in an engine-side
handler (`ckptrun.engine.handlers`) that receives the strategy's own messages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ..errors import UsageError
from ..ipc.messages import Persist
from .memory_first import HELD_WHY, SNAPSHOT_PERSIST_EVERY, least_slots
from .memory_first.model import HW_SHARE
from .memory_first.policy import PersistInterval

if TYPE_CHECKING:
    from ..ipc.messages import Message
    from .context import Snapshot, StrategyContext


class Strategy:
    name: ClassVar[str] = ""
    wants_grad_hooks: ClassVar[bool] = False
    # Replays one optimizer's consumed gradients: refuses a second optimizer and multi-evaluation
    # closures (LBFGS) at start instead of saving something it cannot restore.
    single_optimizer: ClassVar[bool] = False
    # Staging slots it may hold at once itself (e.g. a full snapshot and a diff): the fewest the
    # host-memory budget may leave it (memory_budget.py); with fewer, its capture would wait forever.
    min_slots: ClassVar[int] = 1
    # Its mechanism works every step whatever the interval (a diff or a replica update per step):
    # the run's --every does not thin it, so under --max-overhead what it costs per step is its own
    # (ckptrun/worker/budget.py says so when that is over the budget).
    every_step: ClassVar[bool] = False

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx

    def on_ready(self, step: int) -> None:
        """The first optimizer exists and any checkpointed state is restored; `step` is where
        training (re)starts."""
        return None

    def staged_bytes(self, full: int) -> int:
        """The staging-slot bytes its snapshots need, given a full snapshot's (`full`): made
        before its first checkpoint (ckptrun/worker/slots.py); 0: it copies elsewhere."""
        return full

    def on_grad_ready(self, param) -> None:
        return None

    def on_grad_scale(self, params: list, coefficient, scale) -> None:
        scale()

    def on_ddp(self, ddp) -> None:
        """The script wrapped its model in DistributedDataParallel (e.g. to add a comm hook)."""
        return None

    def before_step(self, step: int) -> None:
        return None

    def after_step(self, step: int) -> None:
        return None

    def on_event(self, msg: Message) -> None:
        return None

    def finish(self) -> None:
        return None

    def settings(self) -> dict:
        """What the dashboard header and metrics show for this strategy."""
        return {"every": self.ctx.every, "max_inflight": self.ctx.max_inflight}


class SnapshotStrategy(Strategy):
    """Full checkpoints: capture after step t, seal and hand over before step t+1.

    `background`: copy parameters/optimizer state while the next forward/backward runs.
    `wait_durable`: block the trainer until the engine reports the bytes durable.
    With `--persist-every` (an entry that declares the memory tier's option), every step is
    captured and the engine holds the newest in memory (`Persist.hold`): a worker crash resumes
    from it; every P-th step, and the last, is written too (`Persist.write`). Each rank then
    captures its whole state (a replicated tensor too, where another rank writes it otherwise):
    what a rank resumes from memory is its own slot.
    """

    background: ClassVar[bool] = False
    wait_durable: ClassVar[bool] = False
    message: ClassVar[type[Persist]] = Persist  # how a sealed snapshot goes to the engine

    def submit_fields(self) -> dict:
        """The fields of `message` beyond the slot and record (a strategy's own message)."""
        return {}

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.pending: Snapshot | None = None
        self.persist = memory_first_policy(ctx)
        if self.persist is not None:
            # the one the engine holds (with --replicas, the one before too), and the next capture's
            self.min_slots = least_slots(ctx.replicas)
            if ctx.max_inflight < self.min_slots:
                raise UsageError(f"--persist-every with --max-inflight {ctx.max_inflight}: the engine holds the "
                                 f"newest snapshot's staging slot{HELD_WHY if ctx.replicas > 1 else ''}, and the next "
                                 f"capture needs another; give --max-inflight {self.min_slots} or more")

    def settings(self) -> dict:
        return {**super().settings(), **(self.persist.settings if self.persist else {})}

    def after_step(self, step: int) -> None:
        if self.persist is not None or self.ctx.due(step):
            self.pending = self.ctx.capture(step, background=self.background, whole=self.persist is not None)

    def before_step(self, step: int) -> None:
        self._hand_over()

    def _hand_over(self, final: bool = False) -> None:
        if self.pending is not None:
            snap, self.pending = self.pending, None
            self.ctx.seal(snap)
            fields = self.submit_fields()
            if self.persist is not None:
                write = final or self.persist.due(snap.step)
                fields.update(hold=True, write=write)
            wait = self.wait_durable and fields.get("write", True)
            self.ctx.submit(snap, self.message, wait_durable=wait, **fields)

    def finish(self) -> None:
        ctx = self.ctx
        if ctx.final_checkpoint and self.pending is None and ctx.step > 0 and ctx.checkpointed_step != ctx.step:
            self.pending = ctx.capture(ctx.step, background=False, whole=self.persist is not None)
        self._hand_over(final=ctx.final_checkpoint or ctx.due(ctx.step))  # (due: a stop after this step)


def memory_first_policy(ctx: StrategyContext) -> PersistInterval | None:
    """The memory tier's write interval (`--persist-every`, its `auto` re-tuned like lowdiff+'s),
    or None where the option is unset: one tier, every checkpoint written."""
    if ctx.options.get("persist_every") is None:
        return None
    return ctx.policy(PersistInterval(SNAPSHOT_PERSIST_EVERY.integer(ctx.options),
                                      ctx.options.get("memory_lost_share", HW_SHARE)))
