"""Third-party style script that optimizes a free-standing tensor no module owns (a learned
output scale) next to a model's parameters: ckptrun must checkpoint it too."""

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
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
    scale = torch.ones(1, requires_grad=True)
    opt = torch.optim.Adam([*model.parameters(), scale], lr=0.05)
    for step in range(ckptrun.resume_step(), args.steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 5, generator=g)
        loss = F.mse_loss(model(x) * scale, x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step + 1 == args.save_at:
            state = {**model.state_dict(), "scale": scale.detach()}
            torch.save({"model": state, "optimizer": opt.state_dict()}, args.save_path)


if __name__ == "__main__":
    main()
