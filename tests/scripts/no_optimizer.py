"""A script that trains without a torch.optim optimizer (plain SGD by hand): ckptrun has no step
to checkpoint. Prints a marker per iteration, so a test sees when the run was stopped."""

import argparse

import torch

p = argparse.ArgumentParser()
p.add_argument("--iterations", type=int, default=100000)
args = p.parse_args()
torch.manual_seed(0)
w = torch.zeros(5, requires_grad=True)
x = torch.linspace(0, 1, 5)
for i in range(args.iterations):
    loss = ((w * x).sum() - 1) ** 2
    loss.backward()
    with torch.no_grad():
        w -= 0.1 * w.grad
        w.grad = None
    print(f"iteration {i}", flush=True)
