"""A tiny model trained for many fast steps (test_soak.py): every step checkpointed, the step
reached written to PROGRESS every 250 steps so that the test samples memory by step.

Usage: soak.py STEPS PROGRESS [WIDTH]   (WIDTH: hidden units, 16 by default)
"""

import os
import sys

import torch

import ckptrun

torch.set_num_threads(1)
torch.manual_seed(0)
steps, progress = int(sys.argv[1]), sys.argv[2]
width = int(sys.argv[3]) if len(sys.argv) > 3 else 16
model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.99)
x, y = torch.randn(8, 16), torch.randn(8, 4)
for step in range(ckptrun.resume_step(), steps):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    sched.step()
    if (step + 1) % 250 == 0:
        with open(progress + ".tmp", "w") as f:
            f.write(str(step + 1))
        os.replace(progress + ".tmp", progress)
