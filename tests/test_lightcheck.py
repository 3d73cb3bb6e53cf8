"""`--strategy lightcheck` beyond the registry's contract tests: the optimizer step split by layer
is bit-identical to one step; the update of a layer never runs before that layer's copy of the
previous step is complete, while earlier layers' updates do overlap a slow later copy; a crash at
each stage of a slot's write leaves the other slot's step committed and intact; `--layer-wait
whole` and `--copy-to host` checkpoint the same states as `--copy-to region`; a mid-write kill
with host copies resumes exactly."""

from __future__ import annotations

import os
import random
import shutil
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from conftest import (
    EXAMPLE,
    STEPS,
    TINY,
    assert_same,
    assert_training_state,
    ckptrun,
    load,
    ok,
    pack,
    restore,
    run_events,
    unpack,
)
from test_crash_matrix import assert_clean_and_final, resume_run
from test_pccheck import FakeEngine, committed, wait_for
from torch import nn

from ckptrun.config import RunConfig
from ckptrun.ipc.messages import Bye, Flush, Hello, Message, RecordSpec
from ckptrun.storage.layout import view
from ckptrun.storage.region import Regions, RegionWriter
from ckptrun.storage.schema import full_name
from ckptrun.strategies import REGISTRY
from ckptrun.strategies.lightcheck.engine import LightCheckHandler
from ckptrun.strategies.lightcheck.layers import LayerSteps, why_not
from ckptrun.strategies.lightcheck.messages import Ready, Seal, Take
from ckptrun.worker.copier import Copier
from ckptrun.worker.runtime import Runtime

OPTIMIZERS = {
    "sgd-momentum": lambda ps, fe: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4, foreach=fe),
    "adam": lambda ps, fe: torch.optim.Adam(ps, lr=1e-2, foreach=fe),
    "adamw": lambda ps, fe: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=fe),
}


def model_and_data(seed: int = 0) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 1))
    return model, [torch.randn(8, 6) for _ in range(12)]


def train(opt_name: str, foreach: bool, split: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """12 steps with two param groups, clipping and a scheduler; with `split`, each update runs as
    `LayerSteps` does it in lightcheck (parts of random sizes, then the real step finding nothing)."""
    model, data = model_and_data()
    params = list(model.parameters())
    opt = OPTIMIZERS[opt_name]([{"params": params[:3]}, {"params": params[3:], "lr": 3e-3}], foreach)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    layers, rng = LayerSteps(opt), random.Random(1)
    for x in data:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if split:
            grads = [p.grad for p in params]
            calls = layers.run(lambda i: min(len(params), i + rng.randint(1, 3)))
            assert calls > 1
            opt.step()  # finds no gradient: updates nothing
            layers.restore()
            assert all(p.grad is g for p, g in zip(params, grads, strict=True))
        else:
            opt.step()
        sched.step()
    return model, opt


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_update_split_by_layer_is_bit_identical(opt_name, foreach):
    whole_model, whole_opt = train(opt_name, foreach, split=False)
    split_model, split_opt = train(opt_name, foreach, split=True)
    assert why_not(whole_opt) is None
    assert_same(unpack(*pack(split_model.state_dict())), unpack(*pack(whole_model.state_dict())), "model")
    assert_same(unpack(*pack(split_opt.state_dict())), unpack(*pack(whole_opt.state_dict())), "optimizer")


class RegionEngine:
    """The engine side of `EngineClient`, in-process, for lightcheck: Take is answered with a
    free slot of a real region file; at Ready (with the Seal) the slot's bytes are kept."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.handler = LightCheckHandler(RegionContext(root))
        self.on_event = None
        self.sealed: dict[int, tuple[Seal, bytes]] = {}

    def connect(self, address, authkey, on_event) -> RegionEngine:
        self.on_event = on_event
        return self

    def request(self, msg: Message, timeout: float | None = None) -> dict:
        if isinstance(msg, Hello):
            return {"pid": os.getpid(), "slots": [], "committed_step": None}
        if isinstance(msg, Take):  # answered once a slot is free (a commit frees one)
            msg.id = msg.step
            self.handler.handle(msg)
            wait_for(lambda: msg.id in self.handler.ctx.replies)
            return self.handler.ctx.replies.pop(msg.id)
        assert isinstance(msg, Flush), msg
        self.handler.ctx.join()
        return {}

    def send(self, msg: Message) -> None:
        if isinstance(msg, Seal | Ready):
            job = self.handler.jobs[msg.step if isinstance(msg, Ready) else msg.spec.step]
            seal = msg if isinstance(msg, Seal) else job.seal
            if seal is not None and (job.ready or isinstance(msg, Ready)):  # complete: keep its bytes
                self.sealed[job.step] = (seal, bytes(job.writer.view(job.slot)[: seal.nbytes]))
            self.handler.handle(msg)
        else:
            assert isinstance(msg, Bye), msg

    def close(self) -> None:
        pass


class RegionContext(FakeEngine):
    """pccheck's fake EngineContext plus replies, and the data of each committed slot."""

    def __init__(self, root: Path, keep: int = 1) -> None:
        super().__init__(root, 0, 1, keep=keep)
        self.replies: dict[int, dict] = {}

    def reply(self, request: Message, **body) -> None:
        self.replies[request.id] = body

    def save_error(self, step: int, record: str, error: str) -> None:
        self.events.append(("save_error", error))


def slow_copier(monkeypatch: pytest.MonkeyPatch, slow_key: str, delay_s: float, copies: dict) -> None:
    """The runtime's copier, but the copy of `slow_key` takes `delay_s` longer; the end of each
    copy of a key is appended to `copies[key]` (its n-th copy belongs to the n-th snapshot)."""

    def copy(buf, layout, tensors, progress=None) -> None:
        with torch.no_grad():
            for spec in layout.specs:
                if spec.key in tensors:
                    if spec.key == slow_key:
                        time.sleep(delay_s)
                    view(buf, spec).copy_(tensors[spec.key])
                    copies[spec.key].append(time.perf_counter())
                    if progress is not None:
                        progress(spec.offset + spec.nbytes)
        if progress is not None:
            progress(layout.nbytes)

    monkeypatch.setattr(Copier, "copy", staticmethod(copy))


SLOW = "models/model/3.weight"


def test_update_of_a_layer_waits_for_its_own_copy_only(tmp_path, monkeypatch):
    """A copier slow on one layer: every layer's update of step t+1 starts after that layer's
    copy of step t ended; the layers before the slow one are updated before its copy ends."""
    monkeypatch.delenv("CKPTRUN_FAULT", raising=False)
    copies: dict[str, list[float]] = defaultdict(list)
    updates: list[tuple[int, list[str], float]] = []  # (steps done, keys updated, when)
    slow_copier(monkeypatch, SLOW, 0.3, copies)
    engine = RegionEngine(tmp_path / "ckpts")
    cfg = RunConfig(strategy="lightcheck", dir=str(tmp_path / "ckpts"), every=1, max_inflight=1, keep=1,
                    options={"copy_to": "region"})
    rt = Runtime(cfg, 0, 0, 1, 0, connect=engine.connect)
    model, data = model_and_data()
    keys = {id(p): f"models/model/{name}" for name, p in model.named_parameters()}
    step_part = LayerSteps._step_part

    def logged_part(self, part):
        updates.append((rt.step, [keys[id(p)] for p in part], time.perf_counter()))
        step_part(self, part)

    monkeypatch.setattr(LayerSteps, "_step_part", logged_part)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.register_step_pre_hook(rt.pre_step_hook)
    opt.register_step_post_hook(rt.post_step_hook)
    rt.on_optimizer(opt)
    truth = {}
    for x in data[:4]:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        truth[rt.step] = unpack(*pack({"model": model.state_dict(), "opt": opt.state_dict()}))
    rt.finish()

    assert {step for step, _, _ in updates} == {1, 2, 3}  # every update after a snapshot ran split
    for step, updated, t in updates:
        for key in updated:
            assert copies[key][step - 1] < t, (step, key)
    for step in (1, 2, 3):
        assert min(t for s, _, t in updates if s == step) < copies[SLOW][step - 1]
    for step in truth:  # the region slot held step t's state as after update t, not t+1
        seal, data_bytes = engine.sealed[step]
        got = unpack(seal.spec.skeleton, data_bytes, seal.spec.tensors)
        assert_same(got["models"]["model"], truth[step]["model"], f"step {step} model")
        assert_same(got["optimizers"]["optimizer"]["state"], truth[step]["opt"]["state"], f"step {step} state")


def region_checkpoint(handler: LightCheckHandler, step: int, *, ready: bool = True) -> tuple[RegionWriter, int]:
    """One lightcheck checkpoint of 4096 bytes `step`, the trainer's copy written into the file."""
    ctx = handler.ctx
    take = Take(step=step, capacity=8192, meta_hint=1024, inflight=1, id=step)
    handler.handle(take)
    reply = ctx.replies.pop(step)
    fd = os.open(Path(ctx.root) / reply["file"], os.O_RDWR)
    try:
        os.pwrite(fd, bytes([step]) * 4096, reply["data_at"])
    finally:
        os.close(fd)
    handler.handle(Seal(slot=-1, nbytes=4096, spec=RecordSpec(record=full_name(step), kind="full", step=step,
                                                              skeleton={}, tensors={}, meta={})))
    if ready:
        handler.handle(Ready(step=step))
    job = handler.jobs.get(step)
    return (job.writer, job.slot) if job else (handler.writer, -1)


def test_only_a_region_no_trainer_maps_bypasses_the_page_cache(tmp_path):
    """--copy-to region: the trainer maps the region and copies into it, so the engine writes it
    through the page cache (coherent with that mapping); --copy-to host: nobody maps it, so its
    data goes through the engine's file writer (O_DIRECT with the native one), in a region of
    its own: a take of the other kind starts a new generation."""
    root = tmp_path / "ckpts"
    root.mkdir()
    handler = LightCheckHandler(RegionContext(root))
    writers = []
    for step, mapped in enumerate((True, False, False), 1):
        handler.handle(Take(step=step, capacity=8192, meta_hint=1024, inflight=1, id=step, mapped=mapped))
        writers.append(handler.jobs[step].writer)
    assert [w.direct for w in writers] == [False, True, True]
    assert writers[0] is not writers[1] and writers[1] is writers[2]


STAGES = ["copy", "sync", "write_meta", "publish", "after"]


@pytest.mark.parametrize("stage", STAGES)
def test_crash_at_each_stage_of_a_slot_write_keeps_the_other_slot(stage, tmp_path, monkeypatch):
    """Two slots (--keep 1, one in flight). Step 1 commits; step 2's write stops at `stage` (the
    directory is copied as it is at that moment: a machine crash): step 1 is then still
    committed with its bytes, and step 2 only once its pointer moved."""
    root = tmp_path / "ckpts"
    root.mkdir()
    handler = LightCheckHandler(RegionContext(root))
    region_checkpoint(handler, 1)
    handler.ctx.join()
    wait_for(lambda: handler.ctx.of("committed") == [1])
    crashed = tmp_path / "crashed"
    original = {name: getattr(RegionWriter, name) for name in ("sync", "write_meta", "publish")}

    def crash_before(name):
        def method(self, *args, **kwargs):
            if not crashed.exists():
                shutil.copytree(root, crashed)
            return original[name](self, *args, **kwargs)
        return method

    if stage in original:
        monkeypatch.setattr(RegionWriter, stage, crash_before(stage))
    region_checkpoint(handler, 2, ready=stage != "copy")
    handler.ctx.join()
    if not crashed.exists():
        shutil.copytree(root, crashed)
    assert committed(crashed) == ([2] if stage == "after" else [1])  # --keep 1
    regions = Regions(crashed)
    manifests, bad = regions.scan()
    assert bad == {}
    for m in manifests:
        c = regions.copy(m, 0)
        with open(crashed / c.file, "rb") as f:
            f.seek(c.data_offset)
            assert f.read(4096) == bytes([m.step]) * 4096
    if stage == "copy":  # the trainer died mid-copy: a new worker's flush gives the slot back
        handler.flush()
        region_checkpoint(handler, 3)
        handler.ctx.join()
        wait_for(lambda: handler.ctx.of("committed") == [1, 3])


@pytest.fixture(scope="module")
def host_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The crash matrix's mid-write kill for --copy-to host (the CPU default; the contract suite
    runs the mapped-region path, the registry's short-run flags), keeping every step."""
    cwd = tmp_path_factory.mktemp("host")
    resume_run(cwd, "lightcheck", cwd / "ckpts", "--copy-to", "host", "--keep", "0", "--max-restarts", "1",
               fault="kill:step=7:phase=write")
    return cwd


def test_a_killed_run_with_host_copies_finishes_exactly(host_run, example_truth):
    assert [e["restart_count"] for e in run_events(host_run / "metrics")] == [0, 1], "the fault did not fire"
    assert_training_state(load(host_run / "final.pt"), example_truth(STEPS))
    assert_clean_and_final(host_run / "ckpts", example_truth(STEPS))


def test_modes_save_the_same_states(example_run, host_run, tmp_path):
    """--layer-wait whole and --copy-to host (killed and resumed) checkpoint exactly what the
    default mode ("layer", in the region the short-run flags ask for: the crash matrix's run) does."""
    assert REGISTRY["lightcheck"].short_run_flags == ("--copy-to", "region")
    dirs = {"layer": example_run("lightcheck"), "host": host_run / "ckpts", "whole": tmp_path / "ck-whole"}
    ok(ckptrun(tmp_path, "--strategy", "lightcheck", "--copy-to", "region", "--layer-wait", "whole", "--dir",
               dirs["whole"], "--keep", "0", "--no-dashboard", EXAMPLE, *TINY))
    for step in (3, 6, 12):
        states = {m: restore(tmp_path, d, step)[0] for m, d in dirs.items()}
        for mode in ("whole", "host"):
            assert list(states[mode]) == list(states["layer"]) and "model" in str(list(states[mode]))
            for key in states[mode]:  # python's RNG is seeded per process by the example; the rest is exact
                if key != "rng":
                    assert_same(states[mode][key], states["layer"][key], f"{mode} {key}")


def test_a_bad_mode_is_refused_before_anything_starts(tmp_path):
    proc = ckptrun(tmp_path, "--strategy", "lightcheck", "--copy-to", "disk", "--dir", "ckpts", EXAMPLE, *TINY)
    assert proc.returncode == 2
    assert "--copy-to is auto, region or host (got 'disk')" in proc.stderr
    assert not (tmp_path / "ckpts").exists()


def test_a_failed_write_of_host_copies_gives_the_staging_slot_back(tmp_path, monkeypatch):
    """--copy-to host: if writing the staging slot into the region fails, the error is reported and
    the staging slot still goes back to the worker (which would otherwise wait for it forever)."""
    root = tmp_path / "ckpts"
    root.mkdir()
    handler = LightCheckHandler(RegionContext(root))

    def failing_write(self, slot, offset, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(RegionWriter, "write", failing_write)
    handler.handle(Take(step=1, capacity=8192, meta_hint=1024, inflight=1, id=1))
    handler.handle(Seal(slot=0, nbytes=4096, spec=RecordSpec(record=full_name(1), kind="full", step=1,
                                                            skeleton={}, tensors={}, meta={})))
    handler.handle(Ready(step=1))
    handler.ctx.join()
    assert handler.ctx.of("free") == [0]
    assert [e for k, e in handler.ctx.events if k == "save_error"] == ["write: [Errno 28] No space left on device"]
    assert committed(root) == []
