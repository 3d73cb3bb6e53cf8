"""A script that knows nothing of ckptrun: its loop always starts at iteration 0."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--save-path", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(args.steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        loss = F.mse_loss(model(x), x.flip(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step + 1 == args.save_at:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, args.save_path)


if __name__ == "__main__":
    main()
