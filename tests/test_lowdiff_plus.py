"""`--strategy lowdiff+` beyond the registry's contract tests: the engine's CPU replica equals the
trainer's state at every step (Adam/AdamW/SGD-momentum, schedulers, clipping, GradScaler
unscaling, gradient accumulation), gradients are copied during backward unless the script changes
them afterwards; a worker crash resumes from the engine's memory with no disk read, also with
two DDP ranks; an engine crash falls back to the newest durable step; what lowdiff+ cannot
hold is refused at start."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import (
    EXAMPLE,
    LONG,
    STEPS,
    TINY,
    assert_ddp_ranks_resume_from_memory,
    assert_same,
    assert_training_state,
    ckptrun,
    cli,
    error_line,
    load,
    ok,
    pack,
    run_events,
    spawn,
    subclassed_optimizer_script,
)
from test_crash_matrix import assert_clean_and_final, resume_run
from test_runtime_capture import FakeEngine
from torch import nn
from torch.nn.utils import clip_grad

from ckptrun.config import RunConfig
from ckptrun.engine.held_copies import HeldCopy, checked, cut, spec_of
from ckptrun.errors import CkptrunError, CorruptCheckpoint
from ckptrun.ipc.messages import FetchHeld, Flush, Message, Persist, RecordSpec, SlotFree
from ckptrun.ipc.staging import EngineSlot
from ckptrun.restore.recovery import optimizer_classes
from ckptrun.storage.skeleton import TENSOR
from ckptrun.storage.store import Store, full_name
from ckptrun.storage.tiers.dpshared import kept_tensors, shared_keys
from ckptrun.strategies.lowdiff_plus import engine as lowdiff_plus_engine
from ckptrun.strategies.lowdiff_plus.copies import REPLICA_META, PartnerReplicas
from ckptrun.strategies.lowdiff_plus.engine import LowDiffPlusHandler
from ckptrun.strategies.lowdiff_plus.replica import KEPT_BACK, Arena, tree_of
from ckptrun.strategies.lowdiff_plus.trainer import check_host_memory
from ckptrun.worker import patches, resume
from ckptrun.worker.runtime import Runtime

PERSIST_NEVER = ("--persist-every", "1000")  # on disk: the start and the final step only


class ReplicaContext:
    """The EngineContext surface the lowdiff+ handler uses, in-process (writes are recorded)."""

    replicas = None  # (no --replicas: see ShippedCopies)

    def __init__(self, engine: ReplicaEngine) -> None:
        self.engine, self.rank = engine, 0
        self.written: list[int] = []
        self.in_memory_steps: list[int] = []

    def slot_view(self, slot: int) -> memoryview:
        return self.engine.view(slot)

    def free_slot(self, slot: int) -> None:
        self.engine.on_event(SlotFree(slot=slot))

    def emit(self, **event) -> None:
        pass

    def in_memory(self, step: int, nbytes: int) -> None:
        self.in_memory_steps.append(step)

    def write_fault_due(self, step: int) -> bool:
        return False

    def shared_file(self, name: str) -> Path:
        return self.engine.root / name

    def save_error(self, step: int, record: str, error: str) -> None:
        raise AssertionError(error)

    def run(self, fn, *args) -> None:
        fn(*args)

    def write_now(self, spec, data) -> int:
        self.written.append(spec.step)
        return len(data)


class ReplicaEngine(FakeEngine):
    """runtime_capture's in-process engine, with the real lowdiff+ handler behind it."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.views: dict[int, EngineSlot] = {}
        self.handler = LowDiffPlusHandler(ReplicaContext(self))

    def view(self, slot: int) -> memoryview:
        if slot not in self.views:
            self.views[slot] = EngineSlot(self.paths[slot], self.paths[slot].stat().st_size)
        return self.views[slot].view

    def request(self, msg: Message, timeout: float | None = None) -> dict:
        if isinstance(msg, FetchHeld):
            return self.handler.fetch(msg.step)
        if isinstance(msg, Flush):
            self.handler.flush()
        return super().request(msg, timeout)

    def send(self, msg: Message) -> None:
        if isinstance(msg, Persist):
            self.handler.handle(msg)
        else:
            super().send(msg)

    def dispose(self) -> None:
        for slot in self.views.values():
            slot.close(unlink=False)
        self.handler.own.stepped.drop()
        self.handler.copies.close()


class Net(nn.Module):
    """BatchNorm (buffers the forward changes) and dropout (RNG): post-step state a replay cannot rebuild."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


VARIANTS = {  # id -> (optimizer, clip, GradScaler, micro-batches per step, copied in backward, --rebase-every)
    "adam-lambdalr": ("adam", False, False, 1, True, "auto"),
    "sgd-nesterov-steplr-accum2": ("sgd", False, False, 2, True, "auto"),
    "adamw-clip": ("adamw", True, False, 1, True, "auto"),  # clipping's coefficient goes to the engine
    "adamw-clip-unrouted": ("adamw", True, False, 1, False, "auto"),  # clipped where ckptrun cannot see it
    "adamw-gradscaler-clip": ("adamw", True, True, 1, True, "auto"),  # unscaling's coefficient too
    "adam-rebase-every-7": ("adam", False, False, 1, True, "7"),  # 2 staging slots go round
    "sgd-clip-accum2": ("sgd", True, False, 2, True, "auto"),
}


def optimizer(name: str, model: Net) -> torch.optim.Optimizer:
    head = list(model.head.parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in head)]
    groups = [{"params": rest}, {"params": head, "lr": 0.02}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(groups, lr=1e-2, weight_decay=0.01)


def hooked(cfg: RunConfig, engine: ReplicaEngine, opt_name: str) -> tuple[Runtime, Net, torch.optim.Optimizer]:
    """A worker's Runtime on `engine`, hooked into a fresh Net's optimizer (seeded alike each time)."""
    rt = Runtime(cfg, 0, 0, 1, 0, connect=engine.connect)
    torch.manual_seed(0)
    model = Net()
    opt = optimizer(opt_name, model)
    opt.register_step_pre_hook(rt.pre_step_hook)
    opt.register_step_post_hook(rt.post_step_hook)
    rt.on_optimizer(opt)
    return rt, model, opt


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_replica_equals_the_trainer_at_every_step(variant, tmp_path, monkeypatch, request):
    """50 steps in-process against the real handler: after every step the engine's replica is
    bit-identical to the trainer's model and optimizer, and each step is reported in memory."""
    monkeypatch.delenv("CKPTRUN_FAULT", raising=False)
    opt_name, clip, scaled, micro, layerwise, rebase = VARIANTS[variant]
    engine = ReplicaEngine(tmp_path)
    request.addfinalizer(engine.dispose)
    cfg = RunConfig(strategy="lowdiff+", dir=str(tmp_path / "ckpts"), every=1, max_inflight=2, keep=1,
                    options={"persist_every": "1000", "rebase_every": rebase})
    rt, model, opt = hooked(cfg, engine, opt_name)
    sched = (torch.optim.lr_scheduler.StepLR(opt, 7, 0.5) if opt_name == "sgd" else
             torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s)))
    rt.on_scheduler(sched)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaled else None
    if scaler:
        rt.on_scaler(scaler)
    strategy = rt.strategy
    # the process-wide patches route clipping and unscaling to this strategy (restored after)
    monkeypatch.setattr(clip_grad, "_clip_grads_with_norm_", clip_grad._clip_grads_with_norm_)
    monkeypatch.setattr(torch.amp.GradScaler, "_unscale_grads_", torch.amp.GradScaler._unscale_grads_)
    patches._route_clipping(strategy)
    if variant.endswith("unrouted"):  # e.g. a framework's own clipping: the version counters say so
        monkeypatch.setattr(clip_grad, "_clip_grads_with_norm_", clip_grad._clip_grads_with_norm_.__wrapped__)
    copied_in_backward = []
    before_step = strategy.before_step

    def counted(step: int) -> None:
        copied_in_backward.append(len(strategy.copied))
        before_step(step)

    monkeypatch.setattr(strategy, "before_step", counted)
    truth, replica = {}, engine.handler.own.stepped
    for it in range(50):
        opt.zero_grad()
        for m in range(micro):
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 * it + m))
            loss = model(x).pow(2).mean() / micro
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        scaler.step(opt) if scaler else opt.step()
        if scaler:
            scaler.update()
        sched.step()
        truth[rt.step] = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
        held = replica.replica
        if rt.step > 1:  # step t's gradients reach the engine at step t+1's pre-step
            assert held.step == rt.step - 1
            assert_replica(held, truth[held.step])
    rt.finish()
    assert replica.replica.step == rt.step and rt.step >= 45  # (GradScaler may skip a step)
    assert_replica(replica.replica, truth[rt.step])
    assert engine.handler.ctx.in_memory_steps == list(range(0, rt.step + 1))  # a re-base's step once
    # the replica's arena: laid out at the start, again once Adam/SGD create their state, and at each re-base
    assert engine.handler.generation == (2 if rebase == "auto" else 2 + rt.step // int(rebase))
    assert engine.handler.ctx.written == [0, rt.step]  # the start and the final step: --persist-every 1000
    if layerwise:  # every gradient was in the slot before the optimizer step began
        assert copied_in_backward[1:] == [len(list(model.parameters()))] * (len(copied_in_backward) - 1)
        assert strategy.recopied == 0
    else:  # every gradient changed after backward: copied at the optimizer step instead
        assert not strategy.layerwise and strategy.recopied > 0


def test_on_a_gpu_auto_rebases_at_each_persisted_step(tmp_path, monkeypatch, request):
    """On a GPU the replica's CPU arithmetic differs from the device's by rounding, so with
    --rebase-every auto a real snapshot replaces the replica at each step it persists, and at
    the final step written at exit: every record written is the device's own state. (The GPU is
    stood in for: `_on_gpu`.) With an explicit --rebase-every the persisted steps are stepped
    replicas, as asked."""
    monkeypatch.delenv("CKPTRUN_FAULT", raising=False)
    from ckptrun.strategies.lowdiff_plus.trainer import LowDiffPlus

    monkeypatch.setattr(LowDiffPlus, "_on_gpu", lambda self: True)
    for rebase, generations in (("auto", 2 + 3), ("0", 2)):  # re-based at steps 10, 20 and 25 / never
        (tmp_path / rebase).mkdir()
        engine = ReplicaEngine(tmp_path / rebase)
        request.addfinalizer(engine.dispose)
        cfg = RunConfig(strategy="lowdiff+", dir=str(tmp_path / rebase / "ckpts"), every=1, max_inflight=2, keep=0,
                        options={"persist_every": "10", "rebase_every": rebase})
        rt, model, opt = hooked(cfg, engine, "adam")
        for it in range(25):
            opt.zero_grad()
            model(torch.randn(8, 6, generator=torch.Generator().manual_seed(it))).pow(2).mean().backward()
            opt.step()
        rt.finish()
        truth = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        assert_replica(engine.handler.own.stepped.replica, truth)
        assert engine.handler.ctx.written == [0, 10, 20, 25], rebase
        assert engine.handler.generation == generations, rebase
        # a resume from memory is told whether the replica is the trainer's own bits (else: within rounding)
        assert engine.handler.fetch()["exact"] is (rebase == "auto"), rebase


def assert_replica(replica, truth: dict) -> None:
    state = replica.full_state()
    assert_same(dict(state["models"]["model"]), dict(truth["model"]), f"step {replica.step} model")
    assert_same(state["optimizers"]["optimizer"], truth["optimizer"], f"step {replica.step} optimizer")


def test_worker_crash_resumes_from_memory_and_engine_crash_from_disk(example_truth, tmp_path):
    """--persist-every 5. The worker killed at step 7: the restarted worker resumes at step 6,
    which no record holds (it came from the engine's replica). Then the engine (and its replica)
    dies while writing step 9: the new engine holds nothing, so the run resumes from the newest
    durable replica write (step 5). Both end bit-exact."""
    proc = resume_run(tmp_path, "lowdiff+", tmp_path / "ckpts", "--persist-every", "5", "--max-restarts", "2",
                      fault="kill:step=7;kill-engine:step=9:phase=write")
    attempts = run_events(tmp_path / "metrics")
    assert [(e["restart_count"], e["resume_step"]) for e in attempts] == [(0, 0), (1, 6), (2, 5)]
    assert "resumed step 6 from the checkpoint engine's memory (no disk read)" in proc.stderr
    steps = [m.step for m in Store(tmp_path / "ckpts").manifests()]
    assert set(steps) <= {0, 5, 10, STEPS} and steps[-1] == STEPS, steps  # step 6 lived in memory only
    assert_training_state(load(tmp_path / "final.pt"), example_truth(STEPS))
    assert_clean_and_final(tmp_path / "ckpts", example_truth(STEPS))


class NoDisk:
    def __getattr__(self, name: str):
        raise AssertionError(f"the resume decision read the checkpoint directory (Store.{name})")


class HeldClient:
    def request(self, msg: Message) -> dict:
        return {"committed_step": 0, "held": [[6, 4096]]}


def test_resume_from_memory_reads_nothing_from_disk():
    """The resume decision of a restarted worker whose engine holds a step touches no record."""
    rt = type("Rt", (), {"client": HeldClient(), "restart_count": 1, "world_size": 1, "rank": 0,
                         "cfg": RunConfig(strategy="lowdiff+", dir="unused")})()
    assert resume.agreed_resume(rt, NoDisk()) == (6, 4096)


def test_ddp_two_ranks_resume_from_memory_exactly(tmp_path):
    """Rank 1 killed at step 5: both ranks' engines hold step 4, both resume from memory there."""
    assert_ddp_ranks_resume_from_memory(tmp_path, ["--strategy", "lowdiff+", *PERSIST_NEVER])


def test_host_memory_too_small_is_refused():
    with pytest.raises(CkptrunError) as e:
        check_host_memory(6 << 30, available=8 << 30)
    assert e.value.exit_code == 2 and "12.0 GiB" in str(e.value) and "--strategy lowdiff" in str(e.value)
    check_host_memory(1 << 30, available=8 << 30)


def test_an_optimizer_the_engine_cannot_build_is_refused(tmp_path):
    script = subclassed_optimizer_script(tmp_path)
    proc = ckptrun(tmp_path, "--strategy", "lowdiff+", "--dir", "ckpts", script)
    line = error_line(proc)
    assert proc.returncode == 2 and "__main__.Mine is not a torch.optim optimizer" in line, line
    assert "--strategy lowdiff" in line


def test_ls_shows_the_in_memory_step_beside_the_durable_ones(tmp_path):
    """While the run lives, `ls` lists the step its engine holds (kind memory) beside the committed
    ones; once it ends, only records remain."""
    ckpt = tmp_path / "ckpts"
    run = spawn(tmp_path, "--no-dashboard", "--strategy", "lowdiff+", *PERSIST_NEVER, "--dir", ckpt, EXAMPLE, *LONG)
    try:
        deadline = time.monotonic() + 60
        while True:
            listed = cli(tmp_path, "ls", "--dir", ckpt, "--json")
            rows = json.loads(listed.stdout) if listed.returncode == 0 else []  # (no directory yet)
            memory = [r for r in rows if r["kind"] == "memory"]
            if memory and memory[0]["step"] >= 3:
                break
            assert time.monotonic() < deadline and run.poll() is None, (tmp_path / "ckptrun.log").read_text()
            time.sleep(0.2)
        assert [r["step"] for r in rows if r["kind"] == "full"] == [0]
        assert memory[0]["ranks"] == 1 and memory[0]["bytes"] > 0 and memory[0]["layout"] == "engine memory"
    finally:
        os.killpg(run.pid, signal.SIGTERM)
        run.wait(timeout=60)
    rows = json.loads(ok(cli(tmp_path, "ls", "--dir", ckpt, "--json")).stdout)
    assert [r["kind"] for r in rows] == ["full", "full"]  # the start and the step it stopped after


@pytest.mark.parametrize(("flag", "value", "says"), [("--persist-every", "0", "integer in [1,"),
                                                     ("--hw-failure-share", "1.5", "fraction in (0, 1]"),
                                                     ("--rebase-every", "often", "integer in [0,")],
                         ids=["persist-every", "hw-failure-share", "rebase-every"])
def test_a_bad_option_is_refused_before_anything_is_created(flag, value, says, tmp_path):
    proc = ckptrun(tmp_path, "--strategy", "lowdiff+", flag, value, "--dir", "ckpts", EXAMPLE, *TINY)
    line = error_line(proc)
    assert proc.returncode == 2 and flag in line and says in line, line
    assert not (tmp_path / "ckpts").exists()


class ShippedCopies:
    """The replicator as a lowdiff+ handler sees it (`handlers.Replicas`): what it offers is
    delivered, checked as a partner's receiving thread checks it, to `partner` (a copy of rank
    0's replica) at once."""

    def __init__(self, partner: PartnerReplicas) -> None:
        self.partner, self.due, self.kinds = partner, True, []
        self.damage = False

    def offer_copy(self, copy) -> None:
        self.due = self.due and copy.kind != "full"
        self.kinds.append((copy.kind, copy.step))
        self.partner.hold(0, checked(0, *copy.blobs(), thin=False), damage=self.damage)

    def full_due(self) -> bool:
        return self.due

    def wait_shipped(self, most: int, timeout: float) -> bool:
        return True  # (delivered as offered)


def test_replicas_ship_the_diffs_a_partner_steps_its_copy_with_and_both_sides_keep_back(tmp_path, monkeypatch,
                                                                                       request):
    """--replicas, in-process: the handler ships its replica whole once, then each step's diff;
    the partner's copy, stepped by them with its own optimizer, equals the trainer's state bit
    for bit at the step it stands at. Each side applies a diff only once the other has one of
    its step (else up to KEPT_BACK wait), so both can stand at a common step, and a step due to
    be written is written once the replica stands at it. A copy given back at a kept step is
    that step's state, checked; a bit gone bad in the copy's memory is refused when it is given
    back; a diff that skips a step drops the copy until a whole one comes."""
    monkeypatch.delenv("CKPTRUN_FAULT", raising=False)
    engine = ReplicaEngine(tmp_path)
    request.addfinalizer(engine.dispose)
    bound = {"partner": float("inf"), "owner": float("inf")}  # each side's view of the other's newest step
    arenas = iter(range(10**6))
    partner = PartnerReplicas(optimizer_classes(), lambda owner, layout: Arena(tmp_path / f"p{next(arenas)}", layout),
                              lambda: bound["partner"])
    request.addfinalizer(partner.close)
    shipped = ShippedCopies(partner)
    engine.handler.ctx.replicas = shipped
    monkeypatch.setattr(engine.handler.copies, "newest", lambda: bound["owner"])
    cfg = RunConfig(strategy="lowdiff+", dir=str(tmp_path / "ckpts"), every=1, max_inflight=2, keep=1,
                    options={"persist_every": "5", "rebase_every": "auto"})
    rt, model, opt = hooked(cfg, engine, "adam")
    truth, own, low = {}, engine.handler.own, {"partner": 0, "owner": 0}  # (low: the step each replica is at)
    for it in range(24):
        bound.update({8: {"partner": 9}, 16: {"partner": float("inf"), "owner": 17}, 20: {"partner": 0}}.get(it, {}))
        opt.zero_grad()
        model(torch.randn(8, 6, generator=torch.Generator().manual_seed(it))).pow(2).mean().backward()
        opt.step()
        truth[rt.step] = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
        newest = rt.step - 1  # (step t's gradients reach the engine at step t+1's pre-step)
        if newest < 1:
            continue
        for side, steps, replica in (("partner", partner.steps(0), partner.owners[0].kept.stepped.replica),
                                     ("owner", own.steps(), own.stepped.replica)):
            low[side] = max(low[side], min(newest, bound[side]), newest - KEPT_BACK)
            assert steps == list(range(newest, low[side] - 1, -1)), (it, side, steps)
            assert_replica(replica, truth[low[side]])
    assert shipped.kinds[0] == ("full", 0) and [k for k, _ in shipped.kinds].count("full") == 1
    assert engine.handler.ctx.written == [s for s in range(0, 24, 5) if s <= low["owner"]]
    kept = own.steps()
    assert len(kept) > 2
    engine.handler.fetch(kept[1])  # the worker resumes at the step before the newest
    due = max(s for s in range(0, 24, 5) if s <= kept[1])
    assert own.steps() == [kept[1]] and engine.handler.ctx.written[-1] == due
    assert_replica(own.stepped.replica, truth[kept[1]])

    held = partner.steps(0)
    assert len(held) == KEPT_BACK + 1
    given = partner.whole(0, held[1], None)
    assert partner.steps(0) == [held[1]]
    back = spec_of(checked(0, *given.blobs(), thin=False))  # (as the owner's engine checks it again)
    state = tree_of(back, torch.frombuffer(bytearray(given.data), dtype=torch.uint8))
    assert_same(dict(state["models"]["model"]), dict(truth[held[1]]["model"]), "given back")
    assert back.meta[REPLICA_META] == {"exact": True, "replicated": [], "shared": []}

    shipped.damage = True  # memory goes bad after the copy's checksums
    shipped.partner.hold(0, checked(0, *own.stepped.copy(0, {REPLICA_META: back.meta[REPLICA_META]}).blobs(),
                                    thin=False), damage=True)
    with pytest.raises(CorruptCheckpoint, match="changed in memory"):
        partner.whole(0, partner.steps(0)[0], None)
    skipped = dataclasses.replace(given, kind="diff", step=partner.steps(0)[0] + 2)
    assert partner.hold(0, skipped) is False and partner.steps(0) == []
    nope = {"optimizer": {**back.meta["optimizers"]["optimizer"], "class": "Nope"}}  # (not known here)
    unknown = own.stepped.copy(0, {REPLICA_META: back.meta[REPLICA_META], "optimizers": nope})
    with pytest.raises(CorruptCheckpoint, match="not a replica this engine can step"):
        partner.hold(0, checked(0, *unknown.blobs(), thin=False))
    assert partner.steps(0) == []


class Delivered:
    """The replicator as a lowdiff+ handler sees it (`handlers.Replicas`), between two in-process
    engines: what one offers is checked as a partner's receiving thread checks it and held by the
    other's copies at once."""

    def __init__(self, owner: int, partner: PartnerReplicas) -> None:
        self.owner, self.partner, self.due, self.sent = owner, partner, True, []
        self.damage = self.lost = False

    def offer_copy(self, copy) -> None:
        self.due = self.due and copy.kind != "full"
        self.sent.append(copy)
        if not self.lost:
            self.partner.hold(self.owner, checked(self.owner, *copy.blobs(), thin=copy.thin), damage=self.damage)

    def full_due(self) -> bool:
        return self.due

    def wait_shipped(self, most: int, timeout: float) -> bool:
        return True


def _read_own(got) -> Callable[[str, memoryview], int]:
    """A partner's own replica at a step (`pinned`'s), read by key (as the replicator reads it)."""
    spec, view = got

    def read(key: str, into: memoryview) -> int:
        t = spec.tensors[key]
        into[:] = view[t["offset"] : t["offset"] + t["nbytes"]]
        return len(into)

    return read


def _two_ranks(tmp_path: Path, monkeypatch, request, *, ddp: bool) -> tuple[list, Callable[..., None], list[dict]]:
    """Two in-process ranks, each a Runtime with the real lowdiff+ handler behind it, whose
    engines hold each other's copies as they are offered (`Delivered`): ([(engine, runtime)],
    step(it, all_reduce=True) training both ranks one step, each rank's states by step). Their
    batches differ (so BatchNorm buffers and dropout masks do); `ddp`: the short-cut's thin copies,
    and step averages the gradients (unless told not to)."""
    monkeypatch.delenv("CKPTRUN_FAULT", raising=False)
    cfg = RunConfig(strategy="lowdiff+", dir=str(tmp_path / "ckpts"), every=1, max_inflight=2, keep=1,
                    options={"persist_every": "1000", "rebase_every": "auto"})
    engines, models, opts, truth = [], [], [], [{}, {}]
    for rank in (0, 1):
        (tmp_path / f"rank{rank}").mkdir()
        engine = ReplicaEngine(tmp_path / f"rank{rank}")
        request.addfinalizer(engine.dispose)
        engine.handler.ctx.rank = rank
        rt, model, opt = hooked(cfg, engine, "adam")
        if ddp:
            monkeypatch.setattr(rt.state, "shared_positions", lambda n=len(list(model.parameters())): list(range(n)))
        engines.append((engine, rt))
        models.append(model)
        opts.append(opt)
    for rank, (engine, _) in enumerate(engines):
        engine.handler.ctx.replicas = Delivered(rank, engines[1 - rank][0].handler.copies)

    def step(it: int, all_reduce: bool = True) -> None:
        for rank in (0, 1):
            opts[rank].zero_grad()
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2 * it + rank))
            models[rank](x).pow(2).mean().backward()
        for ps in zip(*(m.parameters() for m in models), strict=True):
            if ddp and all_reduce:
                mean = (ps[0].grad + ps[1].grad) / 2
                for p in ps:
                    p.grad.copy_(mean)
        for rank in (0, 1):
            opts[rank].step()
            truth[rank][engines[rank][1].step] = copy.deepcopy({"model": models[rank].state_dict(),
                                                                "optimizer": opts[rank].state_dict()})

    return engines, step, truth


@pytest.mark.parametrize("ddp", [False, True], ids=["whole", "ddp-thin"])
def test_a_rank_given_up_leaves_its_replica_and_its_copies_whole_at_one_step(ddp, tmp_path, monkeypatch, request):
    """The worker came back as the other rank (the rendezvous swapped them): before the engine
    lets its handler go, the handler stands its replica and its copy of the partner's at the
    newest step both can stand at and cuts both whole (thin copies completed from its own
    replica), for the next round to give back: each is its rank's trainer state at that step,
    bit for bit, and passes the checks a receiving engine makes."""
    engines, step, truth = _two_ranks(tmp_path, monkeypatch, request, ddp=ddp)
    for it in range(9):
        step(it)
    handler = engines[0][0].handler
    newest = min(handler.own.steps()[0], handler.copies.steps(1)[0])
    cuts = handler.give_up(0)
    assert sorted(c.index.rank for c in cuts) == [0, 1] and {c.step for c in cuts} == {newest}, cuts
    for c in cuts:
        spec = spec_of(checked(c.index.rank, *c.blobs(), thin=False))
        state = tree_of(spec, torch.frombuffer(bytearray(c.data), dtype=torch.uint8))
        want = truth[c.index.rank][c.step]
        assert_same(dict(state["models"]["model"]), dict(want["model"]), f"rank {c.index.rank} model")
        assert_same(state["optimizers"]["optimizer"], want["optimizer"], f"rank {c.index.rank} optimizer")
        assert REPLICA_META in spec.meta


def test_under_ddp_a_partner_keeps_only_per_rank_state_and_completes_it_from_its_own_replica(
        tmp_path, monkeypatch, request, caplog):
    """--replicas under DDP, two in-process ranks whose gradients are all-reduced (averaged) and
    whose batches (so BatchNorm buffers and dropout masks) differ: each engine ships its replica
    and its diffs thin (per-rank state only; the gradients by their xxh3), each partner checks
    them against its own replica and diffs; a copy dropped (a diff lost on its way) comes back
    with the replica shipped again every RESYNC_EVERY steps; and a copy given back, its
    replicated state read from the partner's own replica at the same step, is the owner's
    trainer state bit for bit. A bit
    gone bad in a copy's per-rank state is refused when it is given back; a rank whose update
    differs (gradients not all-reduced) has its copy dropped."""
    monkeypatch.setattr(lowdiff_plus_engine, "RESYNC_EVERY", 5)
    engines, step, truth = _two_ranks(tmp_path, monkeypatch, request, ddp=True)
    owner, partner = engines[0][0].handler, engines[1][0].handler
    for it in range(12):
        owner.ctx.replicas.lost = it == 2  # (one diff lost on its way: the partner drops its copy)
        step(it)
        if it == 3:
            assert partner.copies.steps(0) == [], partner.copies.steps(0)
    assert "does not follow it" in caplog.text  # (and the replica shipped again at step 5 brought it back)
    for rank in (0, 1):
        sent = engines[rank][0].handler.ctx.replicas.sent
        assert [(c.kind, c.step) for c in sent if c.kind == "full"] == [("full", 0), ("full", 5), ("full", 10)]
        assert all(c.thin for c in sent), rank
        for c in sent:  # (the grads, parameters and optimizer state: by their xxh3 in the index only)
            kept = [k for k, _ in kept_tensors(c.index, shared_keys(c.index))]
            assert not [k for k in kept if k.startswith(("grads/", "optimizers/"))], (c.kind, kept)
            assert len(c.data) == sum(c.index.tensors[k].nbytes for k in kept) < c.index.data_nbytes // 2
    steps = partner.copies.whole_steps(0, partner.own.steps())
    assert steps and max(steps) >= 9, (steps, partner.own.steps(), partner.copies.steps(0))
    def stood(step: int):
        with partner.served.pinned(step) as got:
            return got

    with partner.served.pinned(max(steps)) as got:
        other = []  # (a second partner's give-back at once: one at a time, and not at an older step)
        second = threading.Thread(target=lambda: other.append(stood(max(steps) - 1)))
        second.start()
        second.join(0.3)
        assert second.is_alive()
        given = partner.copies.whole(0, max(steps), _read_own(got))
    second.join(10)
    assert other == [None]
    back = spec_of(checked(0, *given.blobs(), thin=False))  # (as the owner's engine checks it again)
    state = tree_of(back, torch.frombuffer(bytearray(given.data), dtype=torch.uint8))
    assert_same(dict(state["models"]["model"]), dict(truth[0][given.step]["model"]), "given back")
    assert_same(state["optimizers"]["optimizer"], truth[0][given.step]["optimizer"], "given back")
    assert owner.own.steps() and partner.own.steps() == [given.step]  # (the newest: both train on)

    engines[1][0].handler.ctx.replicas.damage = True  # memory goes bad after the copy's checksums
    step(12)
    newest = max(owner.copies.whole_steps(1, owner.own.steps()))
    with owner.served.pinned(newest) as got, pytest.raises(CorruptCheckpoint, match="changed in memory"):
        owner.copies.whole(1, newest, _read_own(got))
    for it in (13, 14):
        step(it, all_reduce=False)
    assert partner.copies.steps(0) == [] and owner.copies.steps(1) == []
    assert caplog.text.count("updates the replicated state otherwise (ranks not data-parallel alike)") == 2


def test_a_partners_thin_replica_or_diff_that_does_not_hold_together_is_refused(tmp_path):
    """A thin whole replica or diff from a partner is untrusted: one whose skeleton names a
    tensor its index does not hold, or that is not a replica's state, is refused as
    CorruptCheckpoint (the receiving thread goes on), and the copy dropped."""
    partner = PartnerReplicas(optimizer_classes(), lambda owner, layout: Arena(tmp_path / "a", layout), lambda: None)
    state = {"models": {"model": {"w": torch.ones(4)}}, "rng": torch.zeros(3, dtype=torch.uint8),
             "optimizers": {"optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}}}
    skeleton, data, specs = pack(state)
    meta = {"shared": ["models/model/w"], "snapshot_time": 1.0,
            REPLICA_META: {"exact": True, "replicated": [], "shared": [0]}}
    spec = RecordSpec(record=full_name(3), kind="full", step=3, skeleton=skeleton, tensors=specs, meta=meta)
    whole = cut(0, spec, memoryview(bytearray(data)), thin=True)
    assert whole.thin and len(whole.data) == 3

    def tampered(copy, change) -> HeldCopy:
        raw = json.loads(copy.raw_index)
        change(raw)
        return checked(0, copy.header, copy.data, json.dumps(raw).encode(), thin=True)

    dangling = tampered(whole, lambda raw: raw["skeleton"].update(rng={TENSOR: "nope"}))
    with pytest.raises(CorruptCheckpoint, match="rank 0's whole replica"):
        partner.hold(0, dangling)
    not_a_replica = tampered(whole, lambda raw: raw["skeleton"].update(optimizers=[]))
    with pytest.raises(CorruptCheckpoint, match="rank 0's whole replica"):
        partner.hold(0, not_a_replica)
    assert partner.steps(0) == []

    diff_state = {"grads": [torch.ones(4)], "scales": [], "groups": [{"lr": 0.1}], "buffers": {},
                  "param_groups": {"optimizer": [{"lr": 0.1, "params": [0]}]}, "rng": torch.ones(3, dtype=torch.uint8),
                  "schedulers": {}, "scalers": {}, "extra": {}}
    skeleton, data, specs = pack(diff_state)
    diff = cut(0, RecordSpec(record=full_name(4), kind="diff", step=4, skeleton=skeleton, tensors=specs,
                             meta={"shared": ["grads.0"], "snapshot_time": 2.0}), memoryview(bytearray(data)))
    assert diff.thin
    for grads in ([{TENSOR: "nope"}], [{TENSOR: ["not", "a", "key"]}]):
        assert partner.hold(0, whole) and partner.steps(0) == [3]
        broken = tampered(diff, lambda raw, grads=grads: raw["skeleton"].update(grads=grads, groups=None))
        with pytest.raises(CorruptCheckpoint, match="does not apply"):
            partner.hold(0, broken)
        assert partner.steps(0) == []
    partner.close()
