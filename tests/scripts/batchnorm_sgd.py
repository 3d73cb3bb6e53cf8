"""Third-party style script with a BatchNorm model (its buffers change in every forward) and SGD
with momentum; steps counted by a for loop starting at `ckptrun.resume_step()`."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import ckptrun


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--save-path", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Linear(24, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    for step in range(ckptrun.resume_step(), args.steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 6, generator=g) * 2 + 1
        y = torch.randint(0, 3, (32,), generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step + 1 == args.save_at:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, args.save_path)


if __name__ == "__main__":
    main()
