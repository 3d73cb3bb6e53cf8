"""Third-party style training loop, run unmodified under ckptrun: `while True` with its own step
counter (resuming where `ckptrun.resume_step()` says), the lr set by hand every step, gradient
clipping, evaluation under `torch.no_grad()` between steps, and its own `torch.save` calls."""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

import ckptrun


def lr_at(step: int) -> float:
    return 0.05 * (0.5 + 0.5 * math.cos(math.pi * step / 20))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--save-path", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=lr_at(0))
    step = ckptrun.resume_step()
    while True:
        if step >= args.steps:
            break
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(16, 8, generator=g)
        y = x.sum(1, keepdim=True).sin()
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        model.train()
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        step += 1
        if step % 3 == 0:
            model.eval()
            with torch.no_grad():
                print(f"step {step} eval loss {F.mse_loss(model(x), y).item():.5f}", flush=True)
        if step % 4 == 0:
            torch.save({"model": model.state_dict(), "step": step}, f"own-{step}.pt")
        if step == args.save_at:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, args.save_path)


if __name__ == "__main__":
    main()
