"""Third-party style script whose batches come from a DataLoader with worker processes: shuffled
by a generator seeded per epoch, noise added in the workers from their own torch RNG (seeded by
the loader), dropout from the main process's RNG. It resumes mid-epoch where
`ckptrun.resume_step()` says by skipping that epoch's batches already trained on.
`--start-method` picks how the workers start (fork, spawn, forkserver); each loader worker
appends its pid to loader-pids.txt."""

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ckptrun

PER_EPOCH = 5  # batches


class Noisy(Dataset):
    """Fixed samples with fresh noise drawn in the worker that loads them."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(PER_EPOCH * 8, 8, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.1 * torch.randn(8)  # the worker's RNG, seeded from the loader's generator
        return x, x.sum(0, keepdim=True).sin()


def record_pid(worker_id: int) -> None:
    with open("loader-pids.txt", "a") as f:
        f.write(f"{os.getpid()}\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--start-method", default="fork")
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--save-path", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = Noisy()
    step = ckptrun.resume_step()
    while step < args.steps:
        epoch, done = divmod(step, PER_EPOCH)
        loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=2,
                            multiprocessing_context=args.start_method, worker_init_fn=record_pid,
                            generator=torch.Generator().manual_seed(epoch))
        for i, (x, y) in enumerate(loader):
            if i < done:  # trained on before the restart
                continue
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step == args.save_at:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, args.save_path)
            if step >= args.steps:
                break


if __name__ == "__main__":
    main()
