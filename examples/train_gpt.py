"""A small GPT in plain PyTorch on a synthetic corpus: the built-in example and test workload.

Runs with plain `python` and under `ckptrun` unchanged (it asks `ckptrun.resume_step()` where
to start). Deterministic: the batch of step i depends only on (--seed, i), dropout draws from
the global RNG that ckptrun checkpoints. `--save-at N --save-path P` saves the script's own
`torch.save({"model", "optimizer"})` after step N, the ground truth the tests compare against
(`--save-every K` after every K-th step, into `{step}` of the path).
`--timing-json` and `--ref-*` are `ckptrun bench`'s instrumentation (see bench_refs.py).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

try:
    import ckptrun
except ImportError:  # runs without ckptrun installed too
    ckptrun = None


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, layers: int, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        nn.init.normal_(self.tok.weight, std=0.02)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def batch(step: int, args: argparse.Namespace, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic corpus: a noisy arithmetic sequence per row, so there is something to learn."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 101 + rank)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
    stride = torch.randint(1, 7, (args.batch, 1), generator=g)
    seq = (start + stride * torch.arange(args.seq + 1)) % args.vocab
    noise = torch.rand(seq.shape, generator=g) < 0.05
    seq = torch.where(noise, torch.randint(0, args.vocab, seq.shape, generator=g), seq)
    return seq[:, :-1], seq[:, 1:]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--optimizer", choices=["adamw", "adam", "sgd"], default="adamw")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True): on a GPU, two runs then compute the same bits "
                        "(the crash matrix on CUDA compares a resumed run with an uninterrupted one)")
    p.add_argument("--stop-after", type=int, default=0,
                   help="end the loop after this step (0: run all --steps); the LR schedule still spans --steps")
    p.add_argument("--save-at", type=int, default=0, help="torch.save model+optimizer after this step")
    p.add_argument("--save-every", type=int, default=0,
                   help="also torch.save after every this many steps (and the initial state, as step 0)")
    p.add_argument("--save-path", default="", help="where --save-at/--save-every save; {rank} and {step} are filled in")
    p.add_argument("--log-every", type=int, default=0)
    p.add_argument("--timing-json", default="", help="append per-step wall time and checkpoint stall here (JSON lines)")
    p.add_argument("--ref-save", choices=["none", "torch", "dcp-thread", "dcp-process"], default="none",
                   help="reference checkpointing done by the script itself (ckptrun bench)")
    p.add_argument("--ref-every", type=int, default=1, help="steps between reference saves")
    p.add_argument("--ref-dir", default="ref-ckpts", help="where reference saves go")
    p.add_argument("--ref-resume", action="store_true", help="start from the newest reference save in --ref-dir")
    p.add_argument("--compress", default="", help="train with top-k gradient compression, e.g. topk:0.01 (ckptrun "
                   "bench's none+topk:R reference; under ckptrun, pass lowdiff's own --compress instead)")
    return p.parse_args()


def main() -> None:
    t_main = time.perf_counter()
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts, after this
        torch.use_deterministic_algorithms(True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(args.device if args.device != "cuda" else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    if world > 1:
        import torch.distributed as dist

        # DCP's async_save needs a CPU backend next to NCCL.
        cuda_backend = "cpu:gloo,cuda:nccl" if args.ref_save.startswith("dcp") else "nccl"
        dist.init_process_group(cuda_backend if device.type == "cuda" else "gloo")
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.seq, args.layers, args.d_model, args.heads, args.dropout).to(device)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    compressor = None
    if args.compress:
        from ckptrun.compress import TopK

        compressor = TopK.parse(args.compress)
        if world > 1:
            net.register_comm_hook(None, compressor.ddp_hook({id(p): i for i, p in enumerate(model.parameters())}))
            compressor = None  # the hook compresses
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    else:
        cls = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.Adam
        opt = cls(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    start = ckptrun.resume_step() if ckptrun else 0
    probe = None
    if args.timing_json or args.ref_save != "none":
        from bench_refs import Probe

        probe = Probe(args, model, opt, sched, device, t_main)
        start = probe.resume(start)
    t0 = time.perf_counter()
    if args.save_path and args.save_every and start == 0:  # the initial state too (step 0)
        path = args.save_path.replace("{rank}", str(rank)).replace("{step}", "0")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    for step in range(start, min(args.steps, args.stop_after or args.steps)):
        if probe:
            probe.begin_step()
        x, y = (t.to(device) for t in batch(step, args, rank))
        net.train()
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if compressor:
            compressor.apply(list(model.parameters()))
        if probe:
            probe.before_update()
        opt.step()
        sched.step()
        done = step + 1
        if args.log_every and done % args.log_every == 0 and rank == 0:
            print(f"step {done} loss {loss.item():.4f} {(time.perf_counter() - t0) / (done - start):.4f}s/step",
                  flush=True)
        if args.save_path and (args.save_at == done or args.save_every and done % args.save_every == 0):
            path = args.save_path.replace("{rank}", str(rank)).replace("{step}", str(done))
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        if probe:
            probe.end_step(done)
    if probe:
        probe.finish()
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
