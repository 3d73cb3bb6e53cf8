"""`gockpt` (GoCkpt, gockpt.txt §4): one checkpoint's transfer spread over k steps.

A checkpoint due at step s is cut into blocks of about --block-mb (`blocks.plan`): each a slice
of a parameter together with the same slice of its optimizer state (Adam's moments, SGD's
momentum) and a copy of the parameter's scalar state (`step`). Right after each update of
steps s..V = s+k-1 the trainer hands over its share of the blocks, copied off the training
thread (the runtime's copier; a side stream on GPU) while the next forward/backward runs; the
next update waits for that copy only. From the step after a block was sent until V, the
gradient each step consumed (taken at the pre-step: after clipping, unscaling, all-reduce) and
that step's hyper-parameters are shipped for it too, ahead of the step's own blocks, in the same
staging slot (one message per step). The engine (`engine.py`) rolls every early block forward
with them to version V and writes the full record of V; the rest of V's state (buffers, RNG,
schedulers, scaler, tracked objects, param_groups, scalar optimizer state) goes with V's blocks.

k (--spread, or auto from the stall model in `model.py`); while a spread runs, due steps are
skipped; the end of the script sends every block left at once (a record of its last step).
With --every N given, each spread instead starts k-1 steps before a multiple of N and ends there
(k at most N, `explicit_every` refuses a larger --spread), so every multiple of N is a record.
"""

from __future__ import annotations

import statistics
import time

import torch

from ...errors import CkptrunError, UsageError
from ...log import log
from ...restore.replay import not_elementwise, optimizer_params
from ..base import Strategy
from ..context import Snapshot, StrategyContext
from . import BLOCK_MB, MAX_AUTO_SPREAD, SPREAD, model
from .blocks import Piece, block_states, plan, shares
from .messages import Spread

STEP_TIMES_KEPT = 8
# Why auto k is the widest on the CPU: the stall model weighs the copy a step hides against the
# gradients shipped for early blocks, but a copy on the CPU is not hidden at all (it and the
# engine's roll-forward take the trainer's own cores); what a step costs there falls as k grows
# (a 1/k share of the copy and of the record's write). Measured in docs/performance.md.
CPU_REASON = "training on the CPU: no copy is hidden, so the widest spread costs least"


WRITES_QUEUED = 2  # = engine.WRITES_QUEUED (the engine module imports torch's optimizers: not imported here)
ROLLED = "gockpt rolled-forward state"  # its use of the host-memory budget (in the engine; memory_budget.py)


class GoCkpt(Strategy):
    name = "gockpt"
    single_optimizer = True
    min_slots = 2  # this step's message is filled while the last one is sealed

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.fixed_k = SPREAD.integer(ctx.options)  # None: auto
        self.block_bytes = block_bytes(ctx.options)
        self.k = self.fixed_k or 1
        self.measured = False  # auto: k came from the measured bandwidth and step time
        self.params: list[torch.Tensor] = []
        self.groups: list[int] = []  # each parameter's param group
        self.start: int | None = None  # the step the running spread started at
        self.version = 0  # V: the step it ends at
        self.shares: list[list[Piece]] = []  # the blocks handed over at each step of the spread
        self.sent: list[Piece] = []  # pieces already handed over, in order
        self.filling: Snapshot | None = None  # this step's message (its gradients, taken at the pre-step)
        self.pending: tuple[Snapshot, bool] | None = None  # (sealed at the next pre-step, last of its spread)
        self.last_version: int | None = None
        self.step_times: list[float] = []
        self._last_after: float | None = None

    def staged_bytes(self, full: int) -> int:
        """Its snapshots are blocks of a spread, not the whole state: the slots are sized by the
        first block it stages (made then, as before the slots were made ahead)."""
        return 0

    def settings(self) -> dict:
        return {"every": self.ctx.every, "spread": self.k, "auto": self.fixed_k is None,
                "block_mb": self.block_bytes / 2**20}

    # ---- hooks -------------------------------------------------------------------------
    def on_ready(self, step: int) -> None:
        opt = self.ctx.primary
        why = not_elementwise(opt)
        if why is not None:
            raise CkptrunError(f"--strategy gockpt rolls blocks of the parameters forward one by one in the "
                               f"checkpoint engine, and {why}; use --strategy checkfreq or sync", exit_code=2)
        self.params = optimizer_params(opt)
        if any(p.is_sparse for p in self.params):
            raise CkptrunError("--strategy gockpt slices dense parameters; a sparse parameter is not supported "
                               "(use --strategy checkfreq)", exit_code=2)
        self.groups = [g for g, group in enumerate(opt.param_groups) for _ in group["params"]]
        if self.params and self.params[0].is_cuda and self.ctx.rank == 0:
            log.warning("warning: --strategy gockpt rolls early blocks forward on the CPU: the records are exact "
                        "only up to CPU/GPU rounding of those steps (labelled in each record's meta)")
        self.last_version = self.ctx.checkpointed_step
        if self.ctx.resume is None and self.ctx.due(step):
            self.after_step(step)  # a fresh run's initial state, spread over its first steps

    def before_step(self, step: int) -> None:
        self._hand_over()
        if self.start is None:
            return
        ctx, opt = self.ctx, self.ctx.primary
        if getattr(opt, "grad_scale", None) is not None:  # set by GradScaler.step around a fused step
            raise CkptrunError("--strategy gockpt ships the gradients the optimizer consumes, and this fused "
                               "optimizer unscales them inside its step (GradScaler); call scaler.unscale_(optimizer) "
                               "before scaler.step, or use --strategy checkfreq", exit_code=2)
        snap = self.filling = ctx.begin(step, "spread")
        grads = []
        for piece in self.sent:
            grad = self.params[piece.index].grad
            if grad is not None and grad.is_sparse:
                raise CkptrunError(f"--strategy gockpt ships dense gradients; parameter {piece.index} has a sparse "
                                   "one (use --strategy checkfreq)", exit_code=2)
            grads.append(None if grad is None else grad.detach().reshape(-1)[piece.start:piece.stop])
        ctx.add(snap, {"grads": grads, "hyper": hyper_params(opt)}, background=True)

    def after_step(self, step: int) -> None:
        now = time.perf_counter()
        if self._last_after is not None:
            self.step_times = [*self.step_times, now - self._last_after][-STEP_TIMES_KEPT:]
        self._last_after = now
        if self.start is None:
            aligned = self.ctx.every_given
            if not (aligned or self.ctx.due(step)):
                return
            k = self.k if (self.fixed_k or self.measured) else self._auto_k()
            if aligned and not self.ctx.due(step + k - 1):  # (the spread must end at a due step)
                return
            if k != self.k:
                self._set_k(k, step, "byte ratio" if self._on_device() else CPU_REASON)
            self._start(step, self.k)
        self._hand_share(step, self.shares[step - self.start], last=step == self.version)

    def finish(self) -> None:
        """The script ended: a running spread ends at the last step (every block left is sent at
        once); with no spread running, the last step is checkpointed whole when it is not yet."""
        ctx = self.ctx
        if self.filling is not None:  # (the step never ran)
            ctx.discard(self.filling)
            self.filling = None
        if self.start is not None and self.pending is not None and not self.pending[1]:
            snap, _ = self.pending
            rest = [p for share in self.shares[ctx.step - self.start + 1:] for p in share]
            self._add_blocks(snap, rest, "rest")
            self.version = ctx.step
            ctx.add(snap, self._frame(), background=True)
            self.pending = (snap, True)
        elif self.start is None and ctx.final_checkpoint and ctx.step > 0 and self.last_version != ctx.step:
            self._start(ctx.step, 1)
            self._hand_share(ctx.step, self.shares[0], last=True)
        self._hand_over()

    # ---- pieces ------------------------------------------------------------------------
    def _start(self, step: int, k: int) -> None:
        """Plan a spread of the state of now over k steps, from `step` to V = step + k - 1."""
        opt = self.ctx.primary
        blocks = plan(self.params, self.groups, [block_states(p, opt.state.get(p, {})) for p in self.params],
                      self.block_bytes)
        self.start, self.version = step, step + k - 1
        self.shares, self.sent = shares(blocks, k), []
        if self.ctx.host_memory.limited:  # the engine rolls a whole state's blocks forward (cohorts)
            # (and up to WRITES_QUEUED copies of V's state being written)
            self.ctx.host_memory.claim(ROLLED, (1 + WRITES_QUEUED) * self._sizes()[0], "--strategy gockpt")

    def _hand_share(self, step: int, share: list[Piece], *, last: bool) -> None:
        ctx = self.ctx
        snap, self.filling = self.filling, None
        if snap is None:
            snap = ctx.begin(step, "spread")
        else:
            ctx.wait_copy(snap)  # the next backward may write into the gradients copied at the pre-step
        self._add_blocks(snap, share)
        if last:
            ctx.add(snap, self._frame(), background=True)
        self.pending = (snap, last)

    def _add_blocks(self, snap: Snapshot, pieces: list[Piece], key: str = "blocks") -> None:
        """Copy `pieces` (parameter slices with their optimizer state) into the message, off the
        training thread; under `key` ("rest": the blocks left, added at the end of the script)."""
        opt = self.ctx.primary
        blocks = []
        for piece in pieces:
            p = self.params[piece.index]
            state = opt.state.get(p, {})
            sliced = block_states(p, state)
            blocks.append({"i": piece.index, "g": piece.group, "start": piece.start, "stop": piece.stop,
                           "shape": list(p.shape), "param": _flat(p)[piece.start:piece.stop],
                           "state": {n: _flat(v)[piece.start:piece.stop] if n in sliced else v
                                     for n, v in state.items()}})
        self.ctx.add(snap, {key: blocks, "block_hyper": hyper_params(opt)}, background=True)
        self.sent += pieces

    def _frame(self) -> dict:
        """The state of V besides its blocks, shaped as a full snapshot (the worker's
        `TrainingState.early_state`): the places the blocks fill are None (parameters, sliced
        optimizer state)."""
        ctx, opt = self.ctx, self.ctx.primary
        position = {id(p): i for i, p in enumerate(self.params)}
        models = {}
        for name, m in ctx.models.items():
            params = {key for key, p in m.named_parameters(remove_duplicate=False) if id(p) in position}
            models[name] = {k: None if k in params else v for k, v in m.state_dict().items()}
        saved = opt.state_dict()["state"]
        state = {i: {n: None if n in block_states(self.params[i], s) else v for n, v in s.items()}
                 for i, s in saved.items()}
        return {"models": models, "optimizers": {"optimizer": {"state": state}},
                "rng": ctx.post_step_state()["rng"]}

    def _hand_over(self) -> None:
        if self.pending is None:
            return
        ctx = self.ctx
        (snap, last), self.pending = self.pending, None
        start = self.start
        if last:
            ctx.seal(snap)  # schedulers, scaler, tracked objects, param_groups as the next step finds them
            self.start, self.last_version = None, snap.step
        else:
            ctx.wait_copy(snap)  # the update about to run changes what the copy reads
        ctx.submit(snap, Spread, start=start, last=last, exact=not (self.params and self.params[0].is_cuda),
                   replicated=ctx.replicated_positions() if last else [],
                   shared=ctx.shared_positions() if last else [])
        if last and self.fixed_k is None and not self.measured and self.ctx.world_size == 1 and self._on_device():
            self._measure(snap.step)

    def _on_device(self) -> bool:
        """Training on an accelerator, whose copies to the host the stall model is about."""
        return bool(self.params) and self.params[0].device.type != "cpu"

    def _auto_k(self) -> int:
        """On an accelerator, k* = 1/r + 1/2 from the byte ratio alone (before anything is
        measured; the same on every rank), at most MAX_AUTO_SPREAD. Before the optimizer's first
        step its state does not exist yet: two state tensors per parameter (Adam's) are assumed.
        On the CPU, the widest spread (CPU_REASON)."""
        if not self._on_device():
            return self._max_k()
        state, grad = self._sizes()
        if state == grad:
            state = 3 * grad
        return min(self._max_k(), model.ratio_k(state, grad))

    def _max_k(self) -> int:
        """The largest auto k: the paper's cap, and with --every N given, N (a spread ends at each
        multiple of N)."""
        return min(MAX_AUTO_SPREAD, self.ctx.every) if self.ctx.every_given else MAX_AUTO_SPREAD

    def _measure(self, step: int) -> None:
        """After the first checkpoint: k from the stall model with the measured copy bandwidth and
        step time (one rank: several ranks keep the byte-ratio k, which they agree on)."""
        if not self.step_times:
            return
        state, grad = self._sizes()
        step_s = statistics.median(self.step_times)
        bw = copy_bandwidth(self.params)
        self.measured = True
        k = min(self._max_k(), model.optimal_k(state, grad, bw, step_s))
        self.ctx.emit(type="gockpt_model", step=step, state_bytes=state, grad_bytes=grad, bandwidth=bw,
                      step_s=step_s, k=k)
        if k != self.k:
            self._set_k(k, step, f"stall model: {state / 2**20:.1f} MB of state, {grad / 2**20:.1f} MB of "
                                 f"gradients, {bw / 2**30:.2f} GB/s, {step_s * 1e3:.1f} ms per step")

    def _set_k(self, k: int, step: int, reason: str) -> None:
        self.k = k
        self.ctx.emit(type="spread", step=step, k=k, reason=reason)
        if self.ctx.rank == 0:
            log.info(f"gockpt: spreading each checkpoint over {k} step{'s' if k > 1 else ''} from step {step} "
                     f"({reason})")

    def _sizes(self) -> tuple[int, int]:
        """(state bytes, gradient bytes): parameters with their sliced optimizer state, and their gradients."""
        opt = self.ctx.primary
        state = grad = 0
        for p in self.params:
            s = opt.state.get(p, {})
            grad += p.numel() * p.element_size()
            state += p.numel() * p.element_size() + sum(s[n].numel() * s[n].element_size() for n in block_states(p, s))
        return state, max(grad, 1)


def hyper_params(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def block_bytes(options: dict) -> int:
    raw = options.get(BLOCK_MB.name) or BLOCK_MB.default
    try:
        mb = float(raw)
    except ValueError:
        mb = 0.0
    if not 0 < mb <= 2**20:
        raise UsageError(f"{BLOCK_MB.flag} must be a positive number of MB, e.g. 4 (got {raw!r})")
    return max(1, int(mb * 2**20))


def copy_bandwidth(params: list[torch.Tensor], nbytes: int = 4 << 20) -> float:
    """Bytes per second of a device-to-host copy of up to `nbytes` of the first parameter (a probe)."""
    src = _flat(params[0])[: max(1, nbytes // params[0].element_size())]
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
    if src.is_cuda:  # the work queued before (the update) is not the copy's time
        torch.cuda.synchronize(src.device)
    t0 = time.perf_counter()
    dst.copy_(src)
    if src.is_cuda:
        torch.cuda.synchronize(src.device)
    return src.numel() * src.element_size() / max(time.perf_counter() - t0, 1e-9)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)
