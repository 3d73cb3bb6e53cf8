"""Fine-tuning style: the optimizer gets every parameter, a frozen layer's too (requires_grad
False, as torch allows), and the script unfreezes it at iteration 6; a head used on even
iterations only leaves its gradients None on the odd ones. The loop counts its iterations from
`ckptrun.resume_step()`; `--save-path` gets its state at the end."""

import argparse

import torch
from torch import nn

import ckptrun


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.frozen, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_head: bool) -> torch.Tensor:
        h = self.frozen(self.body(x).tanh())
        return self.head(h) if use_head else h


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-path", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Model()
    model.frozen.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    it = ckptrun.resume_step()
    while it < args.steps:
        model.frozen.requires_grad_(it >= 6)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(it))
        loss = model(x, it % 2 == 0).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        it += 1
    if args.save_path:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, args.save_path)


if __name__ == "__main__":
    main()
