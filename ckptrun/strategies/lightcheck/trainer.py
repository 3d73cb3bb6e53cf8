"""`lightcheck` trainer side (lightcheck.txt §III-B, "LightCheck-D"): right after step t, the
state is copied off the training thread straight into a slot of this rank's region file, mapped
into the trainer (page-locked on GPU, so device-to-host copies land in it directly): first what
the next update does not touch (buffers, RNG), then each parameter with its optimizer state, in
the order the next update needs them. At step t+1 the update runs layer by layer
(`LayerSteps`), each layer once its own copy is complete, so the update of early layers
overlaps the copy of later ones; `--layer-wait whole` waits for the whole copy instead
(CheckFreq's wait). The engine makes the slot durable and commits it (engine.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from ...ipc.staging import page_lock
from ...log import log
from ...storage.layout import ALIGN, align
from ...storage.region import REGION_FILE
from ..base import SnapshotStrategy
from ..context import Snapshot, StrategyContext
from . import COPY_TO, LAYER_WAIT
from .layers import LayerSteps, why_not
from .messages import Ready, Seal, Take


class Copied:
    """How far a snapshot's copy has got (the copier reports; the training thread waits)."""

    def __init__(self, ctx: StrategyContext, step: int) -> None:
        self.ctx, self.step = ctx, step
        self.cond = threading.Condition()
        self.upto = 0
        self.total: int | None = None  # known once sealed
        self.sent = False

    def progress(self, upto: int) -> None:
        with self.cond:
            self.upto = max(self.upto, upto)
            self.cond.notify_all()
            self._maybe_ready()

    def sealed(self, total: int) -> None:
        with self.cond:
            self.total = total
            self._maybe_ready()

    def _maybe_ready(self) -> None:
        if self.total is not None and self.upto >= self.total and not self.sent:
            self.sent = True
            self.ctx.send(Ready(step=self.step))

    def wait(self, upto: int, snap: Snapshot) -> int:
        """Block until the first `upto` bytes are copied; returns how many are. A copy that
        failed raises its error here."""
        with self.cond:
            while not self.cond.wait_for(lambda: self.upto >= upto, timeout=0.5):
                if snap.copy is not None and snap.copy.done() and snap.copy.exception() is not None:
                    raise snap.copy.exception()
            return self.upto


class LightCheck(SnapshotStrategy):
    name = "lightcheck"
    background = True
    message = Seal

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.whole = LAYER_WAIT.choice(ctx.options) == "whole"
        copy_to = COPY_TO.choice(ctx.options)
        self.direct = copy_to == "region" or (copy_to == "auto" and torch.cuda.is_available())
        self.maps: dict[str, torch.Tensor] = {}  # region file -> the trainer's mapping of it
        self.copied: Copied | None = None
        self.ends: list[int] = []  # per layer: the slot offset its copy ends at
        self.layers: LayerSteps | None = None

    def settings(self) -> dict:
        return {**super().settings(), "layer_wait": "whole" if self.whole else "layer",
                "copy_to": "region" if self.direct else "host"}

    def staged_bytes(self, full: int) -> int:
        return 0 if self.direct else full  # (direct: its own region, mapped at the first checkpoint)

    def on_ready(self, step: int) -> None:
        opt = self.ctx.primary
        reason = why_not(opt) if opt is not None else "no optimizer"
        if reason is None:
            self.layers = LayerSteps(opt)
        elif not self.whole and self.ctx.rank == 0:
            log.info(f"lightcheck: the update waits for the whole copy: {reason}")

    # ---- capture (after step t) --------------------------------------------------------
    def after_step(self, step: int) -> None:
        if self.layers is not None:
            self.layers.restore()  # the gradients a split update set aside (nothing otherwise)
        if self.ctx.due(step):
            self._capture(step, background=True)

    def _capture(self, step: int, *, background: bool) -> None:
        copied = Copied(self.ctx, step)
        groups: list[list[str]] = []
        snap = self.ctx.capture(step, background=background, stream=lambda _s: copied.progress,
                                into=lambda need: self._take(step, need),
                                order=lambda tensors: self._order(tensors, groups))
        ends = {s.key: s.offset + s.nbytes for s in snap.layout.specs}
        upto = max([ends[k] for k in groups[0]], default=0) if groups else 0  # what no layer owns
        self.ends = []
        for keys in groups[1:]:
            upto = max([upto, *(ends[k] for k in keys)])
            self.ends.append(upto)
        self.pending, self.copied = snap, copied

    def _order(self, tensors: dict[str, torch.Tensor], groups: list[list[str]]) -> dict[str, torch.Tensor]:
        """What no layer owns first (copied before any update can need it), then each layer of
        the primary optimizer: its parameter (under every model key sharing its storage) and its
        optimizer state. Fills `groups` with the keys of each (the unowned ones first)."""
        params = self.layers.params if self.layers is not None else []
        owner: dict[int, int] = {}
        for i, p in enumerate(params):
            owner.setdefault(p.data_ptr(), i)
            for v in self.ctx.primary.state.get(p, {}).values():
                if isinstance(v, torch.Tensor) and v.numel():
                    owner.setdefault(v.data_ptr(), i)
        groups[:] = [[] for _ in range(len(params) + 1)]
        for key, t in tensors.items():
            groups[owner.get(t.data_ptr(), -1) + 1 if t.numel() else 0].append(key)
        return {k: tensors[k] for keys in groups for k in keys}

    def _take(self, step: int, need: int) -> torch.Tensor | None:
        """A region slot for `step` (waits while every slot is in flight or kept), mapped here;
        with --copy-to host the snapshot goes to a staging slot instead (None)."""
        ctx = self.ctx
        capacity = align(int(need * 1.25) + 256 * ALIGN)  # room for the late state and some growth
        r = ctx.request(Take(step=step, capacity=capacity, meta_hint=ctx.index_hint(), inflight=ctx.max_inflight,
                             mapped=self.direct))
        if REGION_FILE.fullmatch(r["file"]) is None:
            raise RuntimeError(f"engine named region file {r['file']!r}")
        if not self.direct:
            return None
        mapping = self.maps.get(r["file"])
        if mapping is None:
            self.maps = {r["file"]: self._map(Path(ctx.dir) / r["file"], r["file_bytes"], r["data_at0"])}
            mapping = self.maps[r["file"]]
        return mapping[r["data_at"] : r["data_at"] + r["slot_bytes"]]

    @staticmethod
    def _map(path: Path, nbytes: int, data_at: int) -> torch.Tensor:
        """The region file mapped shared; on GPU its data area is page-locked, so copies from the
        device land in it directly (without, they go through pageable memory)."""
        mapping = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        if torch.cuda.is_available():
            err = page_lock(mapping.data_ptr() + data_at, nbytes - data_at)
            if err is not None:
                log.warning(f"lightcheck: could not page-lock the region mapping ({err}); "
                            "copies from the GPU go through pageable memory")
        return mapping

    # ---- the next update (step t+1) ----------------------------------------------------
    def before_step(self, step: int) -> None:
        snap, copied = self.pending, self.copied
        if snap is None:
            return
        self.pending = self.copied = None
        self._seal(snap, copied)
        if self.layers is None or self.whole or len(self.ends) != len(self.layers.params):
            copied.wait(snap.nbytes, snap)  # stall: "snapshot"
            return
        if copied.upto >= self.ends[-1]:
            return  # copied already: the whole step runs as usual
        waited = 0.0

        def ready(i: int) -> int:
            nonlocal waited
            w0 = time.perf_counter()
            upto = copied.wait(self.ends[i], snap)
            waited += time.perf_counter() - w0
            j = i + 1
            while j < len(self.ends) and self.ends[j] <= upto:
                j += 1
            return j

        t0 = time.perf_counter()
        self.layers.run(ready)
        self.ctx.stall("layer_wait", waited)
        self.ctx.update_ran(time.perf_counter() - t0 - waited)

    def _seal(self, snap: Snapshot, copied: Copied) -> None:
        self.ctx.seal(snap, wait=False)
        copied.sealed(snap.nbytes)  # `Ready` may go before `Seal`: the handler takes either order
        self.ctx.submit(snap, Seal)

    def finish(self) -> None:
        ctx = self.ctx
        snap, copied = self.pending, self.copied
        if snap is None and ctx.final_checkpoint and ctx.step > 0 and ctx.checkpointed_step != ctx.step:
            self._capture(ctx.step, background=False)
            snap, copied = self.pending, self.copied
        if snap is not None:
            self.pending = self.copied = None
            self._seal(snap, copied)
            ctx.wait_copy(snap)  # every byte is in the slot (and `Ready` sent) before the engine is flushed

