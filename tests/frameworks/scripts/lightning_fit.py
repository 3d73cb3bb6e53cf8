"""A plain Lightning training script, unaware of ckptrun: a tiny LightningModule with dropout,
synthetic data behind a shuffling DataLoader, Adam with a per-step LR scheduler, and Lightning's
own `ModelCheckpoint(every_n_train_steps=K)` keeping every checkpoint and the scores of the
monitored loss. `--ckpt-path` resumes through Lightning's own
`fit(ckpt_path=...)`. Each finished step appends `global_step loss` (exact hex float) to
`--losses`; the end of `fit` writes the model, optimizer, scheduler and loop counters to `--out`."""

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Tiny(pl.LightningModule):
    def __init__(self, losses: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.GELU(), nn.Linear(32, 4))
        self.losses = losses

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)  # monitored: ModelCheckpoint keeps scores (tensors) in its state
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        with open(self.losses, "a") as f:
            f.write(f"{self.trainer.global_step} {outputs['loss'].item().hex()}\n")

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4, help="ModelCheckpoint(every_n_train_steps=...)")
    p.add_argument("--ckpt-dir", default="lightning_ckpts")
    p.add_argument("--ckpt-path", default=None, help="resume through Lightning's own fit(ckpt_path=...)")
    p.add_argument("--losses", default="losses.txt")
    p.add_argument("--out", default="final.pt")
    args = p.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 8, generator=g)
    data = TensorDataset(x, torch.tanh(x[:, :4] * x[:, 4:]))
    loader = DataLoader(data, batch_size=4, shuffle=True)  # 10 batches an epoch
    model = Tiny(args.losses)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.every, save_top_k=-1,
                                        monitor="train_loss")
    trainer = pl.Trainer(max_steps=args.max_steps, accelerator="cpu", devices=1, callbacks=[ckpt], logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader, ckpt_path=args.ckpt_path)
    torch.save({"state_dict": model.state_dict(), "optimizer_states": [trainer.optimizers[0].state_dict()],
                "lr_schedulers": [trainer.lr_scheduler_configs[0].scheduler.state_dict()],
                "global_step": trainer.global_step, "epoch": trainer.current_epoch}, args.out)


if __name__ == "__main__":
    main()
