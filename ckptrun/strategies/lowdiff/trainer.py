"""`lowdiff` (LowDiff): the gradient the optimizer consumed is the differential checkpoint.

Every step, the pre-step hook (after the script's clipping, unscaling and all-reduce) copies the
gradients and the hyper-parameters they are applied with into a staging slot, off the training
thread while the update runs; the post-step hook adds the state replay cannot rebuild (module
buffers, RNG), and the next pre-step seals it with schedulers/scaler/tracked state. The engine
batches B such diffs into one record (concatenated, not summed: summing is not exact for Adam)
and writes it in one I/O. A full checkpoint is taken every F steps through the shared snapshot
path, and once when training (re)starts, so every chain starts from a true full checkpoint.
Recovery = load the base, replay diffs through the same optimizer (`ckptrun.restore.replay`).

`--compress topk:R` sparsifies the gradient in training itself (top-k with error feedback) before
the optimizer consumes it; the stored diff is the (indices, values) pair that was applied, so
replay stays exact. (F, B) = `auto` follows eq. (10) of the paper (`ckptrun.strategies.lowdiff.model`) from
measured costs and is re-tuned as they move.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ...compress import TopK
from ...ipc.messages import Message, SaveError
from ...log import log
from ...memory_budget import fmt
from ...restore.replay import optimizer_params
from ...storage.layout import TensorSpec, view
from ...storage.store import full_name
from ...storage.tree import unflatten
from ..base import Strategy
from ..context import Snapshot, StrategyContext
from .messages import Diff, Residual
from .policy import FullEveryBatch


def _as_sparse(grad: torch.Tensor | None) -> Any:
    """A gradient that is mostly zeros as (indices, values): exact, -0.0 included."""
    if grad is None:
        return None
    flat = grad.flatten()
    idx = torch.nonzero(flat.ne(0) | torch.signbit(flat)).flatten()
    return {"idx": idx.to(torch.int32) if flat.numel() < 2**31 else idx, "val": flat[idx]}


BATCH = "lowdiff batch of diffs"  # its use of the host-memory budget (in the engine; ckptrun/memory_budget.py)
# A diff's skeleton (post-step RNG states: ~1,250 Python ints) is held in the engine as JSON text
# until its batch is written, then as objects while the record's index is built: ~6 bytes per
# byte of its JSON (measured: 93 MB of objects for 1,855 diffs of the soak model, whose skeleton
# is ~9 KB of JSON), plus the text.
SKELETON_OBJECT_BYTES = 7


class LowDiff(Strategy):
    name = "lowdiff"
    single_optimizer = True
    min_slots = 2  # a full snapshot and a step's diff are held together
    every_step = True

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        opts = ctx.options
        self.fb = ctx.policy(FullEveryBatch(opts.get("full_every") or "auto", opts.get("batch") or "auto"))
        self.compress = TopK.parse(opts["compress"]) if opts.get("compress") else None
        self.base: str | None = None
        self.pending_full: Snapshot | None = None
        self.pending_diff: Snapshot | None = None
        self.diff_base: str | None = None
        self.ddp_compressed = False
        self._residual: dict = {}  # the top-k residual as it was right after the pending diff's step
        self.broken: str | None = None  # a record of the current chain that failed to save
        self._skeleton_bytes: int | None = None  # what a diff's skeleton takes in the engine, as objects

    def settings(self) -> dict:
        return {**self.fb.settings, "auto": self.fb.adjustable,
                "compress": self.ctx.options.get("compress") or "none"}

    # ---- hooks -------------------------------------------------------------------------
    def on_ready(self, step: int) -> None:
        resume = self.ctx.resume
        if self.compress and resume is not None:
            self._restore_residual(resume)
        if resume is not None and resume.diffs is None:
            self.base = resume.record  # resumed exactly at a committed full checkpoint: chain on it
        else:
            self._take_full(step)

    def _restore_residual(self, resume) -> None:
        """The error-feedback residual at the resume step: in the base full checkpoint if we
        resume exactly there, else in the engine's memory (never written with the diffs)."""
        if "lowdiff" in resume.state and resume.step == int(resume.record.split("-")[-1]):
            self.compress.load_state_dict(resume.state["lowdiff"])
            return
        reply = self.ctx.request(Residual(step=resume.step))
        if reply.get("found"):
            buf = torch.frombuffer(bytearray(reply["data"]), dtype=torch.uint8)
            tensors = {k: view(buf, TensorSpec.from_json(k, spec)) for k, spec in reply["tensors"].items()}
            self.compress.load_state_dict(unflatten(reply["skeleton"], tensors))
            return
        log.warning(f"warning: resumed step {resume.step} without the top-k error-feedback residual (the "
                    "engine that held it is gone); model and optimizer state are exact, the residual restarts at zero")

    def before_step(self, step: int) -> None:
        ctx = self.ctx
        self._hand_over()
        opt = ctx.primary
        params = optimizer_params(opt)
        if self.compress and self.ddp_compressed:
            grads = [_as_sparse(p.grad) for p in params]
        elif self.compress:
            grads = self.compress.apply(params)
        else:
            grads = [p.grad for p in params]
        diff = {"grads": grads, "groups": [{k: v for k, v in g.items() if k != "params"}
                                           for g in opt.param_groups]}
        self.pending_diff = ctx.begin(step, "diff", prefix=f"s{step}")
        self.diff_base = self.base
        ctx.add(self.pending_diff, diff, background=True, write_once=True)  # (DDP: each gradient by one rank)

    def after_step(self, step: int) -> None:
        ctx = self.ctx
        ctx.wait_copy(self.pending_diff)  # the next backward may overwrite these gradients
        ctx.add(self.pending_diff, ctx.post_step_state())
        if self.compress:  # residual tensors are replaced, never modified: references suffice
            self._residual = self.compress.state_dict()
        if self.fb.due(step) or self._restart_chain(step):
            self._take_full(step)

    def on_event(self, msg: Message) -> None:
        if isinstance(msg, SaveError):
            self.broken = msg.record or f"step {msg.step}"

    def _restart_chain(self, step: int) -> bool:
        """After a record failed to save, every later diff of its chain would depend on it and
        never commit: start a new chain with a full checkpoint now. Ranks must start it at the
        same step, so a multi-rank run waits for the next regular full checkpoint instead."""
        if self.broken is None or self.ctx.world_size > 1:
            return False
        log.info(f"lowdiff: {self.broken} was not saved; starting a new chain with a full checkpoint "
                 f"at step {step}")
        self.ctx.emit(type="chain_restart", step=step, broken=self.broken)
        return True

    def finish(self) -> None:
        self._hand_over()

    def on_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """With --compress, compression runs as DDP's communication hook (it cuts traffic too)."""
        if self.compress:
            keys = {id(p): i for i, p in enumerate(ddp.module.parameters())}
            ddp.register_comm_hook(None, self.compress.ddp_hook(keys))
            self.ddp_compressed = True

    # ---- pieces ------------------------------------------------------------------------
    def _take_full(self, step: int) -> None:
        self.broken = None
        self.pending_full = self.ctx.capture(step, background=True)
        if self.compress:
            self.ctx.add(self.pending_full, {"lowdiff": self.compress.state_dict()})
        self.base = full_name(step)

    def _hand_over(self) -> None:
        ctx = self.ctx
        if self.pending_full is not None:
            snap, self.pending_full = self.pending_full, None
            ctx.seal(snap)
            ctx.submit(snap)
        if self.pending_diff is not None:
            snap, self.pending_diff = self.pending_diff, None
            ctx.seal(snap)
            disk = snap.nbytes
            if self.compress:  # the tail of the slot: kept in the engine's memory, not written
                ctx.add(snap, {"volatile": self._residual})
                ctx.wait_copy(snap)
            if self._skeleton_bytes is None:  # (the same every step: measured once)
                self._skeleton_bytes = SKELETON_OBJECT_BYTES * len(json.dumps(snap.skeleton, default=str))
            batch = self._batch_within_budget(disk + self._skeleton_bytes)
            ctx.submit(snap, Diff, base=self.diff_base, batch=batch, disk_nbytes=disk)

    def _batch_within_budget(self, diff_bytes: int) -> int:
        """B, or fewer diffs where the host-memory budget cannot hold B of them in the engine
        (`diff_bytes` each: the tensors, concatenated in one buffer that grows by an eighth, and the
        step's skeleton as objects); an explicit --batch that does not fit is refused."""
        budget, b = self.ctx.host_memory, self.fb.batch
        per = 2 * (diff_bytes + diff_bytes // 8 + 64)  # the batch filling, and the one being written
        if not budget.limited or b * per <= budget.room(BATCH):
            budget.set(BATCH, b * per if budget.limited else 0, least=per if self.fb.auto_b else b * per)
            return b
        if not self.fb.auto_b:
            budget.refuse(f"--batch {b}", f"lowdiff's batch ({b} diffs of {fmt(diff_bytes)})", b * per)
        fit = budget.room(BATCH) // per
        if fit < 1:
            budget.refuse("--strategy lowdiff", f"lowdiff's batch (at least 1 diff of {fmt(diff_bytes)})", per)
        line = (f"lowdiff: host-memory budget decided: batch {fit} diffs instead of the cost model's {b} "
                f"({self.ctx.host_memory.describe()}, {fmt(diff_bytes)} per diff)")
        if budget.decide("batch", line):
            log.info(line) if self.ctx.rank == 0 else None
            self.ctx.emit(type="budget_decided", step=self.ctx.step, setting="batch", value=fit, reason=line)
        budget.set(BATCH, fit * per, least=per)
        return fit
