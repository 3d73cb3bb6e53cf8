"""A small MLP sharded with FSDP2 (`fully_shard`) on gloo, or the same model unsharded in one
process (--plain): the reference ckptrun's consolidated restore must equal.

Every rank trains on the same whole batch, so the gradient FSDP2 averages over the ranks is
each rank's own, exactly ((g + g) / 2 == g in floating point): the sharded run computes what the
unsharded one does, bit for bit. Dropout draws the same masks on every rank (same seed), so RNG
restore is exercised without the ranks diverging. A layer of 7 outputs shards unevenly.

Usage: fsdp_mlp.py [--plain] [--steps N] [--save-at S,S,...] [--resumed-out FILE]
  --save-at: after those steps, save the full state (model, optimizer) to full-{step}.pt
  --resumed-out: on a resumed run, save the full state as ckptrun restored it, before training
"""

import argparse

import torch

import ckptrun

p = argparse.ArgumentParser()
p.add_argument("--plain", action="store_true")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--save-at", default="")
p.add_argument("--resumed-out", default="")
args = p.parse_args()
torch.set_num_threads(1)

rank = 0
if not args.plain:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(7, 3))
if not args.plain:
    fully_shard(model[0])
    fully_shard(model[3])
    fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
g = torch.Generator().manual_seed(1)
data = [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(args.steps)]


def full(obj):
    """DTensors gathered whole (a collective: every rank calls it)."""
    if hasattr(obj, "full_tensor"):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: full(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full(v) for v in obj)
    return obj


def save(path):
    state = {"model": full(model.state_dict()), "optimizer": full(opt.state_dict())}
    if rank == 0:
        torch.save(state, path)


start = ckptrun.resume_step()
if start and args.resumed_out:
    save(args.resumed_out)
save_at = {int(s) for s in args.save_at.split(",") if s}
for step in range(start, args.steps):
    x, y = data[step]
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    if step + 1 in save_at:
        save(f"full-{step + 1}.pt")
if not args.plain:
    dist.destroy_process_group()
