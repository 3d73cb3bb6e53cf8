"""A loop with a GradScaler (CPU) whose loss is inf at iteration `--inf-at`: the scaler skips
that optimizer step. The loop counts its iterations from `ckptrun.resume_step()`."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import ckptrun


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--inf-at", type=int, default=-1)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    it = ckptrun.resume_step()
    while it < args.steps:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(it))
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True).sin())
        if it == args.inf_at:
            loss = loss * float("inf")
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        it += 1


if __name__ == "__main__":
    main()
