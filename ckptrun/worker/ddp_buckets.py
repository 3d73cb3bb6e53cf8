"""DDP's all-reduce bucket layout, carried across a resume so the first resumed step sums
gradients in the same order as the uninterrupted run.

DDP all-reduces its first iteration's gradients in one bucket (reverse parameter order), then
lays its buckets out again in the order backward produced the gradients. With 3 or more ranks
the all-reduce's summation order depends on where a gradient lies in its bucket, so a resumed
process, which starts from the first layout again, would compute its first step in other
rounding. `BucketLayout` is tracked with the run's state: its state is the rebuilt layout
(parameter indices per bucket, read once from the reducer after the rebuild); loading it builds
the resumed wrapper's reducer with that layout before its first iteration, the way DDP itself
rebuilds one (`__setstate__`: `_ddp_init_helper`). Anything unexpected leaves DDP as it is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..log import log

DDP_BUCKETS = "ckptrun.ddp_buckets."  # the tracked name of each DDP wrapper's layout (+ its index)


class BucketLayout:
    """One DDP wrapper's rebuilt bucket layout as a tracked object (`Runtime.on_ddp`).

    The layout is read once, at the first capture after DDP rebuilt its buckets (before that,
    i.e. a checkpoint sealed before the second step's forward, it is empty and a resume from it
    keeps DDP's first layout). Reading takes one zero-filled copy of the gradients (DDP exposes
    its buckets only so), freed at once."""

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        self.ddp = ddp
        # parameter indices (DDP's reducer order) per bucket; None until read once rebuilt
        self.buckets: list[list[int]] | None = None

    def state_dict(self) -> dict:
        if self.buckets is None and getattr(self.ddp, "_has_rebuilt_buckets", False):
            self.buckets = self._read()
        return {"buckets": self.buckets or []}

    def load_state_dict(self, state: dict) -> None:
        buckets = state.get("buckets") if isinstance(state, dict) else None
        if buckets:
            self._apply(buckets)

    def _read(self) -> list[list[int]]:
        """The reducer's current buckets (one zero-filled gradient copy); empty if torch's
        internals refuse (not tried again: a capture must not pay for it each time)."""
        try:
            index = {id(p): i for i, p in enumerate(self.ddp._build_params_for_reducer()[0])}
            return [[index[id(p)] for p in b.parameters()] for b in self.ddp.reducer._get_zeros_like_grad_buckets()]
        except Exception as e:  # noqa: BLE001 - torch internals: without them, DDP is left as it is
            log.info(f"DDP bucket layout not recorded ({type(e).__name__}: {e})")
            return []

    def _apply(self, buckets: list[list[int]]) -> None:
        ddp = self.ddp
        try:
            params, sparse = ddp._build_params_for_reducer()
            if sorted(i for b in buckets for i in b) != list(range(len(params))):
                return  # another model: the state's own checks will say so
            sizes = [sum(params[i].numel() * params[i].element_size() for i in b) for b in buckets]
            real = dist._compute_bucket_assignment_by_size

            def given(*_: Any, **__: Any) -> tuple[list[list[int]], list[int]]:
                return list(reversed(buckets)), list(reversed(sizes))  # (DDP reverses them back)

            dist._compute_bucket_assignment_by_size = given
            try:
                ddp._ddp_init_helper(params, sparse, ddp._build_debug_param_to_name_mapping(params), ddp.static_graph)
            finally:
                dist._compute_bucket_assignment_by_size = real
        except Exception as e:  # noqa: BLE001 - torch internals: without them, DDP is left as it is
            log.warning(f"warning: DDP's bucket layout could not be restored ({type(e).__name__}: {e}); with 3 or "
                        "more ranks the first resumed step sums gradients in another order")
            return
        self.buckets = [list(b) for b in buckets]
