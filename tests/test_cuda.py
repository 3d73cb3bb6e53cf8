"""The CUDA paths (issue 29), proven on a GPU: page-locked staging slots, device-to-host copies on
a side stream that overlap the next forward/backward and that the next update waits for, the
lazy capture after a recorded event, CUDA RNG, autocast with a GradScaler, resume across device
types, the replay strategies on a GPU, and no pinned-memory leak.

Every test here is marked `cuda` (`pytest -m cuda`; scripts/gpu-check runs them on a device).
Those that need a GPU are skipped without one, each saying so; their CPU twins, the same logic
on the CPU copier thread, run in the default suite.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import (
    EXAMPLE,
    SCRIPTS,
    STEPS,
    TINY,
    assert_same,
    ckptrun,
    load,
    ok,
    python,
    restore,
    run_events,
)
from test_runtime_capture import FakeEngine, runtime
from torch import nn

from ckptrun.ipc.staging import create_slot, cuda_error, map_slot, page_lock, shm_root
from ckptrun.strategies import REGISTRY
from ckptrun.worker.runtime import Runtime

pytestmark = pytest.mark.cuda
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device here: runs on a GPU (pytest -m cuda, "
                                                 "scripts/gpu-check)")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
LOOP = SCRIPTS / "device_loop.py"


@pytest.fixture
def slots_dir() -> Iterator[Path]:
    """A folder where the engine puts staging slots (shared memory, tmpfs): Linux refuses to
    page-lock a writable file mapping on a disk's file system, where pytest's tmp_path may be."""
    path = Path(tempfile.mkdtemp(prefix="ckptrun-cuda-test-", dir=shm_root()))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def hooked(rt: Runtime, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Hook `opt` as the worker's bootstrap does (global hooks in a real worker)."""
    opt.register_step_pre_hook(rt.pre_step_hook)
    opt.register_step_post_hook(rt.post_step_hook)
    rt.on_optimizer(opt)


def cloned(state: dict) -> dict:
    """A state_dict's tensors cloned where they are (no host synchronization on a GPU)."""
    return {k: cloned(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def on_cpu(state: dict) -> dict:
    return {k: on_cpu(v) if isinstance(v, dict) else v.cpu() if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def linear_stack(device: str, width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)


def assert_recorded(engine: FakeEngine, truth: dict[int, tuple[dict, dict]]) -> None:
    """Each step's record holds the model and optimizer state as they were right after that
    step, bit for bit."""
    records = engine.records()
    for step, (model, opt) in truth.items():
        (got_model,), (got_opt,) = records[step]["models"].values(), records[step]["optimizers"].values()
        assert_same(got_model, on_cpu(model), f"step {step} model")
        assert_same(got_opt["state"], on_cpu(opt["state"]), f"step {step} optimizer state")


# ---- page-locked staging slots -----------------------------------------------------------
def test_cuda_errors_are_named():
    assert cuda_error(712, "part or all of the requested memory range is already mapped") == \
        "cudaErrorHostMemoryAlreadyRegistered (712: part or all of the requested memory range is already mapped)"
    assert cuda_error(1) == "cudaErrorInvalidValue (1)"
    assert cuda_error(12345) == "cudaError (12345)"


@needs_cuda
def test_staging_slot_is_page_locked(slots_dir):
    nbytes = 1 << 22
    create_slot(slots_dir / "slot", nbytes)
    buf, why = map_slot(str(slots_dir / "slot"), nbytes, pin=True)
    try:
        assert why is None and buf.is_pinned(), f"the staging slot is not page-locked: {why}"
        src = torch.arange(nbytes // 4, device="cuda", dtype=torch.float32)
        buf.view(torch.float32).copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(buf.view(torch.float32), src.cpu())
        again = page_lock(buf.data_ptr(), nbytes)
        assert again is not None and again.startswith("cudaErrorHostMemoryAlreadyRegistered (712"), again
    finally:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


@needs_cuda
def test_a_refused_page_lock_leaves_the_thread_usable(slots_dir):
    """A refused cudaHostRegister is reported by name, and torch's next kernel on the same thread
    runs: on an H200 the runtime's stale error made the next `.to("cuda")` fail."""
    create_slot(slots_dir / "slot", 4096)
    buf, _ = map_slot(str(slots_dir / "slot"), 4096)
    err = page_lock(buf.data_ptr(), 0)  # (zero bytes: always refused)
    assert err is not None and err.startswith("cudaErrorInvalidValue (1"), err
    assert torch.ones(8, device="cuda").sum().item() == 8


# ---- side-stream copies: overlap, and the update waits ---------------------------------------
@needs_cuda
@pytest.mark.timed  # another process's kernels on the GPU would take the compute time it measures
def test_copy_overlaps_the_next_forward_backward(slots_dir, tmp_path, monkeypatch):
    """checkfreq copies step t's 1 GB of parameters and momentum on a side stream while the
    forward/backward of step t+1 runs on the training stream: read from the device's own
    timeline (CUPTI, through the profiler), the copies run on another stream, and compute runs
    during at least half of their span (the training stream did not wait for them)."""
    rt, _ = runtime(slots_dir, monkeypatch, "checkfreq")
    model = linear_stack("cuda", 4096, 8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    hooked(rt, model, opt)
    x = torch.randn(8192, 4096, device="cuda")

    def iteration() -> None:
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()  # step t; the capture starts its copies, then the next iteration's compute

    for _ in range(2):  # warm-up: slots allocated and pinned, kernels chosen
        iteration()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        iteration()
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        torch.cuda.synchronize()
    rt.finish()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if "dur" in e]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"]]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert copies and kernels, "the trace holds no device-to-host copy or no kernel"
    train = Counter(e["args"]["stream"] for e in kernels).most_common(1)[0][0]
    assert train not in {e["args"]["stream"] for e in copies}, "device-to-host copies ran on the training stream"
    start, end = min(e["ts"] for e in copies), max(e["ts"] + e["dur"] for e in copies)
    busy = sum(max(0.0, min(end, e["ts"] + e["dur"]) - max(start, e["ts"])) for e in kernels
               if e["args"]["stream"] == train)
    assert busy >= 0.5 * (end - start), (f"compute ran {busy / 1e3:.1f} ms of the copies' "
                                         f"{(end - start) / 1e3:.1f} ms span")


@pytest.mark.parametrize("device", DEVICES)
def test_the_update_of_step_t_plus_1_waits_for_the_copy_of_step_t(device, slots_dir, monkeypatch):
    """Updates back to back, nothing in between (the shortest time a copy has): each record is
    the state right after its step, never partly the next update's. On a GPU the 800 MB copy
    runs on the side stream while the host queues the next update at once; on the CPU the copier
    thread copies while the training thread reaches the next step (tests/test_runtime_capture.py
    holds that thread back on purpose as well)."""
    rt, engine = runtime(slots_dir, monkeypatch, "checkfreq")
    model = linear_stack(device, 4096 if device == "cuda" else 256, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hooked(rt, model, opt)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    truth = {}
    for _ in range(4):
        opt.step()
        truth[rt.step] = (cloned(model.state_dict()), cloned(opt.state_dict()))
    rt.finish()
    assert_recorded(engine, truth)


@pytest.mark.parametrize("device", DEVICES)
def test_lazy_capture_copies_the_state_of_its_step(device, slots_dir, monkeypatch):
    """The lazy capture (datastates) takes the step's state on the copier thread; on a GPU its
    copies start after the event the training thread recorded when the update was queued, not
    when the copier thread gets to them. The next update waits for the copy (`wait_copy`)."""
    rt, engine = runtime(slots_dir, monkeypatch, "checkfreq", every=10**6)  # (its own captures: none)
    model = linear_stack(device, 4096 if device == "cuda" else 256, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hooked(rt, model, opt)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    ctx = rt.strategy.ctx  # the StrategyContext a strategy drives these through
    truth, snap = {}, None
    for _ in range(4):
        if snap is not None:
            ctx.wait_copy(snap)
            ctx.seal(snap)
            ctx.submit(snap)
        opt.step()
        truth[rt.step] = (cloned(model.state_dict()), cloned(opt.state_dict()))
        snap = ctx.capture(rt.step, background=True, lazy=True)
    ctx.wait_copy(snap)
    ctx.seal(snap)
    ctx.submit(snap)
    rt.finish()
    assert_recorded(engine, truth)


# ---- end to end on a GPU: RNG, autocast, devices, replay ----------------------------------------
def loop(cwd: Path, *args, fault: str | None = None, flags=()):
    """tests/scripts/device_loop.py under ckptrun (`flags` before the script)."""
    return ok(ckptrun(cwd, "--metrics-dir", "metrics", *flags, LOOP, *args, fault=fault))


@needs_cuda
@pytest.mark.parametrize("amp", ["none", "fp16", "bf16"])
def test_killed_cuda_run_resumes_bit_exact(amp, tmp_path):
    """A worker killed mid-step on a GPU resumes to the uninterrupted run's state: the dropout
    masks after the restart are the same draws (CUDA RNG restored), and with autocast the
    GradScaler's scale and growth tracker too (its scale grows every 3 steps)."""
    python(tmp_path, LOOP, "--device", "cuda", "--amp", amp, "--out", tmp_path / "truth.pt")
    loop(tmp_path, "--device", "cuda", "--amp", amp, "--out", tmp_path / "resumed.pt", fault="kill:step=5",
         flags=("--dir", "ckpts", "--max-restarts", "1"))
    assert [e["restart_count"] for e in run_events(tmp_path / "metrics")] == [0, 1], "the fault did not fire"
    resumed, truth = load(tmp_path / "resumed.pt"), load(tmp_path / "truth.pt")
    assert resumed["devices"] == ["cuda:0"]
    for key in ("model", "optimizer", "scaler"):
        assert_same(resumed[key], truth[key], key)


@needs_cuda
@pytest.mark.parametrize("saved_on, resumed_on", [("cpu", "cuda:0"), ("cuda:0", "cpu")])
def test_resume_onto_another_device_type(saved_on, resumed_on, tmp_path):
    """A checkpoint written on one device type resumes on the other: the state the script starts
    from is the committed step's, bit for bit, on the live parameters' device."""
    loop(tmp_path, "--device", saved_on, "--stop-after", 4, flags=("--dir", "ckpts"))
    saved, _ = restore(tmp_path, tmp_path / "ckpts", 4)
    loop(tmp_path, "--device", resumed_on, "--start-out", tmp_path / "start.pt", flags=("--dir", "ckpts"))
    start = load(tmp_path / "start.pt")
    assert start["devices"] == [resumed_on]
    assert_same(start["model"], saved["model"], "model")
    assert_same(start["optimizer"]["state"], saved["optimizer"]["state"], "optimizer state")


REPLAY_BOUND = 1e-5  # largest difference / largest value of a tensor, where a GPU run is not replayed exactly


@needs_cuda
@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+"])
def test_replay_strategies_on_a_gpu_are_exact_or_bounded(strategy, tmp_path, record_property):
    """lowdiff replays a GPU run's gradients offline on the GPU (the device type its index
    names): every restored step equals the run's own save bit for bit. lowdiff+ keeps a CPU
    replica updated with them and re-bases it from a real snapshot (--rebase-every): its steps
    between re-bases lie within REPLAY_BOUND of the run's (the measured difference is recorded
    and printed)."""
    gpu = [*TINY, "--device", "cuda", "--deterministic"]
    python(tmp_path, EXAMPLE, *gpu, "--save-every", 1, "--save-path", tmp_path / "truth-{step}.pt")
    flags = ("--rebase-every", "4") if strategy == "lowdiff+" else ()
    ok(ckptrun(tmp_path, "--strategy", strategy, *REGISTRY[strategy].short_run_flags, *flags, "--dir", "ckpts",
               "--keep", "0", EXAMPLE, *gpu))
    worst = 0.0
    for step in range(1, STEPS + 1):
        state, _ = restore(tmp_path, tmp_path / "ckpts", step)
        truth = load(tmp_path / f"truth-{step}.pt")
        for key, want in truth["model"].items():
            got = state["model"][key]
            assert got.shape == want.shape and got.dtype == want.dtype, key
            scale = want.abs().max().item() or 1.0
            worst = max(worst, (got.double() - want.double()).abs().max().item() / scale)
    record_property("max_relative_difference", worst)
    print(f"{strategy} on a GPU: largest relative difference from the run's own saves {worst:.3g}", file=sys.stderr)
    bound = 0.0 if strategy == "lowdiff" else REPLAY_BOUND
    assert worst <= bound, f"{strategy}: restored steps differ by up to {worst:.3g} of their values"


@needs_cuda
def test_slots_are_page_locked_before_the_first_checkpoint(slots_dir, monkeypatch):
    """The staging slots are made and page-locked for the model's device on the set-up thread
    once the optimizer exists (issue 58), not by the first checkpoint: before the first step every
    slot is pinned, and the first checkpoint allocates nothing more."""
    rt, _ = runtime(slots_dir, monkeypatch, "checkfreq")
    model = linear_stack("cuda", 1024, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hooked(rt, model, opt)
    rt.staging.ready()
    before = dict(rt.staging.pool.buffers)
    assert before and set(rt.staging.pool.locked) == set(before), "slots not page-locked before the first step"
    assert all(b.is_pinned() for b in before.values())
    x = torch.randn(256, 1024, device="cuda")
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    assert rt.staging.pool.buffers.keys() == before.keys(), "the first checkpoint made other slots"
    rt.finish()


# ---- no pinned-memory leak ----------------------------------------------------------------
@needs_cuda
def test_no_pinned_memory_leak_across_100_checkpoints(slots_dir, monkeypatch):
    """100 checkpoints of a training loop: the device's and the pinned host allocator's current
    figures are the same after checkpoint 100 as after checkpoint 20, the staging slots are the
    same ones, and once the worker finishes no slot is page-locked any more."""
    rt, _ = runtime(slots_dir, monkeypatch, "checkfreq")
    model = linear_stack("cuda", 1024, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hooked(rt, model, opt)
    x = torch.randn(256, 1024, device="cuda")

    def figures() -> dict:
        torch.cuda.synchronize()
        device = torch.cuda.memory_stats()
        host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        return {**{k: device[k] for k in ("allocated_bytes.all.current", "reserved_bytes.all.current")},
                **{f"host {k}": v for k, v in host.items() if "bytes" in k and "current" in k},
                "slots": sorted(rt.staging.pool.buffers)}

    seen = {}
    for step in range(1, 101):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        if step in (20, 100):
            seen[step] = figures()
    slots = list(rt.staging.pool.buffers.values())
    assert set(rt.staging.pool.locked) == set(rt.staging.pool.buffers), "the staging slots were not page-locked"
    rt.finish()
    grew = {k: (seen[20][k], v) for k, v in seen[100].items() if seen[20].get(k) != v}
    assert not grew, f"grew between checkpoints 20 and 100: {grew}"
    assert not any(b.is_pinned() for b in slots), "staging slots still page-locked after the worker finished"
