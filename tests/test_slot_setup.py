"""The staging slots are made before the first checkpoint (issue 58): sized when the optimizer
is made, allocated, faulted in and (on a GPU) page-locked on a set-up thread, not by the first
checkpoint on the training thread; a first checkpoint that comes sooner waits and says so once;
a restarted worker re-attaches to the slots its engine kept, allocating nothing. In-process,
against the runtime tests' fake engine; page-locking is faked (no GPU here), the thread that
does it recorded."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from pathlib import Path

import pytest
import torch
from test_runtime_capture import FakeEngine
from torch import nn

from ckptrun.config import RunConfig
from ckptrun.ipc import staging
from ckptrun.ipc.messages import Alloc, Hello, Message
from ckptrun.ipc.staging import create_slot
from ckptrun.worker import slots
from ckptrun.worker.runtime import Runtime

WIDTH = 256


class Recorder(FakeEngine):
    """The fake engine, noting the thread of each Alloc (answered `alloc_s` late); its Hello reply gives `kept` slots
    (a restarted worker's engine kept them), `busy` of them in its use."""

    def __init__(self, root: Path, kept: list[tuple[int, str, int]] = (), busy: list[int] = (),
                 alloc_s: float = 0.0) -> None:
        super().__init__(root)
        self.kept, self.busy, self.alloc_s = list(kept), list(busy), alloc_s
        self.paths.update({i: Path(path) for i, path, _ in kept})
        self.allocs: list[str] = []

    def request(self, msg: Message, timeout: float | None = None) -> dict:
        if isinstance(msg, Hello):
            return {"pid": 0, "slots": self.kept, "busy": self.busy, "committed_step": None}
        if isinstance(msg, Alloc):
            self.allocs.append(threading.current_thread().name)
            time.sleep(self.alloc_s)
        return super().request(msg, timeout)


def resident(buf: torch.Tensor) -> float:
    """The share of `buf`'s pages in memory (mincore): a slot's shared-memory pages exist only
    once something faulted them in."""
    page = mmap.PAGESIZE
    n = (buf.numel() + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(buf.numel()), vec) == 0
    return sum(v & 1 for v in vec) / n


def made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Recorder) -> Runtime:
    monkeypatch.delenv("CKPTRUN_FAULT", raising=False)
    cfg = RunConfig(strategy="checkfreq", dir=str(tmp_path / "ckpts"), every=1, max_inflight=2)
    return Runtime(cfg, 0, 0, 1, 0, connect=engine.connect)


def model_and_optimizer(rt: Runtime) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.register_step_pre_hook(rt.pre_step_hook)
    opt.register_step_post_hook(rt.post_step_hook)
    rt.on_optimizer(opt)
    return model, opt


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(8, WIDTH)).square().mean().backward()
    opt.step()


def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(predicate())


def test_slots_are_made_and_faulted_in_before_the_first_step(tmp_path, monkeypatch):
    """Once the optimizer exists, and before any step, the slots are there, big enough for the
    state the first step makes (AdamW's moments), with every page in memory; they were asked for
    off the training thread, and the checkpoints use them without asking again."""
    engine = Recorder(tmp_path)
    rt = made(tmp_path, monkeypatch, engine)
    model, opt = model_and_optimizer(rt)
    pool = rt.staging.pool
    assert wait_for(lambda: len(pool.buffers) == 2), "no staging slots before the first step"
    assert wait_for(lambda: all(resident(b) == 1.0 for b in list(pool.buffers.values()))), "slots not faulted in"
    assert engine.allocs and threading.main_thread().name not in engine.allocs, engine.allocs
    for _ in range(3):
        step(model, opt)
    from ckptrun.worker.slot_size import first_snapshot_bytes

    assert pool.nbytes >= first_snapshot_bytes(rt.state, opt)
    rt.finish()
    assert len(engine.allocs) == 1 and len(engine.persisted) == 3, (engine.allocs, len(engine.persisted))


def test_a_first_checkpoint_before_the_set_up_waits_and_says_so_once(tmp_path, monkeypatch, caplog):
    """The set-up is slow (the engine's Alloc, delayed): the first checkpoint, right after the
    first step, waits for it, counts the wait as stall of its own cause, and says so once;
    the record is whole."""
    engine = Recorder(tmp_path, alloc_s=0.4)
    rt = made(tmp_path, monkeypatch, engine)
    records: list[dict] = []
    end_step = rt.metrics.end_step
    monkeypatch.setattr(rt.metrics, "end_step", lambda s: records.append(end_step(s)) or records[-1])
    model, opt = model_and_optimizer(rt)
    for _ in range(3):
        step(model, opt)
    rt.finish()
    said = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(said) == 1 and "staging slots" in said[0], said
    assert records[0]["stall_s"].get("setup", 0.0) >= 0.3, records[0]
    assert all(r["stall_s"].get("setup", 0.0) == 0.0 for r in records[1:]), records
    assert [m.spec.step for m, _ in engine.persisted] == [1, 2, 3]
    assert engine.records()[1]["optimizers"], "the first record lacks the optimizer"


def test_a_restarted_worker_re_attaches_to_the_kept_slots_off_the_training_thread(tmp_path, monkeypatch):
    """The engine kept two slots (one holding a step in memory, busy): the restarted worker maps
    them, allocates nothing, page-locks them (faked: a GPU's path) on the set-up thread, leaves
    the held bytes as they are, and checkpoints into the free one."""
    size = 4 << 20
    kept = []
    for i in (0, 1):
        path = tmp_path / f"kept-{i}"
        create_slot(path, size)
        path.write_bytes(bytes([7 + i]) * size)
        kept.append((i, str(path), size))
    locked_on: dict[int, str] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def lock(ptr: int, nbytes: int) -> None:
        locked_on[ptr] = threading.current_thread().name

    for module in (staging, slots):  # (the worker page-locks through either)
        monkeypatch.setattr(module, "page_lock", lock, raising=False)
        monkeypatch.setattr(module, "page_unlock", lambda ptr: None, raising=False)
    engine = Recorder(tmp_path, kept, busy=[0])
    rt = made(tmp_path, monkeypatch, engine)
    assert not locked_on, "page-locked while the worker started (its training thread)"
    model, opt = model_and_optimizer(rt)
    rt.staging.ready()
    assert rt.staging.pool.locked == {0, 1}
    assert threading.main_thread().name not in locked_on.values(), locked_on
    step(model, opt)
    rt.finish()
    assert engine.allocs == [], "a restarted worker allocated slots its engine kept"
    assert [m.slot for m, _ in engine.persisted] == [1]
    assert Path(kept[0][1]).read_bytes() == bytes([7]) * size, "the step held in memory was written"


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps), "nadam": lambda ps: torch.optim.NAdam(ps),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1), "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "rmsprop-centered": lambda ps: torch.optim.RMSprop(ps, momentum=0.9, centered=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps), "asgd": lambda ps: torch.optim.ASGD(ps)}


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_the_first_snapshot_is_sized_exactly_before_the_optimizer_steps(kind):
    """Judged when the optimizer is made (its state mostly still to come), the first snapshot's
    size is what it takes after the first step, to the byte."""
    from ckptrun.storage.layout import Layout
    from ckptrun.storage.tree import flatten
    from ckptrun.worker.slot_size import first_snapshot_bytes
    from ckptrun.worker.state import TrainingState

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.Linear(32, 1))
    opt = OPTIMIZERS[kind](model.parameters())
    state = TrainingState(0, 1, write_once=False)
    state.add_optimizer(opt)
    guess = first_snapshot_bytes(state, opt)
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    assert guess == Layout.of(flatten(state.early_state())[1]).nbytes
