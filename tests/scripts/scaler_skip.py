"""A loop with a GradScaler (CPU), a StepLR scheduler and dropout, whose loss is inf at the
iterations `--inf-at` names (comma-separated): the scaler skips those optimizer steps. The loop
counts its iterations from `ckptrun.resume_step()`; `--save-path` gets its state at the end."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import ckptrun


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--inf-at", default="")
    p.add_argument("--save-path", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    inf_at = {int(i) for i in args.inf_at.split(",") if i}
    it = ckptrun.resume_step()
    while it < args.steps:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(it))
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True).sin())
        if it in inf_at:
            loss = loss * float("inf")
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        it += 1
    if args.save_path:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
                    "scheduler": sched.state_dict()}, args.save_path)


if __name__ == "__main__":
    main()
