"""The per-worker runtime: the parts of a worker, made and wired once per process (`current()`).

Bootstrap makes the Runtime before the script runs: it connects to this rank's engine and
makes the strategy, which sees the worker only through its `StrategyContext`
(ckptrun/worker/context.py). The state then takes one path through the parts, each a module:

- state.py: what is saved (the objects the script trains, found as they are constructed; the
  state of step t);
- loading.py: the resumed step loaded into each object as it is constructed;
- hooks.py: the optimizer step hooks, which run the strategy's hooks;
- capture.py (with copier.py): the state of step t built and copied into a staging slot;
- slots.py and handoff.py: the slots, back-pressure, the seal, the hand-off to the engine and
  what the engine says back.

The Runtime itself receives the constructed objects (`on_optimizer`, `on_scheduler`, ...,
from ckptrun/worker/patches.py) and passes each to the parts that save and load it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .. import faults
from ..config import RunConfig
from ..errors import CkptrunError, no_optimizer
from ..ipc.client import EngineClient
from ..ipc.messages import Bye, CommitPending, Message
from ..log import log
from ..restore import replay
from ..strategies import REGISTRY, checkpoints_every_optimizer, names_where
from . import decisions, jobstore, sharded
from .capture import Capture
from .context import WorkerContext
from .ddp_buckets import DDP_BUCKETS, BucketLayout
from .greeting import Greeting, hello, store_up
from .handoff import Handoff
from .hooks import StepHooks
from .loading import Loader, ResumeState
from .metrics import WorkerMetrics
from .slots import Staging
from .state import TrainingState, skipped_steps

_current: Runtime | None = None
FINAL_COMMIT_S = 60.0  # --node-local-dir: how long the end of a run waits for every node's last commits


def current() -> Runtime | None:
    return _current


class Runtime(StepHooks):
    def __init__(self, cfg: RunConfig, rank: int, local_rank: int, world_size: int, restart_count: int,
                 connect: Callable[..., EngineClient] = EngineClient, greeting: Greeting | None = None):
        """`greeting`: the Hello bootstrap sent already (worker/greeting.py); without one,
        `connect(address, authkey, on_event)` opens the engine connection (tests pass an
        in-process fake) and the Hello is sent here."""
        self.cfg, self.rank, self.local_rank = cfg, rank, local_rank
        self.world_size, self.restart_count = world_size, restart_count
        self.metrics = WorkerMetrics(cfg.metrics_dir, rank)
        self.fault = faults.from_env(rank, restart_count)
        self.retuner, interval = decisions.for_runtime(self)
        super().__init__(interval)
        entry = REGISTRY[cfg.strategy]
        cuda = torch.cuda.is_available()
        # a node-local --dir holds its own ranks' parts only: each rank writes all of its state
        self.state = TrainingState(rank, world_size, entry.write_once and not cfg.node_local_dir,
                                   mark_shared=cfg.replicas > 1 and (cfg.node_local_dir
                                                                     or entry.holds_snapshots(cfg.options)))
        self.loading = Loader(self.state, cfg.dir, self.retuner.observe_replay)
        self.handoff = Handoff(cfg, rank, world_size, self.metrics, self.retuner, self.fault)
        self.staging = Staging(cfg, rank, self.metrics, self.handoff.check, self.handoff.lost, pin=cuda)
        self.capture = Capture(self.state, self.staging, self.metrics, cuda)
        self.handoff.attach(self.state, self.capture)
        self.client = self.handoff.client = self.staging.client = (
            connect(cfg.engine_address(local_rank), bytes.fromhex(cfg.authkey), self._on_event) if greeting is None
            else greeting.client)
        if greeting is None:
            store_up(msg := hello(cfg, rank, world_size, restart_count))
            reply = self.client.request(msg)
        else:
            self.client.listen(self._on_event)
            reply = greeting.reply()
            self.hello_wait_s = greeting.waited_s
        self.engine_pid = reply["pid"]
        self.staging.start(reply["slots"], busy=reply.get("busy", []))
        strategy = entry.load()
        self.staging.min_slots = strategy.min_slots
        self.strategy = strategy(WorkerContext(self))

    def _on_event(self, msg: Message) -> None:
        """An event from the engine (its receiver thread): the hand-off's, then the strategy's."""
        self.handoff.on_event(msg)
        self.strategy.on_event(msg) if hasattr(self, "strategy") else None

    @property
    def resume(self) -> ResumeState | None:
        """The committed step this worker resumed from (None on a fresh start)."""
        return self.loading.resume

    def resume_from(self, resume: ResumeState) -> None:
        """Bootstrap chose `resume`: training continues after its step, loaded as objects come."""
        self.loading.resume = resume
        self.step = self.capture.checkpointed_step = resume.step
        try:
            self.state.skipped = skipped_steps(resume.state)
        except ValueError as e:
            raise CkptrunError(f"step {resume.step}: {e}") from None

    @property
    def resume_iteration(self) -> int:
        """The script's iteration to resume at: the optimizer steps restored, plus the steps a
        GradScaler skipped before them (ckptrun.resume_step())."""
        return self.step + self.state.skipped

    # ---- the script's objects, as they are constructed (patches.py) --------------------
    def on_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """A torch.optim.Optimizer (subclass) was constructed. A wrapper that delegates to one
        already registered is the same logical optimizer (`TrainingState.alias`)."""
        if self.state.alias(opt):
            self.metrics.emit(type="optimizer_alias", cls=type(opt).__name__)
            return
        params = replay.optimizer_params(opt)
        idx = len(self.state.optimizers)
        if not REGISTRY[self.cfg.strategy].sharded and any(sharded.is_dtensor(p) for p in params):
            able = names_where(lambda entry: entry.sharded)
            raise CkptrunError(
                f"--strategy {self.cfg.strategy} cannot checkpoint sharded parameters (DTensor: FSDP2's fully_shard, "
                f"tensor parallel), and this script's {type(opt).__name__} updates some; use --strategy {able}")
        if idx > 0 and self.strategy.single_optimizer:
            raise CkptrunError(
                f"--strategy {self.cfg.strategy} replays one optimizer, and this script creates a second one "
                f"({type(opt).__name__} after {type(self.state.primary).__name__}); use --strategy "
                f"{names_where(checkpoints_every_optimizer)}, which checkpoint every optimizer")
        if self.strategy.single_optimizer and isinstance(opt, torch.optim.LBFGS):
            raise CkptrunError(
                f"--strategy {self.cfg.strategy} replays gradients, and LBFGS re-evaluates its closure several "
                "times per step (no one gradient to replay); use --strategy "
                f"{names_where(checkpoints_every_optimizer)}")
        self.state.add_optimizer(opt)
        if self.strategy.wants_grad_hooks:
            self.unhooked += self.hook_grads([p for group in opt.param_groups for p in group["params"]])
        orphans = self.state.orphans(idx)
        if orphans:
            self.track(*orphans)
        self.metrics.emit(type="optimizer", index=idx, cls=type(opt).__name__,
                          param_bytes=sum(p.numel() * p.element_size() for g in opt.param_groups for p in g["params"]))
        if idx == 0 and self.recovery_started is not None:
            self.setup_s = time.time() - self.recovery_started - self.loading.restore_s
        if self.loading.resume is not None:
            self.loading.optimizer(opt, idx)
        if idx == 0 and not self._probe():
            self.start_strategy()

    def _probe(self) -> bool:
        """A fresh run under --max-overhead, with the interval its to choose and nothing set that
        changes what training computes: its first steps take no checkpoint, so that the step
        without checkpointing is measured (worker/budget.py). A resumed run never probes (a chain
        of records cannot skip steps); a script that ends or stops before it is over starts the
        strategy then."""
        watch, cfg = self.retuner.watch, self.cfg
        trains = any(opt.trains and cfg.options.get(opt.name) for opt in REGISTRY[cfg.strategy].options)
        if watch is None or self.loading.resume is not None or cfg.every_given or trains:
            return False
        return watch.start_probe(self.step)

    def on_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """A DDP wrapper was created: the parameters it synchronises (and the optimizer state over
        them) are the same on every rank, so they may be written once (`TrainingState.write_once`).
        Its all-reduce bucket layout is tracked (worker/ddp_buckets.py)."""
        self.state.replicated.append(ddp)
        if not ddp.static_graph:  # (its bucket layout, restored before the script registers a comm hook)
            self.track(f"{DDP_BUCKETS}{len(self.state.replicated) - 1}", BucketLayout(ddp))
        self.strategy.on_ddp(ddp)

    def hook_grads(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Give the strategy each of `params`' gradients as backward accumulates it; return those
        that cannot take the hook yet: a parameter that does not require grad (a frozen layer,
        perhaps unfrozen later; until then, and in the backward that first gives it a gradient,
        the strategy takes its gradient at the step)."""
        frozen = []
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.on_grad_ready)
            else:
                frozen.append(p)
        return frozen

    def on_scheduler(self, sched: Any) -> None:
        self.state.schedulers.append(sched)
        self.loading.scheduler(sched, len(self.state.schedulers) - 1)

    def on_scaler(self, scaler: Any) -> None:
        self.state.scalers.append(scaler)
        self.loading.scaler(scaler, len(self.state.scalers) - 1)

    def track(self, name: str, obj: Any) -> None:
        self.state.track(name, obj)
        self.loading.tracked(name, obj)

    # ---- the end -----------------------------------------------------------------------
    def finish(self) -> None:
        if not self.state.optimizers:
            raise no_optimizer("the script never created a torch.optim optimizer")
        self.start_strategy()  # (a script that ended during the probe: the final checkpoint all the same)
        self.strategy.finish()
        self.handoff.drain()
        if self.cfg.node_local_dir and self.world_size > 1 and not self.handoff.lost.is_set():
            self._committed_on_every_node()
        self.staging.close()
        if self.retuner.watch is not None:
            self.retuner.watch.report(self.step)
        if self.metrics.last_memory_step is not None:  # reached after the last step's record
            self.metrics.emit(type="in_memory", step=self.metrics.last_memory_step)
        self.metrics.close()
        self.client.send(Bye()) if not self.handoff.lost.is_set() else None
        self.client.close()


    def _committed_on_every_node(self) -> None:
        """--node-local-dir: the last steps commit on every node through the job store, which
        rank 0's worker hosts; so each worker waits for its engine to have nothing left to commit
        (or publish), and rank 0's for every worker, before it ends (FINAL_COMMIT_S at most)."""
        deadline = time.monotonic() + FINAL_COMMIT_S
        while self.client.request(CommitPending()).get("pending") and time.monotonic() < deadline:
            time.sleep(0.05)
        if not jobstore.meet(self.restart_count, "finished", self.rank, self.world_size, wait=self.rank == 0,
                             timeout_s=FINAL_COMMIT_S):
            log.warning(f"not every node published the last steps in its --dir within {FINAL_COMMIT_S:.0f} s; "
                        "those nodes resume from an earlier step")


def install(rt: Runtime) -> None:
    """Make `rt` the process runtime and hook every optimizer's step."""
    global _current
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from . import patches

    _current = rt
    register_optimizer_step_pre_hook(rt.pre_step_hook)
    register_optimizer_step_post_hook(rt.post_step_hook)
    patches.install(rt)
