"""Instrumentation for `ckptrun bench`: per-step timing and the reference checkpointers.

`train_gpt.py` imports this only when asked (`--timing-json`, `--ref-save`), so the example stays
a plain training script. The references are what people do without ckptrun, driven by the script
itself every `--ref-every` steps into `--ref-dir`, keeping the newest two saves (ckptrun's default):

- `torch`: `torch.save({model, optimizer, scheduler})` on the training path, no fsync (what most
  scripts do).
- `dcp-thread`, `dcp-process`: `torch.distributed.checkpoint.async_save`, its upload in a thread
  or in DCP's checkpoint daemon process, with one reused `DefaultStager` that stages in the
  background into shared memory (pinned on a GPU). As DCP's documentation requires, a save first
  waits for the previous upload, and the next optimizer step waits for the staging copy. The
  daemon of process mode is started before training, as ckptrun's engine is.

Recorded as JSON lines appended to `--timing-json` (one `start` line per process, so a killed
and restarted run leaves both attempts): each iteration's wall time and the part of it the loop
was blocked by reference checkpointing (`step`: wall_s, stall_s, compute_s, its forward,
backward and gradient clipping, the work before the optimizer step, and `t`, the wall clock when it
ended, as `start` has, for `bench --failures`); each save's bytes and write time, hand-off to on
disk, and `done_t`, the wall clock when it was on disk (`save`: the bench's freshness on disk);
with `--ref-resume`, the recovery time: start of main() to the end of the first
resumed step, before that step's own save, less the daemon's start (`recovery`: recovery_s, and
of it setup_s, main() to the optimizer's existence, and restore_s, the reference's own load).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

KEEP = 2


def _step_of(path: Path) -> int:
    return int(path.name.split("-")[1].split(".")[0])


def _newest(paths: list[Path]) -> list[Path]:
    return sorted(paths, key=_step_of, reverse=True)


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()


class TrainState:
    """The model, optimizer and LR scheduler a reference saves and restores."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, sched, device: torch.device) -> None:
        self.model, self.opt, self.sched, self.device = model, opt, sched, device


class TorchSave:
    """`torch.save` of the whole state, blocking the loop for the serialization and the write."""

    startup_s = 0.0

    def __init__(self, root: Path, state: TrainState, record: Callable[..., None]) -> None:
        self.root, self.state, self.record = root, state, record
        self.writer = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0

    def before_update(self) -> float:
        return 0.0

    def save(self, step: int) -> float:
        if not self.writer:
            return 0.0
        t0 = time.perf_counter()
        s, path = self.state, self.root / f"step-{step:08d}.pt"
        torch.save({"model": s.model.state_dict(), "optimizer": s.opt.state_dict(),
                    "scheduler": s.sched.state_dict()}, path)
        self.record(step=step, bytes=_size(path), write_s=time.perf_counter() - t0, done_t=time.time())
        for old in _newest(list(self.root.glob("step-*.pt")))[KEEP:]:
            _remove(old)
        return time.perf_counter() - t0

    def finish(self) -> None:
        return None

    def restore(self) -> int | None:
        saves = _newest(list(self.root.glob("step-*.pt")))
        if not saves:
            return None
        sd = torch.load(saves[0], map_location=self.state.device, weights_only=True)
        self.state.model.load_state_dict(sd["model"])
        self.state.opt.load_state_dict(sd["optimizer"])
        self.state.sched.load_state_dict(sd["scheduler"])
        return _step_of(saves[0])


class DcpAsyncSave:
    """`dcp.async_save` in thread or process mode; see the module docstring for the waits."""

    def __init__(self, root: Path, state: TrainState, record: Callable[..., None], mode: str, *, warm: bool) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.root, self.state, self.record, self.dcp = root, state, record, dcp
        self.own_group = not dist.is_initialized()
        if self.own_group:  # DCP needs a process group: a 1-rank gloo group, in memory
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # where process mode's daemon rendezvous
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.mode = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
        self.stager = _stager(state.device)
        self.pending: tuple[int, object, float, list[float]] | None = None  # step, response, t issued, t done
        t0 = time.perf_counter()
        if warm and self.mode is AsyncCheckpointerType.PROCESS:
            tmp = root / ".daemon-warmup"
            dcp.async_save({"w": torch.zeros(1)}, checkpoint_id=str(tmp), async_checkpointer_type=self.mode).result()
            shutil.rmtree(tmp)
        self.startup_s = time.perf_counter() - t0  # not part of recovery, like ckptrun's engine start

    def before_update(self) -> float:
        staging = getattr(self.pending[1], "staging_completion", None) if self.pending else None
        if staging is None or staging.done():
            return 0.0
        t0 = time.perf_counter()
        staging.result()
        return time.perf_counter() - t0

    def _complete(self) -> None:
        """Wait for the outstanding save to be on disk, record it, prune the older ones."""
        if self.pending is None:
            return
        step, resp, issued, done = self.pending
        self.pending = None
        getattr(resp, "upload_completion", resp).result()
        path = self.root / f"step-{step:08d}"
        end = done[0] if done else time.perf_counter()
        done_t = time.time() - (time.perf_counter() - end)
        self.record(step=step, bytes=_size(path), write_s=end - issued, done_t=done_t)
        for old in self._complete_saves()[KEEP:]:
            _remove(old)

    def save(self, step: int) -> float:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t0 = time.perf_counter()
        self._complete()
        s = self.state
        model_sd, optim_sd = get_state_dict(s.model, s.opt)
        issued = time.perf_counter()
        resp = self.dcp.async_save({"model": model_sd, "optimizer": optim_sd, "scheduler": s.sched.state_dict()},
                                   checkpoint_id=str(self.root / f"step-{step:08d}"),
                                   async_checkpointer_type=self.mode, async_stager=self.stager)
        done: list[float] = []
        getattr(resp, "upload_completion", resp).add_done_callback(lambda _: done.append(time.perf_counter()))
        self.pending = (step, resp, issued, done)
        return time.perf_counter() - t0

    def finish(self) -> None:
        self.before_update()
        self._complete()
        if self.stager is not None:
            self.stager.close()
        if self.own_group:
            torch.distributed.destroy_process_group()

    def _complete_saves(self) -> list[Path]:
        return _newest([p for p in self.root.glob("step-*") if (p / ".metadata").is_file()])

    def restore(self) -> int | None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        saves = self._complete_saves()
        if not saves:
            return None
        s = self.state
        model_sd, optim_sd = get_state_dict(s.model, s.opt)
        sd = {"model": model_sd, "optimizer": optim_sd, "scheduler": s.sched.state_dict()}
        self.dcp.load(sd, checkpoint_id=str(saves[0]))
        set_state_dict(s.model, s.opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
        s.sched.load_state_dict(sd["scheduler"])
        return _step_of(saves[0])


def _stager(device: torch.device):
    """DCP's own staging, with every option this torch and device allow (None: torch has none)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # older torch: async_save stages synchronously by itself
        return None
    cuda = device.type == "cuda"
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True,
                                        use_non_blocking_copy=cuda))


class Probe:
    """Per-step timing plus the reference checkpointer chosen by `--ref-save`."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer, sched,
                 device: torch.device, t_main: float) -> None:
        self.args, self.t_main, self.device = args, t_main, device
        self._out = open(args.timing_json, "a", buffering=1) if args.timing_json else None
        self.saver = None
        if args.ref_save != "none":
            root = Path(args.ref_dir)
            root.mkdir(parents=True, exist_ok=True)
            state, record = TrainState(model, opt, sched, device), lambda **save: self._emit("save", **save)
            self.saver = (TorchSave(root, state, record) if args.ref_save == "torch"
                          else DcpAsyncSave(root, state, record, args.ref_save.removeprefix("dcp-"),
                                            warm=args.ref_every <= args.steps))
        self.params = sum(p.numel() for p in model.parameters())
        self.setup_s = time.perf_counter() - t_main - (self.saver.startup_s if self.saver else 0.0)
        self.restore_s = 0.0
        self._resumed = False
        self._t = 0.0
        self._stall = 0.0
        self._compute = 0.0

    def _emit(self, event: str, **fields) -> None:
        if self._out is not None:
            self._out.write(json.dumps({"event": event, **fields}) + "\n")

    def resume(self, start: int) -> int:
        """The step to start from: the newest reference save's with `--ref-resume`, else `start`."""
        if self.args.ref_resume and self.saver is not None:
            t0 = time.perf_counter()
            step = self.saver.restore()
            self.restore_s = time.perf_counter() - t0
            if step is not None:
                start, self._resumed = step, True
        self._emit("start", pid=os.getpid(), start_step=start, params=self.params, ref=self.args.ref_save,
                   every=self.args.ref_every, t=time.time())
        return start

    def begin_step(self) -> None:
        self._t = time.perf_counter()
        self._stall = 0.0

    def before_update(self) -> None:
        if self.device.type == "cuda":  # the compute stream's kernels only: copy streams keep overlapping
            torch.cuda.current_stream(self.device).synchronize()
        self._compute = time.perf_counter() - self._t
        if self.saver is not None:
            self._stall += self.saver.before_update()

    def end_step(self, step: int) -> None:
        if self.device.type == "cuda":  # the step's kernels finished: its wall time is the device's, not the queue's
            torch.cuda.synchronize(self.device)
        if self._resumed:  # the step is done; its own save is not part of recovery
            self._resumed = False
            self._emit("recovery", step=step, recovery_s=time.perf_counter() - self.t_main - self.saver.startup_s,
                       setup_s=self.setup_s, restore_s=self.restore_s)
        if self.saver is not None and step % self.args.ref_every == 0:
            self._stall += self.saver.save(step)
        self._emit("step", step=step, wall_s=time.perf_counter() - self._t, stall_s=self._stall,
                   compute_s=self._compute, t=time.time())

    def finish(self) -> None:
        """Wait for outstanding saves (they are recorded), then close the timing file."""
        if self.saver is not None:
            self.saver.finish()
        self._emit("end")
        if self._out is not None:
            self._out.close()
