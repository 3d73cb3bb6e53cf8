"""Trains a few steps under ckptrun, waits for the engine to write and commit them, then reports
which of the launcher's other children (its checkpoint engines) have torch's library mapped, and
how many malloc arenas besides glibc's main one each has (ckptrun/engine/arena.py: none).

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

ARENA = 64 << 20  # glibc's HEAP_MAX_SIZE on 64 bits: a thread arena's heap is a reservation of this size, so aligned


def thread_arenas(maps: list[list[str]]) -> int:
    """Anonymous reservations of exactly one aligned ARENA, made of adjacent mappings."""
    spans = [tuple(int(x, 16) for x in m[0].split("-")) for m in maps if len(m) == 5]
    starts = {a for a, _ in spans if a % ARENA == 0}
    ends = dict(spans)
    count = 0
    for a in starts:
        end = ends[a]
        while end in ends and end < a + ARENA:
            end = ends[end]
        count += end == a + ARENA
    return count


me = psutil.Process()
engines, arenas = {}, {}
for p in me.parent().children():
    if p.pid != me.pid and "spawn_main" in " ".join(p.cmdline()):  # (not the resource tracker)
        with open(f"/proc/{p.pid}/maps") as f:
            maps = [line.split() for line in f]
        engines[p.pid] = any("libtorch" in m[-1] for m in maps)
        arenas[p.pid] = thread_arenas(maps)
with open(sys.argv[1], "w") as f:
    json.dump({"engines_with_torch": engines, "thread_arenas": arenas}, f)
