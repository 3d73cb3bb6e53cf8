"""Trains a few steps under ckptrun, waits for the engine to write and commit them, then reports
which of the launcher's other children (its checkpoint engines) have torch's library mapped.

Usage: engine_footprint.py OUT.json
"""

import json
import sys
import time

import psutil
import torch

torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for _ in range(6):
    opt.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
time.sleep(2)  # the engine writes, commits and prunes the steps meanwhile

me = psutil.Process()
engines = {}
for p in me.parent().children():
    if p.pid != me.pid and "spawn_main" in " ".join(p.cmdline()):  # (not the resource tracker)
        with open(f"/proc/{p.pid}/maps") as f:
            engines[p.pid] = any("libtorch" in line for line in f)
with open(sys.argv[1], "w") as f:
    json.dump({"engines_with_torch": engines}, f)
