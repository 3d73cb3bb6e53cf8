"""A small MLP trained data-parallel on gloo, sharded with FSDP2 (`--wrap fsdp`: fully_shard),
replicated with DDP (`--wrap ddp`), or unsharded in one process (`--wrap plain`): the reference
ckptrun's consolidated restore of the FSDP2 run must equal.

Every rank trains on the same whole batch, so the gradient the ranks average is each rank's own,
exactly, and any order of summing equal addends gives the same bits: the FSDP2 run computes what
the unsharded one does, and a resumed DDP run what an uninterrupted one does whatever its bucket
layout (DDP rebuilds its buckets after its first iteration, so a resumed run sums in another
order). Dropout draws the same masks on every rank (same seed), so RNG restore is exercised
without the ranks diverging. A layer of 7 outputs shards unevenly. A per-rank Generator (tracked)
and, under DDP, a parameter DDP ignores stand for per-rank state, which is never written once.

Usage: dp_mlp.py [--wrap fsdp|ddp|plain] [--steps N] [--save-at S,S,...] [--resumed-out FILE]
  --save-at: after those steps, save the full state (model, optimizer) to full-{step}.pt (FSDP2:
             rank 0, gathered), own-{rank}-{step}.pt (DDP: every rank, with its Generator's state)
  --resumed-out: on a resumed run, save the full state as ckptrun restored it, before training
"""

import argparse

import torch

import ckptrun

p = argparse.ArgumentParser()
p.add_argument("--wrap", choices=("fsdp", "ddp", "plain"), default="fsdp")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--save-at", default="")
p.add_argument("--resumed-out", default="")
args = p.parse_args()
torch.set_num_threads(1)

rank = 0
if args.wrap != "plain":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(7, 3))
net = model
if args.wrap == "fsdp":
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0])
    fully_shard(model[3])
    fully_shard(model)
elif args.wrap == "ddp":
    # A parameter DDP is told to ignore: each rank trains its own (its value, gradient and optimizer
    # state differ by rank and are never written once); it leaves the shared gradients alone.
    model.register_parameter("own", torch.nn.Parameter(torch.full((3,), 0.5 * rank)))
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["own"])
    net = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
mine = torch.Generator().manual_seed(100 + rank)
ckptrun.track(mine=mine)
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
    if args.wrap == "ddp":
        torch.save({**state, "mine": mine.get_state()}, path.replace("{rank}", str(rank)))
    elif rank == 0:
        torch.save(state, path)


start = ckptrun.resume_step()
if start and args.resumed_out:
    save(args.resumed_out)
save_at = {int(s) for s in args.save_at.split(",") if s}
for step in range(start, args.steps):
    x, y = data[step]
    torch.randint(1000, (1,), generator=mine)  # per-rank draws
    loss = torch.nn.functional.mse_loss(net(x), y)
    if args.wrap == "ddp":
        loss = loss + ((model.own - rank) ** 2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    if step + 1 in save_at:
        save(f"own-{{rank}}-{step + 1}.pt" if args.wrap == "ddp" else f"full-{step + 1}.pt")
if args.wrap != "plain":
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()
