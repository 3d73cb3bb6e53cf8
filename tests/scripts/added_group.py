"""Progressive unfreezing by adding a param group: the optimizer is made over the body, and the
head joins it with `add_param_group` at iteration 6 (before the loop when resumed past it)."""

import argparse

import torch
from torch import nn

import ckptrun


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    body, head = nn.Linear(8, 8), nn.Linear(8, 8)
    opt = torch.optim.AdamW(body.parameters(), lr=1e-2)
    it = ckptrun.resume_step()
    if it > 6:
        opt.add_param_group({"params": head.parameters(), "lr": 5e-3})
    while it < args.steps:
        if it == 6:
            opt.add_param_group({"params": head.parameters(), "lr": 5e-3})
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(it))
        loss = head(body(x).tanh()).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        it += 1


if __name__ == "__main__":
    main()
