"""A plain model for lowdiff's replay tests, with what the GPT example lacks: SGD with Nesterov
momentum in two parameter groups (their own lr and weight decay), a StepLR schedule whose lr
changes inside a diff batch, BatchNorm buffers (post-step state that replay cannot rebuild), and
a branch used on even steps only (its gradient is None on odd steps: the optimizer skips it).

`--save-at 6,7,8 --save-path 'own-{step}.pt'` saves {"model", "optimizer"} after each listed step:
the ground truth of an uninterrupted run at several steps from one run.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

try:
    import ckptrun
except ImportError:  # runs without ckptrun installed too
    ckptrun = None


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.branch = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.body(x)
        return self.head(h + self.branch(h) if use_branch else h)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--save-at", default="", help="comma-separated steps after which to save")
    p.add_argument("--save-path", default="", help="where to save; {step} is replaced")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net()
    head = list(model.head.parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in head)]
    opt = torch.optim.SGD([{"params": rest, "weight_decay": 1e-3}, {"params": head, "lr": 0.02}],
                          lr=0.05, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    save_at = {int(s) for s in args.save_at.split(",") if s}
    start = ckptrun.resume_step() if ckptrun else 0
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        model.train()
        loss = F.mse_loss(model(x, use_branch=step % 2 == 0), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step + 1 in save_at:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                       args.save_path.replace("{step}", str(step + 1)))


if __name__ == "__main__":
    main()
