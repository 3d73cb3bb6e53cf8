"""A loop that hands the optimizer a closure (as Lightning does): forward and backward run
inside `optimizer.step(closure)`, after the optimizer's pre-step hooks. With `--lbfgs` the
optimizer is LBFGS, which evaluates the closure several times per step."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

try:
    import ckptrun
except ImportError:
    ckptrun = None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--save-path", default="")
    p.add_argument("--lbfgs", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.1), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4) if args.lbfgs \
        else torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    start = ckptrun.resume_step() if ckptrun else 0
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 4, generator=g)

        def closure(x=x):
            opt.zero_grad()
            loss = F.mse_loss(model(x), x.flip(1))
            loss.backward()
            return loss

        opt.step(closure)
        sched.step()
        if step + 1 == args.save_at:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, args.save_path)


if __name__ == "__main__":
    main()
