"""Top-k gradient compression with error feedback, as LowDiff trains (`--strategy lowdiff
--compress topk:R`): the gradient the optimizer consumes is the top-k of (gradient + carried
residual), the rest is carried to the next step. It changes what training computes, so it lives
here, importable without the launcher: `ckptrun bench` trains its `none+topk:R` reference (the
same compressed training without checkpointing) with this same class, and a script may use it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .errors import UsageError
from .restore.replay import densify

SAMPLE = 10_000  # values sampled to estimate the top-k threshold of a large tensor


class TopK:
    """Top-k sparsification with an error-feedback residual (the residual is training state)."""

    def __init__(self, ratio: float) -> None:
        if not 0 < ratio <= 1:
            raise UsageError(f"--compress topk:RATIO needs 0 < RATIO <= 1 (got {ratio})")
        self.ratio = ratio
        self.residual: dict[int, torch.Tensor] = {}

    @classmethod
    def parse(cls, spec: str) -> TopK:
        kind, _, ratio = spec.partition(":")
        if kind != "topk" or not ratio:
            raise UsageError(f"--compress {spec!r}: expected topk:RATIO, e.g. topk:0.01")
        return cls(float(ratio))

    def sparsify(self, key: int, grad: torch.Tensor, *, exact_k: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of (grad + carried residual) as flat (indices, values); the rest is carried.

        Large tensors select by a threshold estimated from a strided sample (as DGC does), which
        takes about k values at a fraction of a full top-k's cost; `exact_k` (DDP, where every
        rank must send the same number of values) takes exactly k. Either way the stored diff is
        what was applied, so replay stays exact.
        """
        flat = grad.detach().flatten()
        acc = flat + self.residual[key] if key in self.residual else flat.clone()
        mag = acc.abs()
        k = max(1, math.ceil(self.ratio * acc.numel()))
        idx = None
        if not exact_k and acc.numel() > 4 * SAMPLE:
            sample = mag[:: acc.numel() // SAMPLE]
            thr = sample.topk(max(1, math.ceil(self.ratio * sample.numel())), sorted=False).values.min()
            if thr > 0:
                idx = torch.nonzero(mag >= thr).flatten()
        if idx is None:
            idx = mag.topk(k, sorted=False).indices
        val = acc[idx]
        acc[idx] = 0
        self.residual[key] = acc
        return idx, val

    def apply(self, params: list[torch.Tensor]) -> list[Any]:
        """Replace each gradient by its sparse top-k (plus carried residual); return what was applied."""
        applied: list[Any] = []
        with torch.no_grad():
            for i, p in enumerate(params):
                if p.grad is None:
                    applied.append(None)
                    continue
                idx, val = self.sparsify(i, p.grad)
                idx = idx.to(torch.int32) if idx.numel() and p.numel() < 2**31 else idx
                p.grad = densify(idx, val, p.grad)
                applied.append({"idx": idx, "val": val})
        return applied

    def ddp_hook(self, keys: dict[int, int]):
        """A DDP communication hook: each rank sends only its top-k (indices, values) per
        parameter (all-gather), and every rank sums them in rank order, so all ranks apply
        bit-identical gradients. `keys` maps id(param) to its residual key."""
        import torch.distributed as dist

        def hook(_state, bucket):  # unannotated: DDP rejects annotations other than its own types
            buf = bucket.buffer()
            idx_parts, val_parts, offset = [], [], 0
            with torch.no_grad():
                for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
                    idx, val = self.sparsify(keys[id(p)], g, exact_k=True)
                    idx_parts.append(idx + offset)
                    val_parts.append(val)
                    offset += g.numel()
                idx, val = torch.cat(idx_parts), torch.cat(val_parts)
                world = dist.get_world_size()
                all_idx = [torch.empty_like(idx) for _ in range(world)]
                all_val = [torch.empty_like(val) for _ in range(world)]
                dist.all_gather(all_idx, idx)
                dist.all_gather(all_val, val)
                out = torch.zeros_like(buf)
                for i, v in zip(all_idx, all_val, strict=True):
                    out.index_add_(0, i, v)
                out.div_(world)
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(out)
            return fut

        return hook

    def state_dict(self) -> dict:
        return {"ratio": self.ratio, "residual": dict(self.residual)}

    def load_state_dict(self, state: dict) -> None:
        self.residual = {int(k): v for k, v in state["residual"].items()}
