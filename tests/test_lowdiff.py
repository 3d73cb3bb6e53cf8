"""`--strategy lowdiff` (DESIGN §5, invariant 1): any step restored by replaying the recorded
gradients equals an uninterrupted run's own save at that step, bit for bit; killed workers and
engines resume exactly (dense, and with top-k compression as long as the engine holding the
error-feedback residual survives); damaged diff records are reported and skipped; `ls` shows the
chains; the (F, B) auto-tuner follows the measured costs.

Every run uses F=5, B=3 on 14 steps, so the records are fixed (see `RECORDS`): full checkpoints
at 0 (the start), 5 and 10, and diff batches 1-3, 4-5, 6-8, 9-10, 11-13, 14 (a batch ends early
where a full checkpoint starts a new chain, and at the end of training).
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    EXAMPLE,
    FULL,
    assert_training_state,
    ckptrun,
    cli,
    copy_dir,
    error_line,
    load,
    ok,
    restore,
    run_events,
    run_in_process,
    verify,
)

from ckptrun.errors import CkptrunError, CorruptCheckpoint
from ckptrun.restore.chain_listing import group_diffs
from ckptrun.restore.export import export
from ckptrun.restore.recovery import READ_AHEAD_RECORDS, diff_states, find, load_state
from ckptrun.storage.store import Store, diff_name, full_name, rank_files
from ckptrun.strategies.lowdiff.model import LowDiffCosts, optimal_fb
from ckptrun.strategies.lowdiff.policy import DEFAULT_B, DEFAULT_F, RECORD_OPEN_S, FullEveryBatch
from ckptrun.strategies.save_policy import Decision
from ckptrun.worker.decisions import EVAL_EVERY, FIRST_EVAL, Retuner

SCRIPT = Path(__file__).resolve().parent / "scripts_lowdiff" / "sgd_steplr.py"
STEPS = 14
TINY = ["--layers", "1", "--d-model", "32", "--steps", str(STEPS), "--threads", "1"]
LOWDIFF = ["--strategy", "lowdiff", "--full-every", "5", "--batch", "3"]
RECORDS = [  # (kind, first_step, step, depends_on) in `ckptrun ls` order
    ("full", 0, 0, []),
    ("diff", 1, 3, [full_name(0)]),
    ("full", 5, 5, []),
    ("diff", 4, 5, [full_name(0), diff_name(1, 3)]),
    ("diff", 6, 8, [full_name(5)]),
    ("full", 10, 10, []),
    ("diff", 9, 10, [full_name(5), diff_name(6, 8)]),
    ("diff", 11, 13, [full_name(10)]),
    ("diff", 14, 14, [full_name(10), diff_name(11, 13)]),
]
AFTER_FULL, MID_BATCH, END_BATCH = 6, 7, 8
CHECKED_STEPS = (AFTER_FULL, MID_BATCH, END_BATCH, STEPS)
TOPK = "topk:0.01"
RESIDUAL_LOST = "without the top-k error-feedback residual"
# Every fault hits step 9, the first of batch 9-10; the steps the restarted workers resume from.
# The crash-matrix runs use one engine writer, so records become durable in order and the
# engine dying while it writes step 9 always leaves batch 6-8 committed (resume from step 8).
# The two worker faults go in one run, one per attempt (the engine survives both).
FAULTS = {
    # diffs up to 8 were handed to the engine, which writes them for the restart; then killed
    # while diff 9 was written: the engine finishes it
    "kill:step=9;kill:step=9:phase=write": [8, 9],
    "kill-engine:step=9:phase=write": [8],  # diff 9 torn; what the engine held in memory is gone
}


def exported(ckpt_dir: Path, step: int | str, out_dir: Path) -> dict:
    """`ckptrun restore --step STEP` without a subprocess: the same `export` the CLI calls."""
    out = out_dir / f"exported-{step}.pt"
    export(ckpt_dir, step, out, "torch")
    return load(out)


def finish_run(cwd: Path, *extra: Any, fault: str | None = None):
    """The example (AdamW) under lowdiff to the end, saving its own final state as final.pt."""
    return ok(ckptrun(cwd, *LOWDIFF, "--writers", "1", "--dir", "ckpts", "--metrics-dir", "metrics", *extra,
                      EXAMPLE, *TINY, "--save-at", STEPS, "--save-path", "final.pt", fault=fault))


def models_differ(a: dict, b: dict) -> bool:
    return any(not torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def assert_store_restores(ckpt_dir: Path, final: dict, out_dir: Path) -> None:
    """The run left only committed, verifying records, and its newest step replays to `final`."""
    store = Store(ckpt_dir)
    assert store.incomplete() == []
    assert [p for m in store.manifests() for p in store.verify_record(m)] == []
    state = exported(ckpt_dir, "latest", out_dir)
    assert state["step"] == STEPS
    assert_training_state(state, final)


def flip_diff_byte(record_dir: Path, rank: int = 0) -> str:
    """Flip one bit inside the first tensor of a diff record's data file; returns its key."""
    index = json.loads((record_dir / rank_files(rank)[1]).read_text())
    key, spec = next((k, s) for k, s in index["tensors"].items() if s["nbytes"] > 0)
    path = record_dir / index["data"]
    raw = bytearray(path.read_bytes())
    raw[spec["offset"] + spec["nbytes"] // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    return key


@pytest.fixture(scope="module")
def gpt_truth(tmp_path_factory: pytest.TempPathFactory):
    """(optimizer, step) -> the example's own save after `step` of an uninterrupted plain run."""
    root = tmp_path_factory.mktemp("lowdiff-truth")
    cache: dict[tuple[str, int], dict] = {}

    def get(optimizer: str, step: int) -> dict:
        if (optimizer, step) not in cache:
            out = root / f"{optimizer}-{step}.pt"
            run_in_process(root, EXAMPLE, *TINY, "--optimizer", optimizer, "--save-at", step, "--save-path", out)
            cache[optimizer, step] = load(out)
        return cache[optimizer, step]

    return get


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory: pytest.TempPathFactory):
    """optimizer -> checkpoint dir of an uninterrupted lowdiff run keeping every record (read-only)."""
    cache: dict[str, Path] = {}

    def get(optimizer: str) -> Path:
        if optimizer not in cache:
            cwd = tmp_path_factory.mktemp(f"lowdiff-{optimizer}")
            ok(ckptrun(cwd, *LOWDIFF, "--keep", "0", "--dir", "ckpts", EXAMPLE, *TINY, "--optimizer", optimizer))
            cache[optimizer] = cwd / "ckpts"
        return cache[optimizer]

    return get


@pytest.fixture(scope="module")
def topk_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run with --compress topk: the ground truth of the compressed crash matrix
    (compression changes training, so a plain run is not)."""
    cwd = tmp_path_factory.mktemp("lowdiff-topk")
    finish_run(cwd, "--compress", TOPK)
    return cwd


# ---- replay exactness -------------------------------------------------------------------------
# AdamW (the example's) end to end by default; each optimizer's replay arithmetic is checked in
# process by test_replay.py, so the runs with SGD and Adam are opt-in (--full).
@pytest.mark.parametrize("optimizer", [pytest.param("sgd", marks=FULL), pytest.param("adam", marks=FULL), "adamw"])
def test_restore_replays_exactly(optimizer, gpt_run, gpt_truth, tmp_path):
    """SGD with momentum, Adam, AdamW with weight decay; a LambdaLR schedule and gradient clipping."""
    ckpt = gpt_run(optimizer)
    state, stderr = restore(tmp_path, ckpt, MID_BATCH)
    assert f"from {full_name(5)} + 1 diff record(s) replayed" in stderr
    # replayed where the run trained (its index says where), in the run's own arithmetic
    assert Store(ckpt).read_index(full_name(5), 0)["meta"]["optimizers"]["optimizer"]["device"] == "cpu"
    assert "replayed on the CPU" not in stderr
    assert state["step"] == MID_BATCH
    assert_training_state(state, gpt_truth(optimizer, MID_BATCH))
    for step in (AFTER_FULL, END_BATCH, STEPS):
        state = exported(ckpt, step, tmp_path)
        assert state["step"] == step
        assert_training_state(state, gpt_truth(optimizer, step))


def test_restore_replays_exactly_sgd_steplr_batchnorm(tmp_path):
    """Nesterov SGD in two parameter groups, StepLR changing lr inside a batch, BatchNorm buffers,
    and a parameter without a gradient on odd steps."""
    run_in_process(tmp_path, SCRIPT, "--steps", STEPS, "--save-at", ",".join(map(str, CHECKED_STEPS)),
                   "--save-path", tmp_path / "truth-{step}.pt")
    ok(ckptrun(tmp_path, *LOWDIFF, "--keep", "0", "--dir", "ckpts", SCRIPT, "--steps", STEPS))
    assert [(m.kind, m.first_step, m.step) for m in Store(tmp_path / "ckpts").manifests()] == \
        [r[:3] for r in RECORDS]
    for step in CHECKED_STEPS:
        state = exported(tmp_path / "ckpts", step, tmp_path)
        assert_training_state(state, load(tmp_path / f"truth-{step}.pt"))


def test_ls_json_shows_full_checkpoints_and_diff_ranges(gpt_run, tmp_path):
    rows = json.loads(ok(cli(tmp_path, "ls", "--dir", gpt_run("adamw"), "--json")).stdout)
    assert [(r["kind"], r["first_step"], r["step"], r["depends_on"]) for r in rows] == RECORDS
    assert [r["record"] for r in rows] == [full_name(s) if k == "full" else diff_name(f, s)
                                           for k, f, s, _ in RECORDS]


def test_ls_groups_each_chain_and_says_what_is_restorable(gpt_run, tmp_path):
    """`ls` shows each run of diff records on one base as one row (before: a row per record,
    51 for a 60-step run) and a line saying which steps restore from which full checkpoints and
    what restoring the newest takes, within 80 columns; --wide lists every record, as --json."""
    ckpt = gpt_run("adamw")
    newest = sum(m.bytes for m in Store(ckpt).manifests() if m.name in (full_name(10), diff_name(11, 13),
                                                                         diff_name(14, 14)))
    listed = ok(cli(tmp_path, "ls", "--dir", ckpt)).stdout
    rows = [[c.strip() for c in line.split("│")[1:4]] for line in listed.splitlines() if line.startswith("│")]
    assert rows == [["0", "full", full_name(0)], ["1-5", "diff", "2 records"], ["5", "full", full_name(5)],
                    ["6-10", "diff", "2 records"], ["10", "full", full_name(10)], ["11-14", "diff", "2 records"]]
    assert (f"\n0-14 restorable: full at 0, 5, 10; 12 diffs; newest reads {newest / 1e6:.1f} MB, replays 4 steps\n"
            in listed.replace("\n  ", " ")), listed  # (wrapped at 80 columns)
    assert max(map(len, listed.splitlines())) <= 80, listed
    wide = ok(cli(tmp_path, "ls", "--dir", ckpt, "--wide")).stdout
    assert all(full_name(s) if k == "full" else diff_name(f, s) in wide for k, f, s, _ in RECORDS), wide
    assert f"{full_name(10)}, {diff_name(11, 13)}" in wide and "…" not in wide, wide  # never squeezed to 80


def test_ls_groups_only_alike_consecutive_records():
    """A run of diff records is one row only where nothing tells them apart: a gap, another
    base, or another tier (one of them also remote) starts a new row."""
    def row(kind, first, step, depends_on=(), tiers=("local",)):
        return {"kind": kind, "first_step": first, "step": step, "depends_on": list(depends_on), "bytes": 10,
                "ranks": 1, "rank_bytes": [10], "layout": "records", "tiers": list(tiers),
                "record": full_name(step) if kind == "full" else diff_name(first, step)}

    f0 = full_name(0)
    rows = [row("full", 0, 0), row("diff", 1, 3, [f0]), row("diff", 4, 5, [f0, diff_name(1, 3)]),
            row("diff", 6, 6, [f0, diff_name(4, 5)], tiers=("local", "remote")), row("diff", 8, 8, [f0]),
            row("full", 9, 9), row("diff", 9, 9, [f0, diff_name(8, 8)]), row("diff", 10, 10, [full_name(9)])]
    grouped = group_diffs(rows)
    assert [(r["first_step"], r["step"], r["record"], r["bytes"], r["depends_on"]) for r in grouped] == [
        (0, 0, f0, 10, []), (1, 5, "2 records", 20, [f0]), (6, 6, diff_name(6, 6), 10, [f0]),
        (8, 9, "2 records", 20, [f0]), (9, 9, full_name(9), 10, []), (10, 10, diff_name(10, 10), 10, [full_name(9)])]


def test_corrupt_diff_record_is_reported_and_skipped(gpt_run, gpt_truth, tmp_path):
    ckpt = copy_dir(gpt_run("adamw"), tmp_path / "ckpts")
    bad = diff_name(11, 13)
    key = flip_diff_byte(ckpt / bad)

    proc = verify(tmp_path, ckpt)
    assert proc.returncode == 1
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BAD")]
    assert len(lines) == 1 and bad in lines[0] and key in lines[0], proc.stdout

    for step in (12, STEPS):  # inside the damaged batch; after it, in the same chain
        line = error_line(cli(tmp_path, "restore", "--dir", ckpt, "--step", step, "--out", tmp_path / "x.pt"))
        assert f"step {step} cannot be restored" in line and bad in line and "checksum mismatch" in line
        assert re.search(r"newest good step before it is 10\b", line), line
    assert not (tmp_path / "x.pt").exists()

    state, stderr = restore(tmp_path, ckpt, "latest")
    assert state["step"] == 10 and f"step {STEPS} is damaged" in stderr
    assert_training_state(state, gpt_truth("adamw", 10))
    assert_training_state(exported(ckpt, 9, tmp_path), gpt_truth("adamw", 9))  # another chain: intact


@pytest.fixture(scope="module")
def long_chain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted AdamW run whose one chain is full 0 + diffs 1-3, 4-6, ..., 13-14."""
    cwd = tmp_path_factory.mktemp("lowdiff-chain")
    ok(ckptrun(cwd, "--strategy", "lowdiff", "--full-every", "50", "--batch", "3", "--keep", "0", "--dir", "ckpts",
               EXAMPLE, *TINY))
    return cwd / "ckpts"


@pytest.mark.parametrize("restarts", [1, 0], ids=["single-pass", "verified-first"])
def test_damaged_record_mid_chain_at_resume_falls_back_exactly(restarts, long_chain, gpt_truth, tmp_path):
    """Resuming at step 9 (full 0 + diffs 1-3, 4-6, 7-9) with a bit flipped in diffs 4-6. With a
    restart to spare, the resume checks checksums as it reads for replay (one pass): it finds the
    damage half-way through replay, ends the attempt and sets the record aside, and the restart
    resumes at step 3. Without one, everything is checked before deciding (two passes) and step 3
    is chosen at once. Either way the run ends bit-identical to an uninterrupted one."""
    ckpt = copy_dir(long_chain, tmp_path / "ckpts", up_to=9)
    bad = diff_name(4, 6)
    flip_diff_byte(ckpt / bad)
    proc = ok(ckptrun(tmp_path, "--strategy", "lowdiff", "--full-every", "50", "--batch", "3",
                      "--max-restarts", restarts, "--dir", "ckpts", "--metrics-dir", "metrics", EXAMPLE, *TINY,
                      "--save-at", STEPS, "--save-path", "final.pt"))
    resumed = [e["resume_step"] for e in run_events(tmp_path / "metrics")]
    assert resumed == ([9, 3] if restarts else [3]), proc.stderr
    assert "checksum mismatch" in proc.stderr
    assert [p.name.rsplit("-", 1)[0] for p in (ckpt / "damaged").iterdir() if p.name.startswith(bad)] == [bad]
    assert_training_state(load(tmp_path / "final.pt"), gpt_truth("adamw", STEPS))


def test_long_chain_replays_exactly_through_reused_read_buffers(long_chain, gpt_truth, tmp_path):
    """Step 14 from full 0 replays five diff records; the four before the last are read into
    READ_AHEAD_RECORDS + 1 buffers used in turn (one read into again once its record was
    replayed: no page faults of a fresh buffer), and the restore is still bit-exact."""
    store = Store(long_chain)
    plan = find(store, STEPS)
    assert [(m.first_step, m.step) for m in plan.diffs] == [(1, 3), (4, 6), (7, 9), (10, 12), (13, 14)]
    # Every step's first gradient kept alive: fresh buffers could not be freed and their addresses
    # reused, so the records before the last would sit in four buffers; reused ones are three.
    kept = [step["grads"][0] for step in diff_states(store, plan, 0)]
    buffers = {g.untyped_storage().data_ptr() for g in kept
               if g.untyped_storage().nbytes() > g.nbytes}  # (the last record's are private copies)
    assert len(kept) == STEPS and len(buffers) == READ_AHEAD_RECORDS + 1 < len(plan.diffs) - 1
    assert_training_state(exported(long_chain, STEPS, tmp_path), gpt_truth("adamw", STEPS))


def test_a_replay_stopped_early_stops_its_reader(long_chain):
    """A consumer that stops after the first step (replay failed, to be retried on the CPU)
    closes the records' generator: the reader thread, waiting with records queued ahead, ends
    and lets go of its buffers instead of waiting for good."""
    store = Store(long_chain)
    before = set(threading.enumerate())
    steps = diff_states(store, find(store, STEPS), 0)
    next(steps)
    time.sleep(1)  # (it reads two records ahead, then waits for a buffer the replay holds)
    reader, = (t for t in set(threading.enumerate()) - before if t.name == "ckptrun-diff-reader")
    assert reader.is_alive()
    steps.close()
    reader.join(30)
    assert not reader.is_alive()


def test_a_device_without_room_to_replay_leaves_it_to_the_cpu(gpt_run, gpt_truth, monkeypatch, capsys):
    """Offline replay runs on the device type the run trained on; where that device has no room
    for the state (out of memory: stood in for here), the CPU replays it from the untouched
    state read, and one line says so."""
    from ckptrun.restore import recovery, replay

    def no_room(cls, info, state, device=None):
        if device is not None and device.type != "cpu":
            raise torch.OutOfMemoryError("no room")
        return build(cls, info, state, device)

    build = recovery.build_optimizer
    monkeypatch.setattr(replay, "replay_device", lambda trained_on: torch.device("meta"))
    monkeypatch.setattr(recovery, "build_optimizer", no_room)
    store = Store(gpt_run("adamw"))
    state = load_state(store, find(store, MID_BATCH), 0)
    assert_training_state({"model": state["models"]["model"], "optimizer": state["optimizers"]["optimizer"]},
                          gpt_truth("adamw", MID_BATCH))
    said = [line for line in capsys.readouterr().err.splitlines() if "no room to replay" in line]
    assert said == [f"ckptrun: warning: meta has no room to replay step {MID_BATCH} of rank 0; replayed on the "
                    "CPU, which may differ from the run's by rounding"], said


def test_a_machine_without_memory_to_replay_says_so_not_that_the_records_are_damaged(gpt_run, monkeypatch):
    """Host memory running out during replay (torch's allocator error, stood in for) is the
    machine's shortage: one line saying so, not "its records do not fit together"."""
    from ckptrun.restore import recovery

    def no_memory(cls, info, state, device=None):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 4096 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(recovery, "build_optimizer", no_memory)
    store = Store(gpt_run("adamw"))
    with pytest.raises(CkptrunError) as got:
        load_state(store, find(store, MID_BATCH), 0)
    assert not isinstance(got.value, CorruptCheckpoint)
    assert str(got.value).startswith(f"not enough memory to replay step {MID_BATCH} of rank 0 (")
    assert str(got.value).endswith("); free memory, or restore it where there is more")


# ---- crash matrix -----------------------------------------------------------------------------
def test_topk_changes_training_and_replays_exactly(topk_run, gpt_truth, tmp_path):
    """Compression is applied in training (so the compressed run is its own ground truth), and the
    stored diffs are the sparse gradients it applied: offline replay reaches its final state."""
    final = load(topk_run / "final.pt")
    assert models_differ(final, gpt_truth("adamw", STEPS))
    assert_store_restores(topk_run / "ckpts", final, tmp_path)


@pytest.mark.parametrize(("fault", "resume_steps"), [pytest.param(f, r, id=f.replace(";", "+"))
                                                     for f, r in FAULTS.items()])
@pytest.mark.parametrize("compress", [TOPK], ids=["topk"])  # dense: the registry-wide crash matrix
def test_killed_run_finishes_exactly(compress, fault, resume_steps, gpt_truth, request, tmp_path):
    proc = finish_run(tmp_path, "--max-restarts", len(resume_steps), *(["--compress", compress] if compress else []),
                      fault=fault)
    attempts = run_events(tmp_path / "metrics")
    assert [e["restart_count"] for e in attempts] == list(range(len(resume_steps) + 1)), "a fault did not fire"
    assert [e["resume_step"] for e in attempts[1:]] == resume_steps
    if fault.startswith("kill-engine"):
        assert "checkpoint engine of local rank 0 died" in proc.stderr
    truth = load(request.getfixturevalue("topk_run") / "final.pt") if compress else gpt_truth("adamw", STEPS)
    final = load(tmp_path / "final.pt")
    if compress and fault.startswith("kill-engine"):
        # The residual of step 8 lived only in the dead engine's memory (it is written with full
        # checkpoints, not with diffs): the run says so and goes on, no longer bit-exact.
        assert f"resumed step {resume_steps[0]} {RESIDUAL_LOST}" in proc.stderr
        assert models_differ(final, truth)
    else:  # a surviving engine hands the residual to the restarted worker
        assert RESIDUAL_LOST not in proc.stderr
        assert_training_state(final, truth)
    assert_store_restores(tmp_path / "ckpts", final, tmp_path)


def test_ddp_topk_rank1_killed_resumes_exactly(tmp_path):
    """2 ranks (gloo), compression as DDP's comm hook: a rank killed mid-step 7 resumes both ranks
    to the uninterrupted run's state, and both ranks hold the same state."""
    for name, fault, extra in (("whole", None, []), ("killed", "kill:step=7:rank=1", ["--max-restarts", "1"])):
        (tmp_path / name).mkdir()
        proc = ok(ckptrun(tmp_path / name, "--nproc-per-node", "2", *LOWDIFF, "--compress", "topk:0.05", *extra,
                          "--dir", "ckpts", "--metrics-dir", "metrics", EXAMPLE, *TINY, "--save-at", STEPS,
                          "--save-path", "own-{rank}.pt", fault=fault))
        assert RESIDUAL_LOST not in proc.stderr
    whole = [load(tmp_path / "whole" / f"own-{rank}.pt") for rank in range(2)]
    assert_training_state(whole[1], whole[0])
    for rank in range(2):
        assert [e["restart_count"] for e in run_events(tmp_path / "killed" / "metrics", rank)] == [0, 1]
        assert_training_state(load(tmp_path / "killed" / f"own-{rank}.pt"), whole[rank])
    assert_training_state(exported(tmp_path / "killed" / "ckpts", STEPS, tmp_path), whole[0])


# ---- (F, B) auto-tuning -----------------------------------------------------------------------
STEP_S, OPT_S, FULL_BYTES, DIFF_BYTES, MTBF_S = 0.1, 0.01, 100e6, 20e6, 1800.0


class Tuned:
    """lowdiff's (F, B) policy on the worker's re-tuner, fed what the runtime measures: steps of
    STEP_S with an optimizer step of OPT_S, snapshot sizes, and writes at a given bandwidth."""

    def __init__(self, **options: str) -> None:
        self.changes: list[tuple[int, Decision]] = []
        self.retuner = Retuner(MTBF_S, on_change=lambda step, policy, d: self.changes.append((step, d)))
        self.policy = self.retuner.add(FullEveryBatch(options.get("full_every", "auto"),
                                                      options.get("batch", "auto")))
        self.retuner.observe_snapshot("full", int(FULL_BYTES))
        self.retuner.observe_snapshot("diff", int(DIFF_BYTES))
        self.step = 0

    def write(self, bandwidth: float, times: int = 10) -> None:
        for _ in range(times):
            self.retuner.observe_write(int(FULL_BYTES), FULL_BYTES / bandwidth)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step += 1
            self.retuner.after_step(self.step, {"step_s": STEP_S, "stall_s": {}, "optim_s": OPT_S})

    @property
    def fb(self) -> tuple[int, int]:
        return self.policy.full_every, self.policy.batch


def expected_fb(bandwidth: float) -> tuple[int, int]:
    return optimal_fb(LowDiffCosts(step_time=STEP_S, full_ckpt_bytes=FULL_BYTES, diff_bytes=DIFF_BYTES,
                                   write_bandwidth=bandwidth, full_load_time=FULL_BYTES / bandwidth,
                                   diff_replay_time=RECORD_OPEN_S, mtbf=MTBF_S,
                                   step_replay_time=DIFF_BYTES / bandwidth + OPT_S))


def test_auto_fb_follows_the_measured_write_bandwidth():
    chosen = {}
    for bw in (1e9, 1e7):
        t = Tuned()
        t.write(bw)
        t.run(FIRST_EVAL)
        chosen[bw] = t.fb
        assert chosen[bw] == expected_fb(bw)
        [(step, decision)] = t.changes
        assert step == FIRST_EVAL and decision.settings == {"full_every": chosen[bw][0], "batch": chosen[bw][1]}
        assert decision.reason.startswith("LowDiff auto:") and f"W={bw / 1e6:.0f} MB/s" in decision.reason
    # Slower writes make full checkpoints dearer: fewer of them, and longer batches between.
    assert chosen[1e7][0] > chosen[1e9][0] and chosen[1e7][1] > chosen[1e9][1]


def test_auto_fb_waits_for_measurements_and_is_retuned_when_the_bandwidth_moves():
    t = Tuned()
    t.run(FIRST_EVAL)  # no write timed yet: nothing to decide from
    assert t.changes == [] and t.fb == (DEFAULT_F, DEFAULT_B)
    t.write(1e9)
    t.run(EVAL_EVERY - FIRST_EVAL)
    first = t.fb
    assert first == expected_fb(1e9) and len(t.changes) == 1
    t.run(EVAL_EVERY)  # same inputs: no change, nothing reported
    assert len(t.changes) == 1
    t.write(1e7)  # the storage slows down
    t.run(EVAL_EVERY)
    assert t.fb == expected_fb(1e7) != first
    step, decision = t.changes[-1]
    assert step == 3 * EVAL_EVERY
    assert decision.reason.startswith(f"LowDiff re-tune: full checkpoint every {first[0]}->{t.fb[0]} steps")


def test_auto_fb_follows_rank_zero():
    """Every rank must take full checkpoints at the same steps: the shared decision wins."""
    t = Tuned()
    t.retuner._share = lambda step, mine: [Decision({"full_every": 7, "batch": 2}, "rank 0 says so")]
    t.write(1e9)
    t.run(FIRST_EVAL)
    assert t.fb == (7, 2)


def test_fixed_full_every_and_batch_are_kept():
    t = Tuned(full_every="5", batch="3")
    t.write(1e7)
    t.run(2 * EVAL_EVERY)  # where an auto setting would be re-tuned
    assert t.fb == (5, 3) and t.changes == []

    t = Tuned(full_every="5")  # only the batch is free: optimised given F, so never above F
    t.write(1e7)
    t.run(2 * EVAL_EVERY)
    assert t.policy.full_every == 5 and 1 <= t.policy.batch <= 5
    assert t.changes and all(d.settings["full_every"] == 5 and d.settings["batch"] <= 5 for _, d in t.changes)
