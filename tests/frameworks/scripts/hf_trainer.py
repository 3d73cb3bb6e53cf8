"""A user's HF `Trainer` script, unchanged for ckptrun: a tiny GPT-2 from a config (dropout on),
synthetic tokens reshuffled each epoch, gradient accumulation, warmup + cosine decay, HF's own
`checkpoint-N` folders and logs every few steps, optionally HF's own resume (`--resume-from`).

Writes each optimizer step's micro-batch losses as a JSON line to `--losses` (appended: a restarted
worker adds its own lines) and, after training, the final state to `--final`: model, optimizer,
scheduler, RNG, and the trainer state as JSON."""

import argparse
import dataclasses
import json
import os
import random

os.environ["OMP_NUM_THREADS"] = "1"  # one thread, also where accelerate would pick more (under torchrun)

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

SEQ, VOCAB, EXAMPLES = 16, 64, 36  # 9 batches of 4 an epoch: 5 optimizer steps, the last on one batch


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (EXAMPLES, SEQ), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return EXAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepLosses(TrainerCallback):
    """The loss of every forward pass, written per optimizer step."""

    def __init__(self, model: torch.nn.Module, path: str) -> None:
        self.path, self.losses = path, []
        model.register_forward_hook(lambda module, args, out: self.losses.append(out.loss.item()))

    def on_step_end(self, args, state, control, **kwargs):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": state.global_step, "losses": self.losses}) + "\n")
        self.losses = []


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--losses", required=True)
    p.add_argument("--final", required=True)
    p.add_argument("--resume-from", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    targs = TrainingArguments(
        output_dir=args.out, max_steps=24, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, warmup_steps=4, lr_scheduler_type="cosine", logging_steps=7, save_steps=5,
        include_num_input_tokens_seen=True, report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=[StepLosses(model, args.losses)])
    trainer.train(resume_from_checkpoint=args.resume_from)
    torch.save({"model": model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                "scheduler": trainer.lr_scheduler.state_dict(),
                "rng": {"python": random.getstate(), "numpy": torch.from_numpy(np.random.get_state()[1]),
                        "torch": torch.get_rng_state()},
                "trainer_state": json.dumps(dataclasses.asdict(trainer.state))}, args.final)


if __name__ == "__main__":
    main()
