"""gockpt beyond the registry-wide contract suite. The consistency proof: the record the engine
builds at version V from blocks sent at k different steps (rolled forward with the gradients
shipped after them) equals a synchronous snapshot at V bit for bit, for SGD-momentum, Adam and
AdamW with a scheduler and clipping, k = 1, 2, 4, 7, with blocks that split tensors and blocks
that hold many small ones (in-process against a real engine, and through real runs); a crash
in the middle of a spread leaves the previous V; a restarted worker resumes from it while its
engine drops the half-rolled spread; optimizers that are not elementwise are refused."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from conftest import (
    EXAMPLE,
    STEPS,
    TINY,
    assert_same,
    assert_training_state,
    ckptrun,
    error_line,
    load,
    ok,
    restore,
    run_events,
    subclassed_optimizer_script,
    verify,
)
from test_crash_matrix import assert_clean_and_final
from test_datastates import Loopback
from torch import nn

from ckptrun.config import RunConfig
from ckptrun.restore.recovery import newest_good, read_state
from ckptrun.storage.store import Store
from ckptrun.strategies.gockpt import model
from ckptrun.strategies.gockpt.blocks import SPLIT, Piece, plan, shares
from ckptrun.worker.runtime import Runtime

BLOCK_MB = "0.047"  # 49 KB: 4096 elements of a parameter with Adam's two moments, 6144 with SGD's momentum
FLAGS = ("--block-mb", "0.05")  # the example's embedding (8192 elements) is split, its small tensors share blocks


def make_model() -> nn.Module:
    """A 16000-element weight (split across blocks), BatchNorm buffers, dropout (RNG) and many small tensors."""
    torch.manual_seed(0)
    small = [m for _ in range(6) for m in (nn.Linear(4, 4), nn.Tanh())]
    return nn.Sequential(nn.Linear(16, 1000), nn.BatchNorm1d(1000), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(1000, 4), *small)


def make_optimizer(name: str, m: nn.Module) -> torch.optim.Optimizer:
    head = list(m[4].parameters())
    rest = [p for p in m.parameters() if all(p is not q for q in head)]
    groups = [{"params": rest}, {"params": head, "lr": 0.02}]
    if name == "sgd-momentum":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(groups, lr=1e-2, weight_decay=0.01)


def test_blocks_split_large_tensors_at_multiples_of_4096_and_pack_small_ones():
    params = [torch.zeros(10000), torch.zeros(3), torch.zeros(5, 2), torch.zeros(4097)]
    blocks = plan(params, [0, 0, 1, 1], [{"exp_avg", "exp_avg_sq"}] * 4, 4096 * 12)
    pieces = [p for b in blocks for p in b]
    for i, t in enumerate(params):
        mine = [p for p in pieces if p.index == i]
        assert mine[0].start == 0 and mine[-1].stop == t.numel()
        assert all(a.stop == b.start for a, b in zip(mine, mine[1:], strict=False))
        assert all(p.start % SPLIT == 0 for p in mine)
    assert [(p.start, p.stop) for p in pieces if p.index == 0] == [(0, 4096), (4096, 8192), (8192, 10000)]
    assert {p.index for p in blocks[2]} == {0, 1, 2}  # the small tensors share the split one's last block
    assert [(p.start, p.stop) for p in pieces if p.index == 3] == [(0, 4096), (4096, 4097)]  # (no room left there)
    assert [len(s) for s in shares([[Piece(0, 0, 0, 1)]] * 5, 2)] == [2, 3]
    assert model.ratio_k(3.0, 1.0) == 3 and model.ratio_k(2.0, 1.0) == 2 and model.ratio_k(14.0, 2.0) == 7


VARIANTS = {"sgd-momentum": ("sgd-momentum", False), "adam": ("adam", False), "adamw-clip-scheduler": ("adamw", True)}


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_record_of_v_equals_a_synchronous_snapshot_at_v(variant, k, tmp_path, monkeypatch):
    """16 steps in-process against a real engine, a checkpoint due every step: the records are at
    the V of each spread (k-1, 2k-1, ...; the last step at the end), each built from blocks sent
    at k different steps, and each equals the trainer's state at V bit for bit."""
    monkeypatch.delenv("CKPTRUN_FAULT", raising=False)
    loop = Loopback()
    ckpt = tmp_path / "ckpts"
    ckpt.mkdir()
    Store(ckpt).ensure_writable()
    cfg = RunConfig(strategy="gockpt", dir=str(ckpt), every=1, max_inflight=2, keep=0,
                    options={"spread": str(k), "block_mb": BLOCK_MB})
    rt = Runtime(cfg, 0, 0, 1, 0, connect=loop.connect)
    m = make_model()
    name, clip_and_schedule = VARIANTS[variant]
    opt = make_optimizer(name, m)
    opt.register_step_pre_hook(rt.pre_step_hook)
    opt.register_step_post_hook(rt.post_step_hook)
    rt.on_optimizer(opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s))
    rt.on_scheduler(sched)

    def now() -> dict:
        return copy.deepcopy({"model": m.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()})

    truth = {0: now()}
    try:
        for it in range(16):
            opt.zero_grad()
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(it))
            m(x).pow(2).mean().backward()
            if clip_and_schedule:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            opt.step()
            if clip_and_schedule:
                sched.step()
            truth[rt.step] = now()
        rt.finish()
    finally:
        loop.close()
    store = Store(ckpt)
    expected = list(range(k - 1, 17, k))
    expected += [] if expected[-1] == 16 else [16]  # the end of the script ends the spread it is in
    assert [mf.step for mf in store.manifests()] == expected
    for mf in store.manifests():
        state = read_state(store, mf, 0)
        meta = store.read_index(mf.name, 0)["meta"]
        assert meta["gockpt"]["first_step"] == (mf.step - k + 1 if (mf.step + 1) % k == 0 else 16 // k * k)
        assert_same(dict(state["models"]["model"]), dict(truth[mf.step]["model"]), f"step {mf.step} model")
        assert_same(state["optimizers"]["optimizer"], truth[mf.step]["optimizer"], f"step {mf.step} optimizer")
        assert_same(state["schedulers"][0], truth[mf.step]["scheduler"], f"step {mf.step} scheduler")


# ---- real runs ----------------------------------------------------------------------------
def test_every_committed_step_restores_the_script_save(example_truth, tmp_path):
    """--spread 3 with a checkpoint due every step: V = 2, 5, 8, 11 (a fresh run's first spread
    starts at step 0) and the last step; each restores as the example's own save."""
    ok(ckptrun(tmp_path, "--strategy", "gockpt", "--spread", "3", *FLAGS, "--dir", "ckpts", "--keep", "0",
               EXAMPLE, *TINY))
    steps = [m.step for m in Store(tmp_path / "ckpts").manifests()]
    assert steps == [2, 5, 8, 11, STEPS]
    for step in steps:
        state, _ = restore(tmp_path, tmp_path / "ckpts", step)
        assert state["step"] == step
        assert_training_state(state, example_truth(step))


def test_a_crash_in_the_middle_of_a_spread_leaves_the_previous_version(example_truth, tmp_path):
    """--spread 4: V = 3, 7, ... The worker dies at step 6, inside the spread of steps 4..7 (three
    of its four shares sent and rolled), with no restart: step 3 is the newest committed step,
    nothing of the spread is on disk, and it restores exactly."""
    proc = ckptrun(tmp_path, "--strategy", "gockpt", "--spread", "4", *FLAGS, "--dir", "ckpts",
                   "--max-restarts", "0", EXAMPLE, *TINY, fault="kill:step=6")
    assert proc.returncode != 0
    store = Store(tmp_path / "ckpts")
    assert [m.step for m in store.manifests()] == [3] and store.incomplete() == []
    ok(verify(tmp_path, "ckpts"))
    state, _ = restore(tmp_path, tmp_path / "ckpts", "latest")
    assert state["step"] == 3
    assert_training_state(state, example_truth(3))


def test_a_worker_killed_mid_spread_resumes_from_the_last_version(example_truth, tmp_path):
    """The same crash with a restart: the engine outlives the worker and drops the half-rolled
    spread when the new worker says hello; the run resumes from step 3 and ends bit-exact."""
    ok(ckptrun(tmp_path, "--strategy", "gockpt", "--spread", "4", *FLAGS, "--dir", "ckpts",
               "--metrics-dir", "metrics", "--max-restarts", "1", EXAMPLE, *TINY, "--save-at", STEPS,
               "--save-path", "final.pt", fault="kill:step=6"))
    attempts = run_events(tmp_path / "metrics")
    assert [(e["restart_count"], e["resume_step"]) for e in attempts] == [(0, 0), (1, 3)]
    engine = [json.loads(line) for line in (tmp_path / "metrics" / "engine-0.jsonl").read_text().splitlines()]
    assert [e["first_step"] for e in engine if e.get("type") == "gockpt_dropped"] == [4]
    spreads = [(e["first_step"], e["step"]) for e in engine if e.get("type") == "gockpt_spread"]
    assert spreads == [(0, 3), (4, 7), (8, 11), (12, 12)]  # after the resume at 3: 4..7 again
    assert [m.step for m in Store(tmp_path / "ckpts").manifests()][-1] == STEPS
    assert newest_good(Store(tmp_path / "ckpts")).step == STEPS
    assert_training_state(load(tmp_path / "final.pt"), example_truth(STEPS))
    assert_clean_and_final(tmp_path / "ckpts", example_truth(STEPS))


def test_an_optimizer_that_is_not_elementwise_is_refused(tmp_path):
    script = subclassed_optimizer_script(tmp_path)
    proc = ckptrun(tmp_path, "--strategy", "gockpt", "--dir", "ckpts", script)
    line = error_line(proc)
    assert proc.returncode == 2 and "Mine is not one of torch.optim's per-parameter optimizers" in line, line
    assert "--strategy checkfreq" in line


def test_tune_spreads_by_the_corrected_stall_model():
    """`ckptrun tune` sets --spread from k* = 1/r + 1/2 on the measured sizes, at most 7 and at most
    the interval its measured stall gave (a recipe's --every N is honoured: each spread ends at a
    multiple of N), and keeps that interval."""
    from dataclasses import replace
    from types import SimpleNamespace

    from ckptrun.strategies.gockpt.tuning import MODEL
    from ckptrun.tuning.model import Prediction, StrategyPlan

    def settle(sp: StrategyPlan, ckpt_bytes: int, diff_bytes: int) -> StrategyPlan:
        return MODEL.settle(sp, None, SimpleNamespace(costs=SimpleNamespace(ckpt_bytes=ckpt_bytes,
                                                                            diff_bytes=diff_bytes)), None)

    sp = StrategyPlan("gockpt", 0.01, 0.1, 1.0, 1, 1.0, 1, 1, 1, {"every": 5}, "Daly", Prediction(1.0, 0.01, 1.0, 0.02))
    third = settle(sp, 3_000, 1_000)  # k* = 3.5: 3 and 4 tie
    assert third.settings == {"every": 5, "spread": 3} and "k* = 1/r + 1/2 = 3.5" in third.rule
    tenth = settle(replace(sp, settings={"every": 20}), 10_000, 1_000)  # k* = 10.5: capped
    assert tenth.settings["spread"] == 7 and tenth.prediction == sp.prediction
    within = settle(sp, 10_000, 1_000)  # --every 5
    assert within.settings == {"every": 5, "spread": 5}


@pytest.mark.parametrize("handler", ["ckptrun.strategies.gockpt.engine:GoCkptHandler",
                                     "ckptrun.strategies.lowdiff_plus.engine:LowDiffPlusHandler"])
def test_an_engine_that_steps_optimizers_pays_torchs_first_optimizer_cost_at_its_start(handler):
    """A process's first optimizer imports torch._dynamo (1.4 s of CPU here). Paid at gockpt's
    first spread, it stalled the trainer 1.3 s (gockpt at --every 10: 1.41x `none`, then 1.05x);
    the handler starts it on a thread of its own as it is made, before any message. (A fresh
    interpreter: this one imported it long ago.)"""
    code = f"""
import sys, threading
import torch
from ckptrun.engine.handlers import engine_handler
assert "torch._dynamo" not in sys.modules, "imported before the handler"
engine_handler({handler!r}, None)
for t in threading.enumerate():
    if t.name == "ckptrun-optimizer-warmup":
        t.join(120)
assert "torch._dynamo" in sys.modules, "the handler did not warm torch's optimizers up"
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
