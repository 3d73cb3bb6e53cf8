"""A training loop with a hand-written tqdm-like progress bar: lines on stdout and stderr in turn,
a bar redrawn with carriage returns on `--bar-to` (stdout or stderr), a log line on stdout between
bars, and a bar left open (no newline) at the end, as a script killed or ended mid-bar leaves it."""

import argparse
import sys

import torch
from torch import nn


def bar(i: int, n: int) -> str:
    done = 10 * i // n
    return f"\r{100 * i // n:3d}%|{'#' * done}{' ' * (10 - done)}| {i}/{n}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--bar-to", choices=["stdout", "stderr"], default="stderr")
    args = p.parse_args()
    out = getattr(sys, args.bar_to)
    print("stdout 1", flush=True)
    print("stderr 2", file=sys.stderr, flush=True)
    print("stdout 3", flush=True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    for epoch in range(2):
        for i in range(args.steps):
            out.write(bar(i, args.steps))
            out.flush()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        if epoch == 0:
            out.write(bar(args.steps, args.steps) + "\n")  # a finished bar
            print(f"epoch {epoch} done", flush=True)
    out.write(bar(args.steps, args.steps))  # left open
    out.flush()


if __name__ == "__main__":
    main()
