"""datastates beyond the registry-wide contract suite: the update of step t+1 never runs before
the lazy copy of step t is complete (a slow copier, in-process against a real engine), a crash
between "snapshot done" and "persist done" leaves the previous step, the header-at-end file is
torn (and skipped) wherever it is cut, the state providers split and rebuild the state exactly,
and a custom tracked object streams as its own object."""

from __future__ import annotations

import gc
import json
import os
import shutil
import threading
import time
import uuid
import weakref
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from conftest import (
    EXAMPLE,
    SCRIPTS,
    STEPS,
    TINY,
    assert_same,
    assert_training_state,
    ckptrun,
    cli,
    error_line,
    ok,
    restore,
    resumed_beside_plain,
    verify,
)
from torch import nn

from ckptrun.config import RunConfig
from ckptrun.engine.server import Engine
from ckptrun.errors import CorruptCheckpoint
from ckptrun.ipc.messages import Message, Reply
from ckptrun.restore.recovery import newest_good, read_state
from ckptrun.storage import rankfile
from ckptrun.storage.layout import view
from ckptrun.storage.leftovers import remove_staging
from ckptrun.storage.store import Store, full_name
from ckptrun.storage.tree import flatten
from ckptrun.strategies.datastates.providers import rank_state, serialize
from ckptrun.worker.copier import Copier
from ckptrun.worker.runtime import Runtime
from ckptrun.worker.state import TrainingState


# ---- in-process: a Runtime wired to a real Engine ------------------------------------------
class Loopback:
    """The worker's engine connection wired to a real `Engine` in this process: requests and
    sends call its handlers directly, and what it sends back reaches the runtime."""

    def __init__(self) -> None:
        self.tag = f"ds{uuid.uuid4().hex[:8]}"
        self.engine = Engine(0, self.tag, None)
        self.engine.serving = self  # as `Engine.serve` does; its Hello then sends events here
        self.replies: dict[int, dict] = {}
        self.on_event = None
        self.next_id = 0

    def connect(self, address, authkey, on_event) -> Loopback:
        self.on_event = on_event
        return self

    def request(self, msg: Message, timeout: float | None = None) -> dict:
        self.next_id += 1
        msg.id = self.next_id
        self.send(msg)
        return self.replies.pop(msg.id)

    def send(self, msg: Message) -> None:
        if isinstance(msg, Reply):  # the engine's answer
            self.replies[msg.id] = msg.body
        elif msg.op.value in ("slot_free", "durable", "committed", "save_error", "in_memory"):
            self.on_event(msg)  # the engine's events
        else:
            getattr(self.engine, f"op_{msg.op.value}")(msg)

    def close(self) -> None:
        self.engine.close()
        remove_staging(self.tag, 0)


def model_and_data(seed: int = 0) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 1))
    return model, [torch.randn(16, 8) for _ in range(6)]


def slow_copier(monkeypatch: pytest.MonkeyPatch, delay_s: float, copied: list[float]) -> None:
    """The runtime's copier, `delay_s` slower per tensor; `copied[n]` is when the copy of the n-th
    snapshot's parameters ended (the one copy job per snapshot that holds them)."""

    def copy(buf, layout, tensors, progress=None) -> None:
        with torch.no_grad():
            for spec in layout.specs:
                if spec.key in tensors:
                    time.sleep(delay_s)
                    view(buf, spec).copy_(tensors[spec.key])
                    if progress is not None:
                        progress(spec.offset + spec.nbytes)
        if "models/model/0.weight" in tensors:
            copied.append(time.perf_counter())
        if progress is not None:
            progress(layout.nbytes)

    monkeypatch.setattr(Copier, "copy", staticmethod(copy))


def in_process(tmp_path: Path) -> tuple[Loopback, Runtime, nn.Module, list[torch.Tensor], torch.optim.Optimizer]:
    """A datastates Runtime against a real in-process engine, checkpointing every step of an
    Adam optimizer over `model_and_data()` (the caller closes the loopback)."""
    loop = Loopback()
    (tmp_path / "ckpts").mkdir()
    Store(tmp_path / "ckpts").ensure_writable()
    cfg = RunConfig(strategy="datastates", dir=str(tmp_path / "ckpts"), every=1, max_inflight=2, keep=0)
    rt = Runtime(cfg, 0, 0, 1, 0, connect=loop.connect)
    model, data = model_and_data()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.register_step_pre_hook(rt.pre_step_hook)
    opt.register_step_post_hook(rt.post_step_hook)
    rt.on_optimizer(opt)
    return loop, rt, model, data, opt


def test_a_handed_over_snapshot_is_freed_without_the_cyclic_gc(tmp_path, monkeypatch):
    """Each step's snapshot (its skeleton holds the step's RNG and optimizer state) is freed by
    reference counting once the next one is handed over, not left in a reference cycle for the
    full collection, which a process holding torch's objects runs rarely: the worker grew by
    ~0.85 KB per step while its stream callback (which names its slot) and it held each other."""
    monkeypatch.delenv("CKPTRUN_FAULT", raising=False)
    loop, rt, model, data, opt = in_process(tmp_path)
    handed: list[weakref.ref] = []
    gc.collect()
    gc.disable()
    try:
        for x in data:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            sealed = rt.strategy.sealed
            if sealed is not None and (not handed or handed[-1]() is not sealed):
                handed.append(weakref.ref(sealed))
        rt.finish()
        alive = [i for i, ref in enumerate(handed[:-1]) if ref() is not None]
    finally:
        gc.enable()
        loop.close()
    assert len(handed) >= len(data) - 2, handed
    assert not alive, f"snapshots {alive} of {len(handed)} outlived their hand-over (a reference cycle)"


@pytest.mark.parametrize("read", ["lazy", "retried"])
def test_the_update_waits_for_the_lazy_copy_and_the_file_holds_step_t(read, tmp_path, monkeypatch):
    """With a copier far slower than a forward/backward: the trainer goes on right after step t
    (the copy still runs), but the update of step t+1 starts only once the copy of step t has
    ended; each committed file holds the state right after its step (BatchNorm statistics too,
    which the next forward changes while the copy runs), not the next one's. `retried`: the
    lazy read of the state_dicts off the training thread fails (as when a forward registers a
    buffer meanwhile) and is done again before the update, with the same result."""
    monkeypatch.delenv("CKPTRUN_FAULT", raising=False)
    copied: list[float] = []
    slow_copier(monkeypatch, 0.02, copied)
    if read == "retried":
        early_state = TrainingState.early_state

        def flaky(self, taken=None):
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("dictionary changed size during iteration")
            return early_state(self, taken)

        monkeypatch.setattr(TrainingState, "early_state", flaky)
    loop, rt, model, data, opt = in_process(tmp_path)
    updates, returned, truth = {}, {}, {}
    opt.register_step_pre_hook(lambda *_: updates.__setitem__(rt.step + 1, time.perf_counter()))
    try:
        for x in data:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            returned[rt.step] = time.perf_counter()
            truth[rt.step] = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                              "optimizer": json.loads(json.dumps(flatten(opt.state_dict())[0])),
                              "state": {k: {n: t.clone() for n, t in s.items() if torch.is_tensor(t)}
                                        for k, s in opt.state_dict()["state"].items()}}
        rt.finish()
    finally:
        loop.close()
    for t in range(1, len(data)):
        if read == "lazy":
            assert copied[t - 1] > returned[t], f"step {t}: the capture blocked the trainer for the whole copy"
        assert updates[t + 1] >= copied[t - 1], f"step {t + 1}'s update began before step {t}'s copy ended"
    store = Store(tmp_path / "ckpts")
    assert [m.step for m in store.manifests()] == list(range(1, len(data) + 1))
    for m in store.manifests():
        assert m.layout == "file"
        state = read_state(store, m, 0)
        assert_same(state["models"]["model"], truth[m.step]["model"], f"step {m.step} model")
        got = {k: {n: t for n, t in s.items() if torch.is_tensor(t)}
               for k, s in state["optimizers"]["optimizer"]["state"].items()}
        assert_same(got, truth[m.step]["state"], f"step {m.step} optimizer state")


# ---- processes: the two completions ----------------------------------------------------------
def test_a_crash_between_snapshot_done_and_persist_done_leaves_the_previous_step(example_truth, tmp_path):
    """The engine dies while step 7's file is written (its data is written only once the trainer
    has sealed it: the snapshot was done), before its persist done: step 7 stays uncommitted and
    the newest step committed before it is what the directory lists, verifies and restores."""
    ckpt = tmp_path / "ckpts"
    proc = ckptrun(tmp_path, "--strategy", "datastates", "--dir", ckpt, EXAMPLE, *TINY,
                   fault="kill-engine:step=7:phase=write")
    assert proc.returncode != 0 and "checkpoint engine of local rank 0 died" in proc.stderr
    store = Store(ckpt)
    newest = newest_good(store).step
    # with --max-inflight 2, step 6's file may still have been in flight beside step 7's
    assert newest in (5, 6) and store.incomplete() == []  # (the launcher swept the torn step 7)
    assert all(m.step < 7 for m in store.manifests())
    ok(verify(tmp_path, ckpt))
    rows = json.loads(ok(cli(tmp_path, "ls", "--dir", ckpt, "--json")).stdout)
    assert rows[-1]["step"] == newest and rows[-1]["snapshot_done_at"] <= rows[-1]["persisted_at"]
    state, _ = restore(tmp_path, ckpt, "latest")
    assert state["step"] == newest
    assert_training_state(state, example_truth(newest))


# ---- the header-at-end file -----------------------------------------------------------------
@pytest.fixture(scope="module")
def one_run(example_run) -> Path:
    """The crash matrix's datastates run, every step kept (shared: read it, change a copy)."""
    return example_run("datastates")


def test_the_rank_file_is_torn_wherever_it_is_cut(one_run, example_truth, tmp_path):
    """Cut anywhere (inside the tensors, the log of objects, the header or the footer), a rank
    file has no valid header: the reader says torn, the step is skipped and the one before it
    restores exactly."""
    path = one_run / full_name(STEPS) / rankfile.file_name(0)
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        raw, head = rankfile.read_header(fd, "x")
    finally:
        os.close(fd)
    header_at = size - rankfile.FOOTER - len(raw)
    cuts = sorted({0, 1, 4096, head.data_nbytes // 2, head.data_nbytes, head.objects[0].offset + 3, header_at - 1,
                   header_at, header_at + len(raw) // 2, size - rankfile.FOOTER, size - 5, size - 1})
    for cut in cuts:
        ckpt = tmp_path / f"cut-{cut}"
        shutil.copytree(one_run, ckpt)
        os.truncate(ckpt / full_name(STEPS) / rankfile.file_name(0), cut)
        fd = os.open(ckpt / full_name(STEPS) / rankfile.file_name(0), os.O_RDONLY)
        try:
            with pytest.raises(CorruptCheckpoint, match="torn|no header"):
                rankfile.read_index(fd, "cut")
        finally:
            os.close(fd)
        store = Store(ckpt)
        assert newest_good(store).step == STEPS - 1, cut
    state, stderr = restore(tmp_path, ckpt, "latest")
    assert state["step"] == STEPS - 1 and f"step {STEPS} is damaged" in stderr
    assert_training_state(state, example_truth(STEPS - 1))


@pytest.mark.parametrize("where", ["header", "object", "footer"])
def test_a_flipped_byte_outside_the_tensors_is_caught(where, one_run, tmp_path):
    ckpt = tmp_path / "ckpts"
    shutil.copytree(one_run, ckpt)
    path = ckpt / full_name(STEPS) / rankfile.file_name(0)
    fd = os.open(path, os.O_RDONLY)
    try:
        raw, head = rankfile.read_header(fd, "x")
    finally:
        os.close(fd)
    size = path.stat().st_size
    at = {"header": size - rankfile.FOOTER - len(raw) // 2, "object": head.objects[0].offset + 1,
          "footer": size - 3}[where]
    blob = bytearray(path.read_bytes())
    blob[at] ^= 0x01
    path.write_bytes(bytes(blob))
    proc = verify(tmp_path, ckpt)
    assert proc.returncode == 1 and full_name(STEPS) in proc.stdout, proc.stdout
    line = error_line(cli(tmp_path, "restore", "--dir", ckpt, "--step", STEPS, "--out", tmp_path / "x.pt"))
    assert f"step {STEPS}" in line


def test_fault_points_of_a_rank_file_leave_nothing_half_written(tmp_path):
    """A failure at any point before the rename leaves no rank file and no temporary file."""
    for point in ("data:open", "data:written", "data:synced"):
        def fail(at: str, point=point) -> None:
            if at == point:
                raise OSError(28, f"injected at {at}")

        path = tmp_path / point.replace(":", "-") / rankfile.file_name(0)
        path.parent.mkdir()
        with pytest.raises(OSError, match="injected"):
            w = rankfile.RankFileWriter(path, 4096, fail)
            w.put(b"x" * 4096, 0)
            w.publish(rankfile.header(full_name(1), 0, {}, [], {}))
        assert list(path.parent.iterdir()) == [], point


# ---- state providers --------------------------------------------------------------------------
def test_providers_split_the_state_into_a_stream_that_rebuilds_it(tmp_path):
    """Tensors stream in provider order (model, optimizer, the rest); early objects, then late
    ones, rebuild the runtime's skeleton exactly through the rank file's reader."""
    model, data = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    model(data[0]).sum().backward()
    opt.step()
    sched.step()
    early = {"models": {"model": model.state_dict()}, "optimizers": {"optimizer": opt.state_dict()},
             "rng": {"torch": torch.get_rng_state()}}
    skeleton, tensors = flatten(early)
    late_skeleton, _ = flatten({"schedulers": [sched.state_dict()], "scalers": [],
                                "extra": {"ema": {"decay": 0.5, "n": 3}}})
    skeleton.update(late_skeleton)
    providers = rank_state()
    order = list(providers.tensors(dict(reversed(list(tensors.items())))))
    kinds = [k.split("/", 1)[0] for k in order]
    assert kinds == sorted(kinds, key=["models", "optimizers", "rng"].index)
    objects = providers.objects(skeleton, late=False) + providers.objects(skeleton, late=True)
    paths = [p for p, _ in objects]
    assert ("optimizers", "optimizer", "state") in paths and ("optimizers", "optimizer", "param_groups") in paths
    assert ("extra", "ema") in paths  # a tracked object is an object of its own
    assert paths.index(("optimizers", "optimizer", "param_groups")) > paths.index(("rng",))  # late after early
    w = rankfile.RankFileWriter(tmp_path / rankfile.file_name(0), 0)
    placed = []
    for path, raw in serialize(objects):
        placed.append({"path": list(path), "offset": w.append(raw), "nbytes": len(raw),
                       "xxh3": rankfile.checksum(raw)})
    w.publish(rankfile.header(full_name(1), 0, {}, placed, {}))
    fd = os.open(tmp_path / rankfile.file_name(0), os.O_RDONLY)
    try:
        _, index = rankfile.read_index(fd, "x")
    finally:
        os.close(fd)
    assert json.dumps(index["skeleton"]) == json.dumps(skeleton)


def test_a_tracked_object_resumes_exactly(tmp_path):
    """The script's EMA (tracked) is its own object in the stream: a killed run resumes to the
    same final state as an uninterrupted plain-python one."""
    plain, killed = resumed_beside_plain(tmp_path, SCRIPTS / "tracked_ema.py", ["--save-at", "12", "--save-path"],
                                         ["--strategy", "datastates", "--dir", "ckpts"], "kill:step=5")
    assert_same(torch.load(killed / "resumed.pt"), torch.load(plain / "truth.pt"), "final state")
    newest = Store(killed / "ckpts").manifests()[-1]
    index = Store(killed / "ckpts").read_index(newest.name, 0)
    assert "ema" in index["skeleton"]["extra"]


def test_snapshot_done_is_reported_apart_from_persist_done(example_run):
    metrics = example_run("datastates").parent / "metrics"
    events = [json.loads(line) for line in (metrics / "worker-0.jsonl").read_text().splitlines()]
    done = defaultdict(list)
    for e in events:
        if e["type"] in ("snapshot_done", "persist_done"):
            done[e["step"]].append((e["type"], e["t"]))
    for step in range(1, STEPS + 1):
        kinds = [k for k, _ in done[step]]
        assert kinds == ["snapshot_done", "persist_done"], (step, kinds)
        assert done[step][0][1] <= done[step][1][1]
    steps = [e for e in events if e["type"] == "step"]
    assert steps[-1]["last_snapshot_done"] == STEPS - 1  # (the last step's snapshot is taken at the end)
