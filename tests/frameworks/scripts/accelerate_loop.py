"""An accelerate training loop written as its docs write one, resumable both ways.

Tiny causal LM with dropout on synthetic tokens, a shuffling DataLoader, AdamW, a warmup-decay
LambdaLR and gradient clipping, all through `Accelerator(cpu=True).prepare`. The loop starts at
`ckptrun.resume_step()` (0 without ckptrun), or, with `--resume-from DIR/step_N`, at N after
accelerate's own `load_state`; the data position is the epoch's seeded order
(`use_seedable_sampler`) with `skip_first_batches`. The DataLoader has its own generator so that
starting an iterator draws nothing from the global RNG (dropout's): resuming mid-epoch then
sees the RNG an uninterrupted run sees (`--global-rng-loader` leaves it out to show the
difference). `accelerator.save_state(SAVE_DIR/step_N)` every `--save-every` steps is
accelerate's own checkpoint. Writes `OUT/losses.jsonl` (one line per step, appended, so a
restarted run adds to it), `OUT/final.pt` and `OUT/accelerate.json` (what accelerate set up).
"""

import argparse
import json
import os
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import ckptrun
except ImportError:
    ckptrun = None

VOCAB, DIM, SEQ, SAMPLES, BATCH = 32, 32, 8, 64, 8


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.drop = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.embed(ids))
        return self.head(h + self.mlp(self.norm(h)))


def warmup_decay(total: int):
    return lambda s: min(1.0, (s + 1) / 4) * max(0.0, 1 - s / total)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--save-dir", default="accel")
    p.add_argument("--resume-from", default="")
    p.add_argument("--global-rng-loader", action="store_true")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    set_seed(0)
    tokens = torch.randint(VOCAB, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(1))
    loader_rng = None if args.global_rng_loader else torch.Generator().manual_seed(2)
    loader = DataLoader(TensorDataset(tokens), batch_size=BATCH, shuffle=True, generator=loader_rng)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_decay(args.steps))
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    (out / "accelerate.json").write_text(json.dumps({
        "distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes,
        "model_wrapper": type(model).__name__, "threads": torch.get_num_threads(),
        "process_group": torch.distributed.is_initialized(), "rank_env": "RANK" in os.environ,
    }))

    step = ckptrun.resume_step() if ckptrun else 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        step = int(re.fullmatch(r"step_(\d+)", Path(args.resume_from).name).group(1))
    epoch = step // len(loader)
    with open(out / "losses.jsonl", "a") as log:
        while step < args.steps:
            loader.set_epoch(epoch)
            skip = step - epoch * len(loader)
            for (batch,) in accelerator.skip_first_batches(loader, skip) if skip else loader:
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                step += 1
                log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
                log.flush()
                if step % args.save_every == 0:
                    accelerator.save_state(f"{args.save_dir}/step_{step}")
                if step == args.steps:
                    break
            epoch += 1
    torch.save({"model": accelerator.unwrap_model(model).state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()}, out / "final.pt")


if __name__ == "__main__":
    main()
