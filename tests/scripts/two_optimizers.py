"""GAN-style training: a generator and a discriminator, each with its own optimizer, both
stepping every iteration (ckptrun counts steps on the first optimizer created)."""

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
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 4))
    disc = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(disc.parameters(), lr=1e-2, momentum=0.9)
    start = ckptrun.resume_step() if ckptrun else 0
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(step)
        z, real = torch.randn(8, 2, generator=g), torch.randn(8, 4, generator=g)
        fake = gen(z)
        d_loss = F.softplus(disc(fake.detach())).mean() + F.softplus(-disc(real)).mean()
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss = F.softplus(-disc(fake)).mean()
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        if step + 1 == args.save_at:
            torch.save({"model": gen.state_dict(), "optimizer": opt_g.state_dict(),
                        "model_1": disc.state_dict(), "optimizer_1": opt_d.state_dict()}, args.save_path)


if __name__ == "__main__":
    main()
