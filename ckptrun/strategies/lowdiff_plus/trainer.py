"""`lowdiff+` (LowDiff+, §VI): gradients reused layer by layer as in-memory checkpoints.

During backward, each parameter's gradient is copied into the next step's staging slot as soon
as it is accumulated (`on_grad_ready`, a post-accumulate-grad hook), off the training thread (a
side stream on GPU), so the copies overlap the rest of the backward pass. Clipping and
GradScaler unscaling multiply them all by one coefficient afterwards: the engine is sent the
coefficient (`on_grad_scale`). At the optimizer's pre-step hook a gradient the script changed
otherwise after its hook fired (a replaced `.grad`, other in-place changes) is copied again: a
tensor's version counter says whether it was written since, so what the engine gets is what
the optimizer consumed. Under DDP (the all-reduce rewrites them) or when most are copied again,
the copies are all taken at the pre-step. The post-step hook adds module buffers and RNG; the next pre-step
seals the slot with schedulers/scaler/tracked state and hands it to the engine, which applies it
to its CPU replica with the same optimizer class (`engine.py`) while the next step trains.

A real full snapshot starts the replica (and replaces it every --rebase-every steps); after a
worker crash the engine's replica is the resume point (no disk read).
"""

from __future__ import annotations

import time

import psutil
import torch

from ...errors import CkptrunError
from ...ipc.messages import Message, SaveError
from ...log import log
from ...restore.recovery import optimizer_classes
from ...restore.replay import optimizer_params
from ...storage.layout import Layout, TensorSpec
from ...storage.tree import TENSOR, flatten
from ..base import Strategy
from ..context import Snapshot, StrategyContext
from ..memory_first import REPLICA_PERSIST_EVERY
from ..memory_first.model import HW_SHARE
from ..memory_first.policy import PersistInterval
from . import HW_FAILURE_SHARE, REBASE_EVERY
from .messages import Base, Grads

GPU_REBASE_EVERY = 100
PROBE_EVERY = 50  # steps between tries of the layer-wise copy while it is off
STATES_PER_PARAM = 2  # optimizer state tensors per parameter assumed before they exist (Adam's two moments)


class LowDiffPlus(Strategy):
    min_slots = 2  # the base snapshot and a step's gradients
    name = "lowdiff+"
    single_optimizer = True
    wants_grad_hooks = True
    every_step = True

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        opts = ctx.options
        hw_share = HW_FAILURE_SHARE.share(opts) or opts.get("memory_lost_share", HW_SHARE)
        self.persist = ctx.policy(PersistInterval(REPLICA_PERSIST_EVERY.integer(opts), hw_share))
        self.rebase_every = REBASE_EVERY.integer(opts)  # None: auto
        self.params: list[torch.Tensor] = []
        self.position: dict[int, int] = {}  # id(param) -> its index among the optimizer's parameters
        self.keys: list[str] = []  # each parameter's gradient's tensor key in the diff
        self.skeleton: dict = {}  # of the gradients' places in a diff
        self.like: dict[str, torch.Tensor] = {}  # a tensor shaped like each gradient (the parameter)
        self.filling: Snapshot | None = None  # the next step's diff, filled during its backward
        self.places: dict[str, TensorSpec] = {}
        self.copied: dict[int, tuple[torch.Tensor, int]] = {}  # index -> (gradient, its version) at the copy
        self.scales: list[dict] = []  # clipping since the copies: {"coef": 0-d tensor, "params": [index]}
        self.taken: Snapshot | None = None  # this step's diff, between its update and the next pre-step
        self.pending: tuple[Snapshot, bool] | None = None  # (sealed at the next pre-step, persist it)
        self.pending_base: tuple[Snapshot, bool] | None = None  # (a full snapshot, write it too)
        self.rebase = False  # the engine dropped its replica (a failed update): send a full snapshot
        self.recopied = 0  # gradient bytes copied again at a pre-step (changed after backward)
        self.layerwise = True  # copy in backward; off while the script changes most gradients after it
        self.off_since = 0
        self.recopied_logged = False
        self.under_ddp = False

    def settings(self) -> dict:
        return {**self.persist.settings, "auto": self.persist.adjustable, "rebase_every": self._rebase_every()}

    def _rebase_every(self) -> int:
        if self.rebase_every is not None:
            return self.rebase_every
        return GPU_REBASE_EVERY if self._on_gpu() else 0

    def _on_gpu(self) -> bool:
        return bool(self.params) and self.params[0].is_cuda

    def _writes_snapshots(self) -> bool:
        """--rebase-every auto on a GPU: the replica's CPU arithmetic differs from the device's by
        rounding, so every step written (persisted, or final) is a real snapshot instead, and
        every record on disk restores the run's bits."""
        return self.rebase_every is None and self._on_gpu()

    def _rebase_due(self, step: int) -> bool:
        """A full snapshot replaces the replica at this step: one was asked for, --rebase-every
        says so, or the step is persisted and `_writes_snapshots`."""
        every = self._rebase_every()
        if self.rebase or (every and step % every == 0):
            return True
        return self._writes_snapshots() and self.persist.due(step)

    # ---- hooks -------------------------------------------------------------------------
    def on_ready(self, step: int) -> None:
        opt = self.ctx.primary
        cls = f"{type(opt).__module__}.{type(opt).__qualname__}"
        if cls not in optimizer_classes():
            raise CkptrunError(f"--strategy lowdiff+ updates a replica in the checkpoint engine with the "
                               f"optimizer's own class, and {cls} is not a torch.optim optimizer the engine may "
                               "construct; use --strategy lowdiff or checkfreq", exit_code=2)
        self.params = optimizer_params(opt)
        if any(p.is_sparse for p in self.params):
            raise CkptrunError("--strategy lowdiff+ copies dense gradients; a sparse parameter is not supported "
                               "(use --strategy checkfreq)", exit_code=2)
        self.position = {id(p): i for i, p in enumerate(self.params)}
        self.skeleton, self.like = flatten({"grads": self.params})
        self.keys = [ref[TENSOR] for ref in self.skeleton["grads"]]
        replica = replica_bytes(opt, self.params)
        if self.ctx.host_memory.limited:  # the replica and its persist buffer: two copies of the state
            self.ctx.host_memory.claim(REPLICA, 2 * replica, "--strategy lowdiff+")
        else:
            check_host_memory(replica)
        resume = self.ctx.resume
        if resume is None or resume.source != "memory":
            # A resume exactly at a full checkpoint has its record already.
            self._take_base(step, write=resume is None or resume.diffs is not None)

    def on_grad_ready(self, param: torch.Tensor) -> None:
        i = self.position.get(id(param))
        grad = param.grad
        if not self.layerwise or i is None or grad is None or grad.is_sparse:
            return
        if self.filling is None:
            self._open(self.ctx.step + 1)
        self.ctx.put(self.filling, [(self.places[self.keys[i]], grad)])
        self.copied[i] = (grad, grad._version)
        for clip in self.scales:  # a new backward (a step the GradScaler skipped): not scaled yet
            if i in clip["params"]:
                clip["params"].remove(i)

    def on_grad_scale(self, params: list, coefficient: torch.Tensor, scale) -> None:
        """Clipping multiplies the gradients copied in backward by one coefficient: instead of
        copying them again, the engine is told it and multiplies its copies the same way (the
        same elementwise product: bit-identical). The copies still running must end first."""
        if not self.layerwise or self.filling is None:
            scale()
            return
        t0 = time.perf_counter()
        self.ctx.wait_copy(self.filling)
        self.ctx.stall("snapshot", time.perf_counter() - t0)
        copied = {}
        for p in params:
            i, grad = self.position.get(id(p)), p.grad
            held = self.copied.get(i)
            if grad is not None and held is not None and held[0] is grad and held[1] == grad._version:
                copied[i] = grad
        scale()
        for i, grad in copied.items():
            self.copied[i] = (grad, grad._version)
        if copied:
            self.scales.append({"coef": coefficient.detach().to("cpu", copy=True), "params": sorted(copied)})

    def before_step(self, step: int) -> None:
        self._hand_over()
        snap = self.filling if self.filling is not None else self._open(step)
        self.filling = None
        refs, again, fresh, stale, total = [], [], set(), 0, 0
        for i, p in enumerate(self.params):
            grad = p.grad
            if grad is None:
                refs.append(None)
                continue
            if grad.is_sparse:
                raise CkptrunError(f"--strategy lowdiff+ copies dense gradients; parameter {i} has a sparse one "
                                   "(use --strategy checkfreq)", exit_code=2)
            held = self.copied.get(i)
            nbytes = grad.numel() * grad.element_size()
            total += nbytes
            if held is None or held[0] is not grad or held[1] != grad._version:
                again.append((self.places[self.keys[i]], grad))
                fresh.add(i)
                stale += nbytes if held is not None else 0
            refs.append({TENSOR: self.keys[i]})
        self.ctx.put(snap, again)
        self.copied.clear()
        scales = [{**c, "params": [i for i in c["params"] if i not in fresh and refs[i] is not None]}
                  for c in self.scales]
        self.ctx.add(snap, {"scales": scales}, background=True)  # (a gradient copied again is final)
        self.scales = []
        self.recopied += stale
        self._adapt(step, stale, total)
        snap.skeleton["grads"] = refs
        # (background: a synchronous add would wait here, before the update, for the copies just queued)
        self.ctx.add(snap, {"groups": [{k: v for k, v in g.items() if k != "params"}
                                       for g in self.ctx.primary.param_groups]}, background=True)
        self.taken = snap

    def after_step(self, step: int) -> None:
        ctx, taken, self.taken = self.ctx, self.taken, None
        if self._rebase_due(step):
            # A full snapshot of this step replaces the replica whole: the step's gradients are
            # not needed (and their slot is, with only --max-inflight slots to go round).
            ctx.discard(taken)
            self._take_base(step, write=self.persist.due(step))
            return
        ctx.wait_copy(taken)  # the next backward may accumulate into these gradients
        ctx.add(taken, ctx.post_step_state())
        self.pending = (taken, self.persist.due(step))

    def on_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """DDP's reducer writes the all-reduced gradient after the hooks fired (into bucket views,
        not always moving a version counter): the gradients are copied at the optimizer step."""
        self.layerwise, self.under_ddp = False, True

    def on_event(self, msg: Message) -> None:
        if isinstance(msg, SaveError) and "replica" in msg.error:
            self.rebase = True

    def finish(self) -> None:
        if self.pending is not None and self.ctx.final_checkpoint and self._writes_snapshots():
            (taken, _), self.pending = self.pending, None  # (the final record: a real snapshot too)
            self.ctx.discard(taken)
            self._take_base(taken.step, write=True)
        self._hand_over(final=self.ctx.final_checkpoint)
        if self.recopied:
            self.ctx.emit(type="lowdiff_plus", recopied_bytes=self.recopied)

    # ---- pieces ------------------------------------------------------------------------
    def _adapt(self, step: int, stale: int, total: int) -> None:
        """A script that changes most gradients after backward in a way `on_grad_scale` does not
        see (its own clipping, a replaced `.grad`) makes the copies taken there stale: they are
        all taken again at the pre-step, so copying in backward only doubles the traffic. Turn
        it off then, and try it again every PROBE_EVERY steps (the script may stop)."""
        if self.layerwise and total and 2 * stale > total:
            self.layerwise, self.off_since = False, step
            self.ctx.emit(type="layerwise", step=step, on=False, stale_bytes=stale, grad_bytes=total)
            if not self.recopied_logged and self.ctx.rank == 0:
                self.recopied_logged = True
                log.info(f"lowdiff+: the script changes the gradients after backward ({stale * 100 // total}% "
                         f"of their bytes at step {step}); they are copied at the optimizer step instead of "
                         "layer by layer")
        elif not self.layerwise and not self.under_ddp and step - self.off_since >= PROBE_EVERY:
            self.layerwise = True  # measured again at the next step
        elif self.layerwise and stale == 0 and self.off_since:
            self.ctx.emit(type="layerwise", step=step, on=True, stale_bytes=0, grad_bytes=total)
            self.off_since = 0

    def _open(self, step: int) -> Snapshot:
        """Take the staging slot for step `step`'s diff and lay out a place per gradient."""
        self.filling = self.ctx.begin(step, "diff", need=Layout.of(self.like).nbytes)
        self.places = self.ctx.reserve(self.filling, dict(self.skeleton), self.like)
        return self.filling

    def _take_base(self, step: int, *, write: bool) -> None:
        self.rebase = False
        snap = self.ctx.capture(step, background=True, whole=True)  # (the replica needs every tensor)
        self.pending_base = (snap, write)

    def _hand_over(self, final: bool = False) -> None:
        ctx = self.ctx
        if self.pending is not None:
            (snap, persist), self.pending = self.pending, None
            ctx.seal(snap)
            ctx.submit(snap, Grads, persist=persist or final, final=final)
        if self.pending_base is not None:
            (snap, write), self.pending_base = self.pending_base, None
            ctx.seal(snap)
            ctx.submit(snap, Base, persist=write or final, exact=not self._on_gpu(),
                       replicated=ctx.replicated_positions(), shared=ctx.shared_positions())


REPLICA = "lowdiff+ replica"  # its use of the host-memory budget (ckptrun/memory_budget.py)


def replica_bytes(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> int:
    """Host bytes of the engine's replica: parameters and optimizer state (assumed
    STATES_PER_PARAM tensors per parameter while the optimizer has created none yet)."""
    pbytes = sum(p.numel() * p.element_size() for p in params)
    sbytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor))
    return pbytes + (sbytes or STATES_PER_PARAM * pbytes)


def check_host_memory(replica: int, available: int | None = None) -> None:
    """Refuse to start when host memory cannot hold this rank's replica and its persist buffer
    (two copies of parameters and optimizer state)."""
    need = 2 * replica
    free = psutil.virtual_memory().available if available is None else available
    if need > free:
        raise CkptrunError(f"--strategy lowdiff+ keeps a CPU replica of the parameters and optimizer state and "
                           f"a buffer to persist it: {need / 2**30:.1f} GiB of host memory, and "
                           f"{free / 2**30:.1f} GiB is available; use --strategy lowdiff (no replica) or free "
                           "host memory", exit_code=2)
