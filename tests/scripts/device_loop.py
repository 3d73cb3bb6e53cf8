"""A small MLP with dropout trained on a given device, optionally under autocast with a
`GradScaler`: the script of the CUDA tests (tests/test_cuda.py). It resumes at
`ckptrun.resume_step()`, saves the state it starts from (`--start-out`: what ckptrun restored,
with the device each tensor lives on) and the state after its last step (`--out`).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import ckptrun

AMP = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def state(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
            "devices": sorted({str(t.device) for t in [*model.state_dict().values(),
                                                        *(v for s in opt.state.values() for v in s.values()
                                                          if isinstance(v, torch.Tensor) and v.dim())]})}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", choices=list(AMP), default="none")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--stop-after", type=int, default=0, help="leave the loop after this step")
    p.add_argument("--start-out", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.2), nn.Linear(256, 64)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=3, enabled=args.amp != "none")
    start = ckptrun.resume_step()
    if args.start_out:
        torch.save(state(model, opt, scaler), args.start_out)
    data = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        x = torch.randn(32, 64, generator=data).to(device)
        if step < start:
            continue
        if args.stop_after and step >= args.stop_after:
            break
        with torch.autocast(device.type, dtype=AMP[args.amp] or torch.float32, enabled=args.amp != "none"):
            loss = F.mse_loss(model(x), x.flip(1))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    if args.out:
        torch.save(state(model, opt, scaler), args.out)


if __name__ == "__main__":
    main()
