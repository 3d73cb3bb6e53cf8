"""The worker runtime's capture/seal ordering (DESIGN §2, "What the state of step t is"), in-process.

A Runtime runs against `FakeEngine`, an in-process stand-in for its engine connection (the
Runtime's `connect` seam): each `Persist` is kept with the slot's bytes as they were when it
arrived. A small script loop (BatchNorm, dropout, python/numpy/torch RNG draws, a StepLR, a
GradScaler whose scale grows every step, a tracked EMA and a tracked data Generator) records
its own state at the top of every iteration; the record of step t must equal it bit for bit:
parameters, optimizer state, buffers and RNG as right after optimizer step t (the next
forward changes them before the seal), schedulers, scaler and tracked objects as after their
update (taken at the seal: in the post-step hook they would be one update behind).
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import assert_same, pack, unpack
from torch import nn

from ckptrun.config import RunConfig
from ckptrun.ipc.messages import Alloc, Bye, Durable, Flush, Hello, Message, Persist, Retire, SlotFree
from ckptrun.ipc.staging import create_slot
from ckptrun.storage.store import full_name
from ckptrun.worker import discovery
from ckptrun.worker.runtime import Runtime

STEPS = 4
JOIN_S = 30.0


class FakeEngine:
    """The engine side of `EngineClient`, in-process: answers Hello, Alloc and Flush, keeps each
    Persist with its slot's bytes at arrival, and frees the slot (SlotFree, Durable) at once or
    when the test says (`auto_free=False`)."""

    def __init__(self, root: Path, *, auto_free: bool = True) -> None:
        self.root, self.auto_free = root, auto_free
        self.paths: dict[int, Path] = {}
        self.persisted: list[tuple[Persist, bytes]] = []
        self.on_event: Any = None

    def connect(self, address: str, authkey: bytes, on_event) -> FakeEngine:
        self.on_event = on_event
        return self

    def request(self, msg: Message, timeout: float | None = None) -> dict:
        if isinstance(msg, Hello):
            return {"pid": os.getpid(), "slots": [], "committed_step": None}
        if isinstance(msg, Alloc):
            first = len(self.paths)
            for i in range(first, first + msg.nslots):
                self.paths[i] = self.root / f"slot-{i}"
                create_slot(self.paths[i], msg.nbytes)
            return {"slots": [(i, str(self.paths[i]), msg.nbytes) for i in range(first, first + msg.nslots)]}
        assert isinstance(msg, Flush), msg
        return {}

    def send(self, msg: Message) -> None:
        if isinstance(msg, Persist):
            self.persisted.append((msg, self.slot_bytes(msg)))
            if self.auto_free:
                self.free(msg)
        else:
            assert isinstance(msg, (Retire, Bye)), msg

    def slot_bytes(self, msg: Persist) -> bytes:
        return self.paths[msg.slot].read_bytes()[: msg.nbytes]

    def free(self, msg: Persist) -> None:
        self.on_event(SlotFree(slot=msg.slot))
        self.on_event(Durable(step=msg.spec.step, record=msg.spec.record, nbytes=msg.nbytes, write_s=0.0))

    def close(self) -> None:
        pass

    def records(self) -> dict[int, dict]:
        """Each persisted step's state, decoded from the bytes its slot held when it was handed over."""
        return {m.spec.step: unpack(m.spec.skeleton, data, m.spec.tensors) for m, data in self.persisted}


class EMA:
    """A tracked object the script updates after the optimizer step."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.updates = model, 0
        self.shadow = [p.detach().clone() for p in model.parameters()]

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        for s, p in zip(self.shadow, self.model.parameters(), strict=True):
            s.mul_(0.5).add_(p, alpha=0.5)

    def state_dict(self) -> dict:
        return {"updates": self.updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        raise AssertionError("nothing is restored here")


class CopierGate:
    """Holds the runtime's background copier from each post-step until the next pre-step (after
    the next forward), and frees it only `delay_s` later: a buffer copied in the background would
    hold the next forward's values, and a seal that does not wait for the copy would hand over a
    slot still being written. Its hooks go on the optimizer before the runtime's."""

    def __init__(self, rt: Runtime, delay_s: float = 0.05) -> None:
        self.rt, self.delay_s = rt, delay_s
        self.gate = threading.Event()

    def attach(self, opt: torch.optim.Optimizer) -> None:
        opt.register_step_pre_hook(lambda *_: threading.Timer(self.delay_s, self.gate.set).start())
        opt.register_step_post_hook(lambda *_: self._hold())

    def _hold(self) -> None:
        self.gate = gate = threading.Event()
        self.rt.capture.thread.submit(gate.wait)

    def release(self) -> None:
        self.gate.set()


def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str, every: int = 1,
            auto_free: bool = True) -> tuple[Runtime, FakeEngine]:
    monkeypatch.delenv("CKPTRUN_FAULT", raising=False)
    engine = FakeEngine(tmp_path, auto_free=auto_free)
    cfg = RunConfig(strategy=strategy, dir=str(tmp_path / "ckpts"), every=every, max_inflight=2)
    return Runtime(cfg, 0, 0, 1, 0, connect=engine.connect), engine


def train(rt: Runtime, steps: int, *, gated: bool = False) -> dict[int, dict]:
    """The script: registers its objects as ckptrun's patches would, trains `steps` steps, and
    returns its own state at the top of each iteration after the first, keyed by completed steps."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.25), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gate = CopierGate(rt) if gated else None
    if gate is not None:
        gate.attach(opt)
    opt.register_step_pre_hook(rt.pre_step_hook)
    opt.register_step_post_hook(rt.post_step_hook)
    rt.on_optimizer(opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    rt.on_scheduler(sched)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    rt.on_scaler(scaler)
    ema, data = EMA(model), torch.Generator().manual_seed(1)
    rt.track("ema", ema)
    rt.track("data", data)
    truth = {}
    for _ in range(steps):
        x = torch.randn(16, 4, generator=data) + random.random() + float(np.random.rand())
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        ema.update()
        truth[rt.step] = unpack(*pack({
            "models": {"model": model.state_dict()}, "optimizers": {"optimizer": opt.state_dict()},
            "rng": discovery.rng_state(), "schedulers": [sched.state_dict()], "scalers": [scaler.state_dict()],
            "extra": {"ema": ema.state_dict(), "data": data.get_state()}}))
    if gate is not None:
        gate.release()
    rt.finish()
    return truth


def assert_records(engine: FakeEngine, truth: dict[int, dict], steps: list[int]) -> None:
    records = engine.records()
    assert [m.spec.step for m, _ in engine.persisted] == steps
    assert all(m.spec.record == full_name(m.spec.step) for m, _ in engine.persisted)
    for step in steps:
        assert set(records[step]) == set(truth[step]), step
        for key in truth[step]:
            assert_same(records[step][key], truth[step][key], f"step {step} {key}")


@pytest.mark.parametrize("strategy, gated", [("sync", False), ("checkfreq", True)])
def test_each_step_is_captured_after_its_update_and_sealed_after_the_scripts(strategy, gated, tmp_path, monkeypatch):
    rt, engine = runtime(tmp_path, monkeypatch, strategy)
    truth = train(rt, STEPS, gated=gated)
    assert_records(engine, truth, list(range(1, STEPS + 1)))


def test_a_final_step_that_is_not_due_is_captured_and_sealed_at_finish(tmp_path, monkeypatch):
    rt, engine = runtime(tmp_path, monkeypatch, "checkfreq", every=2)
    truth = train(rt, 5)
    assert_records(engine, truth, [2, 4, 5])


def test_a_slot_is_not_reused_before_the_engine_frees_it(tmp_path, monkeypatch):
    """Two slots, both handed over and held by the engine: capturing step 3 waits (back-pressure)
    without touching them, and then takes the slot the engine freed."""
    rt, engine = runtime(tmp_path, monkeypatch, "checkfreq", auto_free=False)
    result: dict[int, dict] = {}
    trainer = threading.Thread(target=lambda: result.update(train(rt, 3)), daemon=True)
    trainer.start()
    deadline = time.monotonic() + JOIN_S
    while rt.step < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # time enough to overwrite a slot, if the runtime would
    assert trainer.is_alive() and [m.spec.step for m, _ in engine.persisted] == [1, 2]
    held = [(m, data) for m, data in engine.persisted]
    assert held[0][0].slot != held[1][0].slot
    assert all(engine.slot_bytes(m) == data for m, data in held), "a slot the engine holds was written"
    engine.auto_free = True
    engine.free(held[0][0])
    trainer.join(JOIN_S)
    assert not trainer.is_alive()
    assert engine.persisted[2][0].slot == held[0][0].slot
    assert engine.slot_bytes(held[1][0]) == held[1][1]
    assert_records(engine, result, [1, 2, 3])


def test_a_slot_that_cannot_be_page_locked_is_used_pageable(tmp_path, monkeypatch, caplog):
    """On a GPU whose slots sit where Linux refuses to page-lock them (a disk's file system), the
    worker says why once and copies through pageable memory; it unlocks only what it locked."""
    from ckptrun.worker import slots

    refused = "cudaErrorInvalidValue (1: invalid argument)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(slots, "page_lock", lambda ptr, n: refused if n == 4096 else None)
    unlocked: list[int] = []
    monkeypatch.setattr(slots, "page_unlock", unlocked.append)
    specs = [(i, str(tmp_path / f"slot-{i}"), n) for i, n in enumerate((4096, 4096, 8192))]
    for _, path, n in specs:
        create_slot(Path(path), n)
    pool = slots.SlotPool()
    for generation in (specs[:2], specs[2:]):
        pool.add(generation)
        pool.settle(generation, pin=True)
    assert pool.locked == {2} and pool.unlocked_why == refused
    warned = [r.getMessage() for r in caplog.records if "could not be page-locked" in r.getMessage()]
    assert len(warned) == 1 and refused in warned[0] and "CKPTRUN_STAGING_DIR" in warned[0], warned
    locked_at = pool.buffers[2].data_ptr()
    pool.close()
    assert unlocked == [locked_at] and not pool.locked


def test_models_are_found_past_weak_proxies_dead_or_alive():
    """gc holds weakref proxies (torch.compile leaves some behind): a dead one raised
    ReferenceError out of the optimizer's constructor, and a live one is its module, not another."""
    import weakref

    live = nn.Linear(2, 2)
    proxies = [weakref.proxy(nn.Linear(2, 2)), weakref.proxy(live)]  # the first one's module is gone
    opt = torch.optim.SGD(live.parameters(), lr=0.1)
    assert discovery.owning_modules(opt) == [live] and proxies
