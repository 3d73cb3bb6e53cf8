"""The per-worker runtime: optimizer hooks, state capture into staging slots, restore on resume.

One Runtime exists per worker process (`current()`). It numbers steps (completed optimizer
steps of the first optimizer), asks the strategy what to do at each hook, and offers the
strategies one shared snapshot path: `capture` (post-step state: parameters, optimizer state,
buffers, RNG), `seal` (state that settles after the step: schedulers, scaler, tracked objects),
`submit` (hand the slot to the engine).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import faults
from ..config import RunConfig
from ..errors import AbortRun, CheckpointMismatch, CkptrunError, CorruptCheckpoint, no_optimizer
from ..ipc.client import EngineClient, EngineLost
from ..ipc.messages import (
    Alloc,
    Bye,
    Committed,
    ConnectionLost,
    Durable,
    FaultKill,
    FetchHeld,
    Flush,
    Hello,
    InMemory,
    Message,
    Persist,
    RecordSpec,
    Retire,
    SaveError,
    SlotFree,
)
from ..ipc.staging import map_slot
from ..log import log
from ..memory_budget import Budget, fmt
from ..restore import replay
from ..restore.recovery import finish_state
from ..storage import writeonce
from ..storage.layout import ALIGN, Layout, TensorSpec, align, view
from ..storage.store import full_name
from ..storage.tree import flatten, orphans_key, unflatten
from ..strategies import REGISTRY
from ..strategies.context import StrategyContext
from . import decisions, discovery, sharded
from .ddp_buckets import DDP_BUCKETS, BucketLayout
from .metrics import WorkerMetrics

STAGING = "staging slots"  # the budget's use by the shared staging slots (memory_budget.py)

_current: Runtime | None = None


def current() -> Runtime | None:
    return _current


@dataclass
class Snapshot:
    """State of one step on its way into a staging slot."""

    step: int
    slot: int
    skeleton: dict
    layout: Layout
    time: float
    copy: Future | None = None
    event: Any = None  # CUDA event marking the end of the device-to-host copy
    nbytes: int = 0
    prefix: str = ""  # tensor-key prefix, so several snapshots can share one record
    kind: str = "full"  # snapshots of one kind have about the same size (slot sizing)
    # Streamed: the engine reads the slot while it fills (`progress`), so only the engine frees it.
    progress: Callable[[int], None] | None = None
    buf: Any = None  # where it is copied when not a staging slot (`capture(into=...)`; slot is then -1)
    done_at: float | None = None  # when its post-step state was seen complete in the slot ("snapshot done")
    retry: tuple | None = None  # a lazy capture to finish on the training thread (`wait_copy`)


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


class SlotPool:
    """Staging slots on the worker side: free-list, back-pressure and the mapped buffers.

    Slots are numbered by the engine. When state outgrows them, a larger generation is added
    and the old slots are retired as they come back, so growing never waits on a slot in use.
    """

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.free: list[int] = []
        self.retired: set[int] = set()
        self.nbytes = 0
        self.cond = threading.Condition()

    def add(self, slots: list[tuple[int, str, int]], pin: bool) -> list[int]:
        """Make `slots` the current generation; returns the old slots already free (to retire)."""
        with self.cond:
            old_free = [i for i in self.free]
            self.retired |= set(self.buffers)
            self.free = []
            for index, path, n in slots:
                self.buffers[index] = map_slot(path, n, pin)
                self.free.append(index)
                self.nbytes = n
            for i in old_free:
                self.retired.discard(i)
                del self.buffers[i]
            self.cond.notify_all()
            return old_free

    def acquire(self, lost: threading.Event) -> int:
        with self.cond:
            self.cond.wait_for(lambda: self.free or lost.is_set())
            if lost.is_set():
                raise EngineLost("checkpoint engine went away")
            return self.free.pop(0)

    def release(self, slot: int) -> bool:
        """Return a slot; False if it belonged to a retired generation (the engine may drop it)."""
        with self.cond:
            if slot in self.retired:
                self.retired.discard(slot)
                self.buffers.pop(slot, None)
                return False
            self.free.append(slot)
            self.cond.notify_all()
            return True

    @property
    def inflight(self) -> int:
        return len(self.buffers) - len(self.free)


class StopRun(BaseException):
    """Raised at the pre-step hook once `--max-steps` optimizer steps are done, or at the agreed
    step after SIGTERM/SIGINT. A BaseException, so the script's own `except Exception` does not
    swallow it; bootstrap then finishes the checkpoints as after a normal exit (the last step's
    state is complete: its scheduler stepped)."""

    def __init__(self, step: int, reason: str, signum: int | None = None) -> None:
        super().__init__(step, reason)
        self.step, self.reason, self.signum = step, reason, signum


class Runtime:
    def __init__(self, cfg: RunConfig, rank: int, local_rank: int, world_size: int, restart_count: int,
                 connect: Callable[..., EngineClient] = EngineClient):
        """`connect(address, authkey, on_event)` opens the engine connection (tests pass an in-process fake)."""
        self.cfg, self.rank, self.local_rank = cfg, rank, local_rank
        self.world_size, self.restart_count = world_size, restart_count
        self.step = 0
        self.optimizers: list[torch.optim.Optimizer] = []
        self.models: dict[str, torch.nn.Module] = {}
        self.replicated: list[torch.nn.parallel.DistributedDataParallel] = []  # (`_replicated_params`)
        self.schedulers: list[Any] = []
        self.scalers: list[Any] = []
        self.tracked: dict[str, Any] = {}
        self._generators: dict[str, torch.Tensor] = {}  # tracked Generators as of the last step
        self.resume: ResumeState | None = None
        self.recovery_started: float | None = None  # set on resume: time to the first resumed step
        self.restore_s = 0.0  # of it, ckptrun's own restore: decide, read, validate, load, replay
        self.setup_s: float | None = None  # of it, process start and the script's set-up up to its first optimizer
        self.replaying = False  # optimizer steps taken by replay are not training steps
        self.checkpointed_step: int | None = None  # newest step committed already or captured by this run
        self.stop_signal: int | None = None  # SIGTERM/SIGINT received: stop at the agreed step
        self._stop_at: int | None = None
        self._stopping: tuple[str, int | None] | None = None  # (why, signal): stop before the next step
        self.script_resumes = False  # the script asked ckptrun.resume_step() (it starts its loop there)
        self._restart_checked = False
        self.optimizer_info: dict[str, dict] = {}
        self.metrics = WorkerMetrics(cfg.metrics_dir, rank)
        self.fault = faults.from_env(rank, restart_count)
        self.retuner, self.interval = decisions.for_runtime(self)
        self._optim_t0 = 0.0
        self.update_s = 0.0  # this step's update time a strategy hook spent (split updates)
        self.slots = SlotPool()
        self.budget = Budget(cfg.host_memory, node=cfg.host_memory_node, nlocal=cfg.host_memory_nlocal,
                             source=cfg.host_memory_source)
        self._nslots = cfg.max_inflight  # staging slots per generation: --max-inflight, or fewer by the budget
        self._least_staging = 0  # the fewest staging bytes this run could have done with so far
        self.lost = threading.Event()
        # Steps a submit waits to see durable (or failed): an entry is dropped when its step's
        # Durable/SaveError arrives (the waiter holds the Event), so this holds at most the
        # checkpoints waited for, never one entry per step of the run.
        self.durable: dict[int, threading.Event] = {}
        self.save_errors: list[str] = []
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="ckptrun-snapshot")
        self._last_copy: Future | None = None  # the newest background copy (wait_copies)
        self._last_event: Any = None  # its CUDA counterpart
        self._volatile: set[int] = set()
        self._sizes: dict[str, int] = {}  # bytes the last submitted snapshot of each kind took
        self._buffer_keys: dict[str, list[str]] | None = None  # per model: its state_dict keys that are buffers
        self._lazy_ok: bool | None = None  # every such key names a module buffer (a lazy capture can take them)
        self._index_bytes = 0  # about the JSON index bytes of a full snapshot (the first one's)
        self._cuda = torch.cuda.is_available()
        self._stream = None
        self.client = connect(cfg.engine_address(local_rank), bytes.fromhex(cfg.authkey), self._on_event)
        hello = self.client.request(Hello(
            rank=rank, world_size=world_size, restart_count=restart_count, dir=cfg.dir, keep=cfg.keep,
            strategy=cfg.strategy, engine_handler=REGISTRY[cfg.strategy].engine_handler, writers=cfg.writers,
            io_threads=cfg.io_threads,
            fault=self.fault.text if self.fault else None, io_engine=cfg.io_engine))
        self.engine_pid = hello["pid"]
        if hello["slots"]:
            self.slots.add(hello["slots"], pin=self._cuda)
            self._least_staging = sum(n for _, _, n in hello["slots"])
            self._staging_used()

        self.strategy = REGISTRY[cfg.strategy].load()(StrategyContext(self))

    # ---- engine events (receiver thread) -----------------------------------------------
    def _on_event(self, msg: Message) -> None:
        if isinstance(msg, SlotFree):
            if not self.slots.release(msg.slot):
                self.client.send(Retire(slots=[msg.slot]))
                self._staging_used()
        elif isinstance(msg, Durable):  # this rank's bytes are on disk; the step counts once committed
            self._settled(msg.step)
            self.retuner.observe_write(msg.nbytes, msg.write_s)
        elif isinstance(msg, Committed):
            self.metrics.last_durable_step = max(self.metrics.last_durable_step or 0, msg.step)
            self.metrics.emit(type="persist_done", step=msg.step)
        elif isinstance(msg, InMemory):
            self.metrics.last_memory_step = msg.step
        elif isinstance(msg, SaveError):
            self.save_errors.append(f"step {msg.step}: {msg.error}")
            log.warning(f"rank {self.rank}: checkpoint of step {msg.step} failed: {msg.error}; "
                        "training goes on, the last committed step stays valid")
            self._settled(msg.step)
        elif isinstance(msg, FaultKill):
            faults.die()
        elif isinstance(msg, ConnectionLost):
            self.lost.set()
            with self.slots.cond:
                self.slots.cond.notify_all()
            for ev in list(self.durable.values()):
                ev.set()
        self.strategy.on_event(msg) if hasattr(self, "strategy") else None

    def _settled(self, step: int) -> None:
        """Wake whoever waits for `step` to be durable and forget it (a Durable of a step nobody
        submitted through `submit`, e.g. a handler's own record, finds nothing)."""
        ev = self.durable.pop(step, None)
        if ev is not None:
            ev.set()

    def check_engine(self) -> None:
        if self.lost.is_set():
            raise EngineLost("checkpoint engine went away")
        if self.save_errors and self.cfg.on_save_error == "fail":
            raise CkptrunError(f"checkpoint failed ({self.save_errors[0]}) and --on-save-error=fail")

    # ---- hooks -------------------------------------------------------------------------
    @property
    def primary(self) -> torch.optim.Optimizer | None:
        return self.optimizers[0] if self.optimizers else None

    def pre_step_hook(self, optimizer, args, kwargs) -> tuple[tuple, dict] | None:
        """Before the primary optimizer's step. With `step(closure)` (Lightning, LBFGS), forward
        and backward run inside the step: the gradients are final only once the closure has
        returned, so the strategy's `before_step` runs there (the closure is wrapped)."""
        if self.replaying:
            return None
        if optimizer is not self.primary:
            if optimizer in self.optimizers:  # its update must not race a snapshot still being copied
                self.wait_copies()
            return None
        if self.cfg.max_steps and self.step >= self.cfg.max_steps:
            raise StopRun(self.step, "--max-steps")
        if self._stopping is not None:
            raise StopRun(self.step, *self._stopping)
        if self.resume is not None and not self.script_resumes and not self._restart_checked:
            self._restarted_from_the_top()
        self.check_engine()
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
        what = (f"the script does not call ckptrun.resume_step(), so its loop starts again from its first "
                f"iteration on top of the restored step {self.resume.step}")
        fix = ("make its loop start at ckptrun.resume_step(), or pass --on-restart fresh (restart from "
               "scratch)")
        if self.cfg.on_restart == "fail":
            raise CkptrunError(f"{what} (--on-restart fail); {fix}", exit_code=2)
        if self.rank == 0:
            log.warning(f"warning: {what}: it will take {self.resume.step} more optimizer steps than an "
                        f"uninterrupted run; {fix}")

    def _gradients_final(self, step: int) -> None:
        """The gradients optimizer step `step` consumes are final: the strategy may take them."""
        self._timed(self.strategy.before_step, step)
        if self.fault and self.fault.target == "kill" and self.fault.phase == "compute" \
                and self.fault.step == step:
            self.metrics.flush()
            faults.die()
        self._optim_t0 = time.perf_counter()

    def _wrap_closure(self, closure, step: int):
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
                    f"evaluated its closure {calls} times in step {step} (LBFGS-style); use --strategy checkfreq "
                    "or sync")
            return loss

        return wrapped

    def post_step_hook(self, optimizer, args, kwargs) -> None:
        if optimizer is not self.primary or self.replaying:
            return
        self.metrics.optim_s = time.perf_counter() - self._optim_t0 + self.update_s
        self.update_s = 0.0
        self.step += 1
        self._generators = {n: o.get_state() for n, o in self.tracked.items() if isinstance(o, torch.Generator)}
        if self.cfg.max_steps and self.step >= self.cfg.max_steps:
            self._stopping = ("--max-steps", None)
        elif self.stop_signal is not None and self._stop_here():
            self._stopping = (signal.Signals(self.stop_signal).name, self.stop_signal)
        self._timed(self.strategy.after_step, self.step)
        if self.recovery_started is not None:
            self.metrics.emit(type="restart", restart_count=self.restart_count,
                              resume_step=self.resume.step if self.resume else 0,
                              recovery_s=time.time() - self.recovery_started, restore_s=self.restore_s,
                              setup_s=self.setup_s)
            self.recovery_started = None
        self.metrics.inflight = self.slots.inflight
        if self.budget.limited:
            if self.budget.changed:  # what uses the budget, each time it moves (not every step)
                self.metrics.emit(type="host_memory", step=self.step, **self.budget.report())
            self.metrics.host_memory = (self.budget.total, self.budget.used)
        record = self.metrics.end_step(self.step)
        self.retuner.after_step(self.step, record)

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
        return self.interval.due(step)

    def stall(self, cause: str, since: float) -> None:
        self.metrics.add_stall(cause, time.perf_counter() - since)

    def _timed(self, hook, step: int) -> None:
        """Run a strategy hook; all the time it blocks training is stall. Whatever the inner timers
        (back-pressure, sync write) did not claim is the snapshot's (state building, copies, sends)."""
        claimed, update = sum(self.metrics.stall.values()), self.update_s
        t0 = time.perf_counter()
        hook(step)
        spent = time.perf_counter() - t0 - (self.update_s - update)
        self.metrics.add_stall("snapshot", max(0.0, spent - (sum(self.metrics.stall.values()) - claimed)))

    # ---- registration and restore ------------------------------------------------------
    def on_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """A torch.optim.Optimizer (subclass) was constructed. A wrapper that delegates to one
        already registered (accelerate's AcceleratedOptimizer, ZeRO-style wrappers: every
        parameter it updates is already another optimizer's) is the same logical optimizer: its
        steps run the inner one's, whose state is stored once."""
        known = {id(p) for o in self.optimizers for p in replay.optimizer_params(o)}
        params = replay.optimizer_params(opt)
        if known and params and all(id(p) in known for p in params):
            self.metrics.emit(type="optimizer_alias", cls=type(opt).__name__)
            return
        idx = len(self.optimizers)
        if not REGISTRY[self.cfg.strategy].sharded and any(sharded.is_dtensor(p) for p in params):
            able = ", ".join(n for n, e in REGISTRY.items() if e.sharded)
            raise CkptrunError(
                f"--strategy {self.cfg.strategy} cannot checkpoint sharded parameters (DTensor: FSDP2's fully_shard, "
                f"tensor parallel), and this script's {type(opt).__name__} updates some; use --strategy {able}")
        if idx > 0 and self.strategy.single_optimizer:
            raise CkptrunError(
                f"--strategy {self.cfg.strategy} replays one optimizer, and this script creates a second one "
                f"({type(opt).__name__} after {type(self.primary).__name__}); use --strategy checkfreq or sync, "
                "which checkpoint every optimizer")
        if self.strategy.single_optimizer and isinstance(opt, torch.optim.LBFGS):
            raise CkptrunError(
                f"--strategy {self.cfg.strategy} replays gradients, and LBFGS re-evaluates its closure several "
                "times per step (no one gradient to replay); use --strategy checkfreq or sync")
        self.optimizers.append(opt)
        if self.strategy.wants_grad_hooks:
            for group in opt.param_groups:
                for p in group["params"]:
                    p.register_post_accumulate_grad_hook(self.strategy.on_grad_ready)
        for m in discovery.owning_modules(opt):
            if all(m is not known for known in self.models.values()):
                self.models["model" if not self.models else f"model_{len(self.models)}"] = m
        self._volatile = discovery.module_buffers(list(self.models.values()))
        self._buffer_keys = self._lazy_ok = None
        self.optimizer_info[_indexed("optimizer", idx)] = self._describe(opt)
        orphans = discovery.orphan_params(opt, list(self.models.values()))
        if orphans:
            self.track(orphans_key(_indexed("optimizer", idx)), discovery.OrphanParams(orphans))
        self.metrics.emit(type="optimizer", index=idx, cls=type(opt).__name__,
                          param_bytes=sum(p.numel() * p.element_size() for g in opt.param_groups for p in g["params"]))
        if idx == 0 and self.recovery_started is not None:
            self.setup_s = time.time() - self.recovery_started - self.restore_s
        if self.resume is not None:
            self._restore(opt, idx)
        if idx == 0:
            self.strategy.on_ready(self.step)

    def _describe(self, opt: torch.optim.Optimizer) -> dict:
        """What offline replay needs: the optimizer class and each parameter's state_dict keys."""
        aliases: dict[int, list[list[str]]] = {}
        for name, m in self.models.items():
            for key, p in m.named_parameters(remove_duplicate=False):
                aliases.setdefault(id(p), []).append([name, key])
        cls = type(opt)
        return {"class": f"{cls.__module__}.{cls.__qualname__}",
                "params": [aliases.get(id(p), []) for p in replay.optimizer_params(opt)]}

    def _restore(self, opt: torch.optim.Optimizer, idx: int) -> None:
        t0 = time.perf_counter()
        try:
            self._load_into(opt, idx)
        except CorruptCheckpoint as e:  # a record read for replay failed its checks: past the script's handlers
            raise AbortRun(e) from None
        finally:
            self.restore_s += time.perf_counter() - t0

    def _load_into(self, opt: torch.optim.Optimizer, idx: int) -> None:
        saved = self.resume.state
        for name, model in self.models.items():
            if name in self.resume.restored:
                continue
            if name not in saved["models"]:
                raise CheckpointMismatch(f"checkpoint {self.resume.record} has no {name!r}; "
                                         "use another --dir or --no-resume")
            self._load_model(name, model, saved["models"][name])
            self.resume.restored.add(name)
        oname = _indexed("optimizer", idx)
        if oname in saved["optimizers"]:
            opt.load_state_dict(sharded.optimizer_state(saved["optimizers"][oname], replay.optimizer_params(opt)))
        if idx != 0:
            return
        if self.resume.diffs is not None:
            self.replaying = True
            t0 = time.perf_counter()
            try:
                last = replay.replay(opt, self.resume.diffs)
            finally:
                self.replaying = False
            self.retuner.observe_replay(self.resume.step - int(self.resume.record.split("-")[-1]),
                                        time.perf_counter() - t0)
            for name, model in self.models.items():
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
                f"checkpoint dir {self.cfg.dir} holds another model ({name}: {what}); "
                "pass a new --dir, or --no-resume after removing it")
        model.load_state_dict(saved)

    def on_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """A DDP wrapper was created: the parameters it synchronises (and the optimizer state over
        them) are the same on every rank, so they may be written once (`_write_once`). Its all-reduce
        bucket layout is tracked (worker/ddp_buckets.py)."""
        self.replicated.append(ddp)
        if not ddp.static_graph:  # (its bucket layout, restored before the script registers a comm hook)
            self.track(f"{DDP_BUCKETS}{len(self.replicated) - 1}", BucketLayout(ddp))
        self.strategy.on_ddp(ddp)

    def on_scheduler(self, sched: Any) -> None:
        idx = len(self.schedulers)
        self.schedulers.append(sched)
        if self.resume and idx < len(self.resume.state["schedulers"]):
            sched.load_state_dict(self.resume.state["schedulers"][idx])
            self._reapply_hyperparams(sched.optimizer)

    def _reapply_hyperparams(self, opt: torch.optim.Optimizer) -> None:
        """A scheduler's constructor re-sets the lr; put back the checkpointed values. Its optimizer
        may be a wrapper around a registered one (HF Trainer builds its scheduler on accelerate's
        AcceleratedOptimizer): the values go to the registered optimizer it updates."""
        if opt not in self.optimizers:
            params = {id(p) for p in replay.optimizer_params(opt)}
            opt = next((o for o in self.optimizers if params <= {id(p) for p in replay.optimizer_params(o)}), None)
            if opt is None:
                return
        saved = self.resume.state["optimizers"].get(_indexed("optimizer", self.optimizers.index(opt)))
        if saved:
            for group, sgroup in zip(opt.param_groups, saved["param_groups"], strict=True):
                group.update({k: v for k, v in sgroup.items() if k != "params"})

    def on_scaler(self, scaler: Any) -> None:
        idx = len(self.scalers)
        self.scalers.append(scaler)
        if self.resume and idx < len(self.resume.state["scalers"]):
            scaler.load_state_dict(self.resume.state["scalers"][idx])

    def track(self, name: str, obj: Any) -> None:
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")) \
                and not isinstance(obj, torch.Generator):
            raise TypeError(f"ckptrun.track({name}=...): needs state_dict()/load_state_dict() "
                            f"or a torch.Generator, got {type(obj).__name__}")
        self.tracked[name] = obj
        extra = self.resume.state.get("extra", {}) if self.resume else {}
        if name in extra:
            if isinstance(obj, torch.Generator):
                obj.set_state(extra[name])
            else:
                obj.load_state_dict(extra[name])

    # ---- capture -----------------------------------------------------------------------
    def early_state(self, taken: dict | None = None) -> dict:
        """Parameters, optimizer state, buffers and RNG; `taken`: buffers and RNG taken earlier
        (`_volatile_now`), in place of the live ones."""
        models = {n: m.state_dict() for n, m in self.models.items()}
        if taken is not None:
            models = {n: {k: taken["buffers"][n].get(k, v) for k, v in sd.items()} for n, sd in models.items()}
        return {
            "models": models,
            "optimizers": {_indexed("optimizer", i): o.state_dict() for i, o in enumerate(self.optimizers)},
            "rng": discovery.rng_state() if taken is None else taken["rng"],
        }

    def late_state(self) -> dict:
        """State the script updates after optimizer.step(): schedulers (and the lr they set in
        the optimizer's param_groups), scalers, tracked objects. A tracked Generator is an RNG
        state: it is taken as it was right after the step, before the next batch drew from it."""
        return {
            "param_groups": {_indexed("optimizer", i): o.state_dict()["param_groups"]
                             for i, o in enumerate(self.optimizers)},
            "schedulers": [s.state_dict() for s in self.schedulers],
            "scalers": [s.state_dict() for s in self.scalers],
            "extra": {n: (self._generators.get(n, o.get_state()) if isinstance(o, torch.Generator)
                          else o.state_dict()) for n, o in self.tracked.items()},
        }

    def _ensure_slots(self, need: int) -> None:
        """Make the slots hold `need` bytes; with none yet (a fresh engine), allocate some anyway,
        so that a snapshot of unknown size has a slot to start in and grow from."""
        if self.slots.buffers and need <= self.slots.nbytes:
            return
        self.check_engine()
        size = align(int(need * 1.25) + ALIGN)
        self._nslots = self._slots_within_budget(size)
        old = self.slots.inflight * self.slots.nbytes  # the old generation's slots still in flight
        reply = self.client.request(Alloc(nslots=self._nslots, nbytes=size))
        retire = self.slots.add(reply["slots"], pin=self._cuda)
        if retire:
            self.client.send(Retire(slots=retire))
        least = self.cfg.max_inflight if self.cfg.max_inflight_given else min(self.cfg.max_inflight,
                                                                              self.strategy.min_slots)
        self._least_staging = max(self._least_staging, size * least + old)
        self._staging_used()

    def _staging_used(self) -> None:
        """The slots mapped now (this generation and old ones not yet back) as the budget's use;
        the least it could do with: the fewest slots of this size, plus the old slots in flight
        when they grew."""
        with self.slots.cond:
            mapped = sum(b.numel() for b in self.slots.buffers.values())
        self.budget.set(STAGING, mapped, least=self._least_staging)

    def _slots_within_budget(self, size: int) -> int:
        """How many slots of `size` bytes the next generation gets: --max-inflight, fewer when the
        budget cannot hold them (an explicit --max-inflight that does not fit is refused). Slots of
        the old generation still in flight count until they come back."""
        want, least = self.cfg.max_inflight, min(self.cfg.max_inflight, self.strategy.min_slots)
        old = self.slots.inflight * self.slots.nbytes
        room = self.budget.room(STAGING) - old
        if want * size <= room or not self.budget.limited:
            return want
        beside = f", beside {fmt(old)} of older slots still in flight" if old else ""
        if self.cfg.max_inflight_given:
            self.budget.refuse(f"--max-inflight {want}", f"staging ({want} slots of {fmt(size)}{beside})",
                               want * size + old)
        fit = max(least, room // size)
        if fit * size > room:  # other uses that can shrink (an auto batch) do so at their next decision
            room = self.budget.room_least(STAGING) - old
        if fit * size > room:
            self.budget.refuse(f"--strategy {self.cfg.strategy}",
                               f"staging (at least {least} slot{'s' if least > 1 else ''} of {fmt(size)}{beside})",
                               least * size + old)
        line = (f"host-memory budget decided: {fit} staging slot{'s' if fit > 1 else ''} of {fmt(size)} in flight "
                f"instead of --max-inflight {want} ({self.budget.describe()})")
        if self.budget.decide("max_inflight", line):
            log.info(line) if self.rank == 0 else None
            self.metrics.emit(type="budget_decided", setting="max_inflight", value=fit, reason=line)
        return fit

    def begin(self, step: int, kind: str = "full", need: int = 0, prefix: str = "") -> Snapshot:
        """Take a free staging slot for `step` (back-pressure: wait while none is free), big
        enough for `need` bytes and for what the last snapshot of this `kind` took; a snapshot
        that still outgrows it moves to a larger slot."""
        self._ensure_slots(max(need, self._sizes.get(kind, 0)))
        t0 = time.perf_counter()
        slot = self.slots.acquire(self.lost)
        self.stall("backpressure", t0)
        return Snapshot(step, slot, {}, Layout((), 0), time.time(), prefix=prefix, kind=kind)

    def index_hint(self) -> int:
        """About the bytes of a full checkpoint's JSON index: its tensors' entries and the
        skeleton of the last full snapshot (sizes a region's metadata area)."""
        return self._index_bytes or 64 << 10

    def use_interval(self, policy: decisions.IntervalPolicy) -> None:
        """A strategy's own `--every auto` rule replaces the run's (Daly's)."""
        self.retuner.policies.remove(self.interval)
        self.interval = self.retuner.add(policy)

    def add(self, snap: Snapshot, state: dict, *, background: bool = False, write_once: bool = False) -> None:
        """Append `state` to the slot. With `background`, tensors other than module buffers
        (which the next forward changes) are copied off the training thread (a side stream on GPU).
        With `write_once`, replicated tensors another rank writes are left out (`_write_once`;
        which rank writes which turns with the step)."""
        flat = flatten(state, snap.prefix)
        self._append(snap, *(self._write_once(*flat, rotate=snap.step) if write_once else flat), background=background)

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

    def reserve(self, snap: Snapshot, skeleton: dict, like: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
        """Lay out places for tensors shaped like `like` after what `snap` holds (`skeleton`
        names them), to be filled later by `put`; returns each key's place."""
        layout = Layout.of(like, start=snap.layout.nbytes)
        if layout.nbytes > self._buffer(snap).numel():
            self.wait_copy(snap)
            self._move_to_larger_slot(snap, layout.nbytes)
        snap.skeleton.update(skeleton)
        snap.layout = snap.layout + layout
        snap.nbytes = snap.layout.nbytes
        return {spec.key: spec for spec in layout.specs}

    def put(self, snap: Snapshot, places: list[tuple[TensorSpec, torch.Tensor]]) -> None:
        """Copy each tensor into its reserved place off the training thread (one job), after the
        copies queued before it (so a later `put` of the same place wins)."""
        if not places:
            return
        specs = tuple(spec for spec, _ in places)
        layout = Layout(specs, max(spec.offset + spec.nbytes for spec in specs))
        tensors = {spec.key: t for spec, t in places}
        if any(t.is_cuda for t in tensors.values()):
            snap.event = self._last_event = self._copy_cuda_async(self._buffer(snap), layout, tensors)
        else:
            snap.copy = self._last_copy = self._copier.submit(self._copy, self._buffer(snap), layout, tensors)

    def fetch_held(self, step: int, nbytes: int) -> ResumeState:
        """The state of `step` the engine holds in memory, read from the shared-memory file it
        keeps it in: a restart that reads nothing from disk and copies once. Model tensors stay
        views of that file (`load_state_dict` copies them into the model before the engine may
        change it, at the next step's gradients); the rest is cloned (an optimizer keeps the
        tensors it loads)."""
        body = self.client.request(FetchHeld())
        if "error" in body:
            raise CkptrunError(f"the checkpoint engine could not hand over step {step} from memory ({body['error']})")
        buf = torch.from_file(body["path"], shared=True, size=max(1, nbytes), dtype=torch.uint8)
        tensors = {k: view(buf, TensorSpec.from_json(k, t)) for k, t in body["tensors"].items()}
        tensors = {k: t if k.startswith("models/") else t.clone() for k, t in tensors.items()}
        if not body.get("exact", True) and self.rank == 0:
            log.warning(f"warning: resumed step {step} from the engine's CPU replica: it was updated on the CPU "
                        "and may differ from the device's own arithmetic by rounding (re-based from a real "
                        "snapshot every --rebase-every steps)")
        return ResumeState(body["step"], "memory", unflatten(body["skeleton"], tensors), self.world_size,
                           source="memory")

    def _buffer(self, snap: Snapshot) -> torch.Tensor:
        return snap.buf if snap.buf is not None else self.slots.buffers[snap.slot]

    def _append(self, snap: Snapshot, skeleton: Any, tensors: dict[str, torch.Tensor], *, background: bool) -> None:
        """Lay `tensors` out after what the snapshot holds and copy them. A background append
        queues behind the snapshot's earlier copies (one FIFO copier: progress stays in order);
        a synchronous one waits for them first."""
        layout = Layout.of(tensors, start=snap.layout.nbytes)
        if layout.nbytes > self._buffer(snap).numel():
            self.wait_copy(snap)
            self._move_to_larger_slot(snap, layout.nbytes)
        elif not background:
            self.wait_copy(snap)
        buf = self._buffer(snap)
        now = {k: t for k, t in tensors.items() if not background or t.data_ptr() in self._volatile}
        self._copy(buf, layout, now)
        later = {k: t for k, t in tensors.items() if k not in now}
        if later and any(t.is_cuda for t in later.values()):
            snap.event = self._last_event = self._copy_cuda_async(buf, layout, later, snap.progress)
        elif later:
            snap.copy = self._last_copy = self._copier.submit(self._copy, buf, layout, later, snap.progress)
        elif snap.progress is not None and background:  # after the copies still queued
            snap.copy = self._last_copy = self._copier.submit(snap.progress, layout.nbytes)
        elif snap.progress is not None:
            snap.progress(layout.nbytes)
        snap.skeleton.update(skeleton)
        snap.layout = snap.layout + layout
        snap.nbytes = snap.layout.nbytes

    def _move_to_larger_slot(self, snap: Snapshot, need: int) -> None:
        """The state outgrew its slot (or the strategy's buffer) mid-snapshot: carry what is
        written into a bigger staging slot."""
        self._ensure_slots(need)
        t0 = time.perf_counter()
        slot = self.slots.acquire(self.lost)
        self.stall("backpressure", t0)
        old, old_buf = snap.slot, self._buffer(snap)
        self.slots.buffers[slot][: snap.layout.nbytes].copy_(old_buf[: snap.layout.nbytes])
        snap.slot, snap.buf = slot, None
        if old >= 0 and snap.progress is None and not self.slots.release(old):
            self.client.send(Retire(slots=[old]))

    def capture(self, step: int, *, background: bool,
                stream: Callable[[Snapshot], Callable[[int], None]] | None = None,
                into: Callable[[int], torch.Tensor | None] | None = None,
                order: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
                lazy: bool = False, whole: bool = False) -> Snapshot:
        """Copy the post-step state of `step` (parameters, optimizer state, buffers, RNG) into a
        free slot; `seal` adds what settles later. `stream(snap)` (called once the slot is taken)
        returns a callback told each time the slot's first N bytes are final, so the engine can
        persist them while the rest is still being copied (a chunked pipeline). `order` puts the
        tensors in the order they are laid out and copied; `into(nbytes)` gives the buffer to
        copy them into instead of a staging slot (None: a staging slot after all). `lazy` (with
        `background`, without `into`): see `_capture_lazily`. `whole`: replicated tensors too,
        even where another rank writes them (an engine keeping the state leaves them out itself)."""
        if lazy and background and into is None and self._can_be_lazy():
            return self._capture_lazily(step, stream, order)
        flat = flatten(self.early_state())
        skeleton, tensors = flat if whole else self._write_once(*flat)
        if order is not None:
            tensors = order(tensors)
        need = Layout.of(tensors).nbytes
        t0 = time.perf_counter()
        buf = into(need) if into is not None else None
        if buf is not None:
            self.stall("backpressure", t0)
            snap = Snapshot(step, -1, {}, Layout((), 0), time.time(), kind="full", buf=buf)
        else:
            snap = self.begin(step, "full", need)
        if stream is not None:
            snap.progress = stream(snap)
        self._append(snap, skeleton, tensors, background=background)
        self.metrics.last_snapshot_step = self.checkpointed_step = step
        return snap

    def _write_once(self, skeleton: Any, tensors: dict[str, torch.Tensor],
                    rotate: int = 0) -> tuple[Any, dict[str, torch.Tensor]]:
        """Leave out the replicated tensors another rank writes (storage/writeonce.py), when the
        strategy supports it. Replicated are exactly the parameters of DDP's modules, their
        gradients at the optimizer step (all-reduced by then) and the optimizer state tensors
        over them, found by storage (data_ptr, shape, dtype), not by name: anything else
        (buffers, which DDP syncs only in the next forward; RNG; tracked objects) is per rank."""
        if not self._writes_once():
            return skeleton, tensors
        params = self._replicated_params()
        same = {_ident(p) for p in params.values()} | {_ident(p.grad) for p in params.values() if p.grad is not None}
        for opt in self.optimizers:
            for p in replay.optimizer_params(opt):
                if params.get(p.data_ptr()) is p:
                    same |= {_ident(v) for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)}
        return writeonce.split(skeleton, tensors, [k for k, t in tensors.items() if _ident(t) in same], self.rank,
                               self.world_size, rotate)

    def _replicated_params(self) -> dict[int, torch.Tensor]:
        """The parameters DDP keeps identical on every rank, by data pointer: those of its
        wrappers' modules, less any it was told to ignore (`_ddp_params_and_buffers_to_ignore`),
        which each rank trains on its own."""
        return {p.data_ptr(): p for ddp in self.replicated for name, p in ddp.module.named_parameters()
                if name not in ddp.parameters_to_ignore}

    def _writes_once(self) -> bool:
        return self.world_size > 1 and bool(self.replicated) and REGISTRY[self.cfg.strategy].write_once

    def replicated_positions(self) -> list[int]:
        """Positions of the primary optimizer's parameters that DDP keeps identical on every rank,
        when replicated state is written once (else none)."""
        if not self._writes_once() or self.primary is None:
            return []
        params = self._replicated_params()
        return [i for i, p in enumerate(replay.optimizer_params(self.primary)) if params.get(p.data_ptr()) is p]

    def _can_be_lazy(self) -> bool:
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

    def _volatile_now(self) -> dict:
        """What the next forward changes: module buffers (copied now) and RNG."""
        with torch.no_grad():
            buffers = {n: {k: self.models[n].get_buffer(k).detach().clone() for k in keys}
                       for n, keys in self.buffer_keys().items()}
        return {"buffers": buffers, "rng": discovery.rng_state()}

    def _capture_lazily(self, step: int, stream: Callable | None, order: Callable | None) -> Snapshot:
        """DataStates-LLM's lazy capture: only what the next forward changes (buffers, RNG) is taken
        on the training thread; the parameters and optimizer state, immutable until the next
        update, are gathered (state_dicts, skeleton, layout, a staging slot) and copied on the
        copier thread while the forward/backward runs. `wait_copy` is where the update waits."""
        snap = Snapshot(step, -1, {}, Layout((), 0), time.time(), kind="full")
        taken = self._volatile_now()
        if self._cuda and torch.cuda.is_initialized():  # where the trainer's stream has step t's state, and its device
            taken["ready"] = torch.cuda.Event()
            taken["ready"].record()
            taken["device"] = torch.cuda.current_device()
        snap.copy = self._last_copy = self._copier.submit(self._fill, snap, taken, stream, order, True)
        self.metrics.last_snapshot_step = self.checkpointed_step = step
        return snap

    def _fill(self, snap: Snapshot, taken: dict, stream: Callable | None, order: Callable | None,
              off_thread: bool) -> None:
        """Gather and copy a lazy snapshot. Read off the training thread, a module dict that the
        forward changes meanwhile (a buffer registered on the fly) fails the read: it is then
        done again at `wait_copy`, before the update (the state is still the step's then)."""
        try:
            skeleton, tensors = self._write_once(*flatten(self.early_state(taken)))
        except RuntimeError:
            if not off_thread:
                raise
            snap.retry = (taken, stream, order)
            return
        if order is not None:
            tensors = order(tensors)
        layout = Layout.of(tensors)
        self._ensure_slots(max(layout.nbytes, self._sizes.get(snap.kind, 0)))
        snap.slot = self.slots.acquire(self.lost)  # (no free slot: the update waits at `wait_copy`)
        snap.skeleton, snap.layout, snap.nbytes = skeleton, layout, layout.nbytes
        if stream is not None:
            snap.progress = stream(snap)
        if any(t.is_cuda for t in tensors.values()):
            with torch.cuda.device(taken["device"]):  # (this thread's own current device is not the trainer's)
                snap.event = self._last_event = self._copy_cuda_async(self._buffer(snap), layout, tensors,
                                                                      snap.progress, after=taken["ready"])
        else:
            self._copy(self._buffer(snap), layout, tensors, snap.progress)

    @staticmethod
    def _copy(buf: torch.Tensor, layout: Layout, tensors: dict[str, torch.Tensor],
              progress: Callable[[int], None] | None = None) -> None:
        """Copy `tensors` into their places; `progress(end)` after each one (layout order: with
        the tensors copied earlier, everything before `end` is then in the slot)."""
        with torch.no_grad():
            for spec in layout.specs:
                if spec.key in tensors:
                    view(buf, spec).copy_(tensors[spec.key])
                    if progress is not None:
                        progress(spec.offset + spec.nbytes)
        if progress is not None:
            progress(layout.nbytes)

    def _copy_cuda_async(self, buf: torch.Tensor, layout: Layout, tensors: dict[str, torch.Tensor],
                         progress: Callable[[int], None] | None = None, after: Any = None):
        """Device-to-host copies on a side stream into the pinned slot; returns their event. With
        `progress`, an event per tensor is waited on by the copier thread, which reports each.
        The copies start after the work queued so far on the current stream, or after the event
        `after` (recorded by the training thread when the state was final: a lazy capture)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        if after is not None:
            self._stream.wait_event(after)
        else:
            self._stream.wait_stream(torch.cuda.current_stream())
        marks = []
        with torch.no_grad(), torch.cuda.stream(self._stream):
            for spec in layout.specs:
                if spec.key in tensors:
                    view(buf, spec).copy_(tensors[spec.key], non_blocking=True)
                    if progress is not None:
                        marks.append((torch.cuda.Event(), spec.offset + spec.nbytes))
                        marks[-1][0].record(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        if progress is not None:
            def report() -> None:
                for mark, end in marks:
                    mark.synchronize()
                    progress(end)
                event.synchronize()
                progress(layout.nbytes)

            self._last_copy = self._copier.submit(report)
        return event

    def wait_copies(self) -> None:
        """Block until every background copy started so far is done: the newest one is the last
        to finish (one FIFO copier thread; on GPU, one side stream)."""
        if self._last_copy is not None:
            self._last_copy.result()
        if self._last_event is not None:
            self._last_event.synchronize()

    def wait_copy(self, snap: Snapshot) -> None:
        """Block until the slot holds `snap`'s post-step state (the next update may then run).
        The first time, that is "snapshot done": recorded, apart from "persist done" (committed)."""
        if snap.copy is not None:
            snap.copy.result()
            snap.copy = None
        if snap.retry is not None:
            args, snap.retry = snap.retry, None
            self._fill(snap, *args, off_thread=False)
        if snap.event is not None:
            snap.event.synchronize()
            snap.event = None
        if snap.done_at is None:
            snap.done_at = time.time()
            self.metrics.last_snapshot_done = max(self.metrics.last_snapshot_done or 0, snap.step)
            self.metrics.emit(type="snapshot_done", step=snap.step, snapshot_s=snap.done_at - snap.time)

    def discard(self, snap: Snapshot) -> None:
        """Give up a snapshot that will not be submitted: its slot goes back to the pool."""
        self.wait_copy(snap)
        if snap.slot >= 0 and not self.slots.release(snap.slot):
            self.client.send(Retire(slots=[snap.slot]))

    def seal(self, snap: Snapshot, *, wait: bool = True) -> None:
        """Add the state that settles after the step: schedulers, scaler, tracked objects, and
        the optimizer's param_groups (a scheduler has set their lr by now); then wait for the
        copies, unless `wait` is False (the late tensors are cloned now and copied after the
        snapshot's earlier copies; the strategy then learns of the end through `progress`)."""
        if wait:
            self.add(snap, self.late_state())
            self.wait_copy(snap)
        else:
            skeleton, tensors = flatten(self.late_state(), snap.prefix)
            self._append(snap, skeleton, {k: t.detach().clone() for k, t in tensors.items()}, background=True)
        if "optimizers" in snap.skeleton:
            for name, groups in snap.skeleton.pop("param_groups").items():
                snap.skeleton["optimizers"][name]["param_groups"] = groups

    def record_meta(self, snap: Snapshot) -> dict:
        return {"step": snap.step, "rank": self.rank, "world_size": self.world_size,
                "strategy": self.cfg.strategy, "snapshot_time": snap.time, "snapshot_done_at": snap.done_at,
                "optimizers": self.optimizer_info}

    def submit(self, snap: Snapshot, message: type[Persist] = Persist, *, wait_durable: bool = False,
               layout: str = "records", **fields: Any) -> None:
        """Hand a sealed slot to the engine: by default `Persist` it as the full checkpoint of its
        step; a strategy's own `message` (a Persist subclass with `fields`) goes to its engine-side
        handler."""
        self.check_engine()
        killed_mid_write = bool(self.fault and self.fault.target == "kill" and self.fault.phase == "write"
                                and self.fault.step == snap.step and not wait_durable)
        # Only a step someone waits for is registered (before it is sent, so its Durable finds it):
        # a handler may never report some steps durable one by one (lowdiff's batched diffs).
        done = self.durable.setdefault(snap.step, threading.Event()) if wait_durable or killed_mid_write else None
        spec = RecordSpec(record=full_name(snap.step), kind="full", step=snap.step,
                          skeleton=snap.skeleton if layout == "records" else {},
                          tensors={s.key: s.to_json() for s in snap.layout.specs}, meta=self.record_meta(snap),
                          layout=layout)
        self.client.send(message(slot=snap.slot, nbytes=snap.nbytes, spec=spec, **fields))
        # A stream callback usually refers to its snapshot (its step, its slot): a cycle that only
        # the rare full garbage collection frees, with the step's state in it. The copies still
        # queued hold the callback themselves.
        snap.progress = None
        self.metrics.bytes += snap.nbytes
        self._sizes[snap.kind] = snap.nbytes
        if snap.kind == "full" and not self._index_bytes:
            self._index_bytes = 200 * len(snap.layout.specs) + len(json.dumps(snap.skeleton, default=str))
        self.retuner.observe_snapshot(snap.kind, fields.get("disk_nbytes", snap.nbytes))  # what is written
        if killed_mid_write:
            done.wait()  # the engine kills us mid-write (fault_kill) before this returns
        if wait_durable:
            t0 = time.perf_counter()
            done.wait()
            self.stall("sync_write", t0)
            self.check_engine()

    def drain(self) -> None:
        """Wait until the engine holds nothing of ours unwritten."""
        if not self.lost.is_set():
            self.client.request(Flush())

    def finish(self) -> None:
        if not self.optimizers:
            raise no_optimizer("the script never created a torch.optim optimizer")
        self.strategy.finish()
        self.drain()
        if self.metrics.last_memory_step is not None:  # reached after the last step's record
            self.metrics.emit(type="in_memory", step=self.metrics.last_memory_step)
        self.metrics.close()
        self.client.send(Bye()) if not self.lost.is_set() else None
        self.client.close()


def _ident(t: torch.Tensor) -> tuple:
    """What makes two tensors the same values in memory (a state_dict entry is its parameter detached)."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device


def _indexed(base: str, i: int) -> str:
    return base if i == 0 else f"{base}_{i}"


def install(rt: Runtime) -> None:
    """Make `rt` the process runtime and hook every optimizer's step."""
    global _current
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from . import patches

    _current = rt
    register_optimizer_step_pre_hook(rt.pre_step_hook)
    register_optimizer_step_post_hook(rt.post_step_hook)
    patches.install(rt)
