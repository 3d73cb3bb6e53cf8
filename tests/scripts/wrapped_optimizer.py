"""An optimizer wrapper shaped like accelerate's AcceleratedOptimizer: a torch.optim.Optimizer
subclass that never calls Optimizer.__init__ and delegates everything to the real optimizer."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

try:
    import ckptrun
except ImportError:
    ckptrun = None


class Wrapped(torch.optim.Optimizer):
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # no super().__init__, on purpose
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--save-path", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4))
    opt = Wrapped(torch.optim.AdamW(model.parameters(), lr=0.01))
    start = ckptrun.resume_step() if ckptrun else 0
    for step in range(start, args.steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        loss = F.mse_loss(model(x), x.flip(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step + 1 == args.save_at:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, args.save_path)


if __name__ == "__main__":
    main()
