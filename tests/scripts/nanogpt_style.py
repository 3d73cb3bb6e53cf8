"""nanoGPT-style script: it is distributed when RANK is set, and then asks for NCCL and a GPU;
otherwise it trains on the CPU. A tiny character model, AdamW, a cosine lr set by hand every
iteration, gradient clipping, dropout from the global RNG; `--compile BACKEND` wraps the model in
torch.compile, as nanoGPT does by default. Runs under plain python and under
ckptrun (resuming where `ckptrun.resume_step()` says); `--env-out F` writes the environment the
script sees as JSON."""

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import init_process_group

try:
    import ckptrun
except ImportError:  # runs without ckptrun installed too
    ckptrun = None


class Bigram(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.tok(idx)))


def get_lr(it: int, max_iters: int) -> float:
    return 1e-3 + 0.5 * (1e-2 - 1e-3) * (1 + math.cos(math.pi * it / max_iters))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--save-path", default="")
    p.add_argument("--env-out", default="")
    p.add_argument("--compile", default="", help="torch.compile the model with this backend, as nanoGPT does")
    args = p.parse_args()
    if args.env_out:
        with open(args.env_out, "w") as f:
            json.dump(dict(os.environ), f)
    ddp = int(os.environ.get("RANK", -1)) != -1  # is this a ddp run?
    if ddp:
        init_process_group(backend="nccl")
        ddp_local_rank = int(os.environ["LOCAL_RANK"])
        device = f"cuda:{ddp_local_rank}"
        torch.cuda.set_device(device)
    else:
        device = "cpu"
    torch.set_num_threads(1)
    torch.manual_seed(1337)
    vocab = 16
    model = Bigram(vocab, 32).to(device)
    if args.compile:
        model = torch.compile(model, backend=args.compile)
    optimizer = torch.optim.AdamW(model.parameters(), lr=get_lr(0, args.steps), weight_decay=0.1)
    iter_num = ckptrun.resume_step() if ckptrun else 0
    while iter_num < args.steps:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(iter_num, args.steps)
        g = torch.Generator().manual_seed(iter_num)
        x = torch.randint(0, vocab, (8, 12), generator=g)
        y = (x * 3 + 1) % vocab
        logits = model(x.to(device))
        loss = F.cross_entropy(logits.view(-1, vocab), y.to(device).view(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        iter_num += 1
        if iter_num == args.save_at:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.save_path)


if __name__ == "__main__":
    main()
