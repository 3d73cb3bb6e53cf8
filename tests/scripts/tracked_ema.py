"""Third-party style script whose state ckptrun cannot discover alone: an EMA of the weights
(updated after each optimizer step) and a `torch.Generator` that draws the data, both declared
with `ckptrun.track(...)` (a no-op under plain python)."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import ckptrun


class EMA:
    def __init__(self, model: nn.Module, decay: float) -> None:
        self.model, self.decay = model, decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self) -> None:
        for k, v in self.model.state_dict().items():
            self.shadow[k].mul_(self.decay).add_(v, alpha=1 - self.decay)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        for k, v in state["shadow"].items():
            self.shadow[k].copy_(v)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--save-path", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ema = EMA(model, decay=0.9)
    data = torch.Generator().manual_seed(123)
    ckptrun.track(ema=ema, data=data)
    for step in range(ckptrun.resume_step(), args.steps):
        x = torch.randn(8, 4, generator=data)
        loss = F.mse_loss(model(x), x.flip(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema.update()
        if step + 1 == args.save_at:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "ema": ema.state_dict(),
                        "data": data.get_state()}, args.save_path)


if __name__ == "__main__":
    main()
