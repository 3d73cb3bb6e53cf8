"""`ckptrun bench`: one tiny end-to-end bench (JSON schema, ratios against the `none` of the same
invocation, the plot); the references restore what they saved; the pure parts (aggregation,
configuration choice) without runs. Nothing here asserts speed."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil
import sys
import types

import pytest
from conftest import EXAMPLE, FULL, assert_training_state, ckptrun, load, ok, python, run_in_process
from rich.console import Console

from ckptrun.bench import BenchOptions, budget, figures, freshness, plan, report, stats, waste
from ckptrun.bench.figures import FIGURES, RunFigures
from ckptrun.bench.proccpu import CpuTrace
from ckptrun.bench.progress import RunProgress
from ckptrun.bench.runner import Outcome
from ckptrun.errors import CkptrunError, UsageError
from ckptrun.strategies import REGISTRY

MACHINE_KEYS = {"cpu_model", "logical_cores", "torch", "gpus", "dir_filesystem"}


def test_tiny_bench_writes_every_figure_with_ratios_against_its_own_none(tmp_path):
    out, png, runs = tmp_path / "b.json", tmp_path / "b.png", tmp_path / "runs"
    # (--every 1: a checkpoint every step, no budget thinning them: the figures below count them)
    proc = ok(ckptrun(tmp_path, "bench", "--model", "tiny", "--strategies", "sync", "--steps", 4, "--warmup", 1,
                      "--every", 1, "--repeat", 1, "--dir", runs, "--json", out, "--plot", png))
    assert "overhead" in proc.stdout and "sync" in proc.stdout  # the terminal table
    doc = json.loads(out.read_text())
    assert doc["schema"] == report.SCHEMA and doc["command"].startswith("ckptrun bench --model tiny")
    assert MACHINE_KEYS <= doc["machine"].keys()
    assert doc["machine"]["dir_filesystem"]["type"] not in ("", "unknown")
    assert doc["settings"]["params"] > 0
    rows = {c["name"]: c for c in doc["configurations"]}
    assert list(rows) == ["none", "sync"]
    for row in rows.values():
        assert set(stats.KEYS) <= row.keys()
        assert set(row["min"]) == set(row["max"]) == set(stats.KEYS)
        assert row["repetitions"] == 1 and row["errors"] == []
        assert set(row["runs"][0]) == {*FIGURES, "io_engine", "wall_s", "load_1m", "stall_by_cause", "budget_over",
                                     "nothing_on_disk"}
        assert row["min"]["median_step_s"] <= row["median_step_s"] <= row["max"]["median_step_s"]
    none, sync = rows["none"], rows["sync"]
    assert none["overhead_ratio"] == 1.0
    assert sync["overhead_ratio"] == pytest.approx(sync["median_step_s"] / none["median_step_s"], rel=1e-12)
    assert none["committed"] == 0 and none["bytes_per_step"] == 0 and none["recovery_s"] is None
    assert none["stall_ms_per_step"] == 0 and none["write_MBps"] is None
    assert sync["committed"] == 4 and sync["bytes_per_step"] > 0 and sync["write_MBps"] > 0
    assert sync["stall_ms_per_step"] > 0 and 0 < sync["restore_s"] < sync["recovery_s"] and sync["peak_rss_MB"] > 0
    # The recovery's parts: the restart until the optimizer exists, ckptrun's restore, the first step.
    assert sync["setup_s"] > 0 and sync["setup_s"] + sync["restore_s"] < sync["recovery_s"]
    # The staging slots are shared memory, counted once in the memory held (RSS counts them per process).
    assert none["staging_MB"] == 0 and sync["staging_MB"] > 0 and 0 < sync["peak_MB"]
    assert none["against"] is None and sync["against"] == "none"
    # Where the cost goes: forward+backward against none's, and CPU per step of each process role.
    assert none["compute_ratio"] == 1.0 and 0 < none["compute_s"] < none["median_step_s"]
    assert sync["compute_ratio"] == pytest.approx(sync["compute_s"] / none["compute_s"], rel=1e-12)
    assert none["trainer_cpu_ms_per_step"] > 0 and none["engine_cpu_ms_per_step"] == 0
    assert none["launcher_cpu_ms_per_step"] is None  # the bench ran the script itself
    assert sync["trainer_cpu_ms_per_step"] > 0 and sync["engine_cpu_ms_per_step"] > 0
    assert sync["launcher_cpu_ms_per_step"] is not None
    assert "fwd+bwd ratio" in proc.stdout
    # The budget table: sync every step, its stall by cause, freshness, waste at 1h
    assert all(h in proc.stdout for h in ("stall by cause", "memory", "disk", "waste", "MTBF 1h")), proc.stdout
    assert sync["every"] == 1 and doc["settings"]["every"] == "1" and doc["settings"]["budget"] == 0.05
    assert set(sync["stall_by_cause"]) >= {"snapshot", "backpressure", "sync_write"}
    assert sum(sync["stall_by_cause"].values()) == pytest.approx(sync["stall_ms_per_step"])
    assert 0 <= sync["fresh_disk_median"] <= sync["fresh_disk_max"] <= 4 and sync["fresh_disk_mean"] is not None
    assert sync["predicted_waste"]["1h"] > max(0.0, sync["overhead_ratio"] - 1) and none["predicted_waste"] == {
        "1h": None}
    assert sync["over_budget"] is False and sync["own_overhead"] is None  # no budget events from this run
    assert none["fresh_disk_median"] is None and none["stall_by_cause"] is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(runs.iterdir()) == []  # successful runs leave nothing behind


def _figures(step_s: float, recovery_s: float | None = 1.0) -> RunFigures:
    return RunFigures(step_s=step_s, stall_ms_per_step=step_s * 100, bytes_per_step=10.0, write_MBps=None,
                      peak_rss_MB=100.0, committed=3, recovery_s=recovery_s)


def test_summary_is_median_min_max_with_ratios_against_none_and_keeps_failures():
    configs = plan.configurations("sync", "1")
    outcomes = {
        "none": [Outcome(_figures(s, None), None, 1.0) for s in (2.0, 1.0, 4.0)],
        "sync": [Outcome(_figures(3.0), None, 1.0), Outcome(None, "boom", 1.0), Outcome(_figures(5.0, 3.0), None, 1.0)],
    }
    none, sync = stats.summarize(configs, outcomes)
    assert (none["median_step_s"], none["min"]["median_step_s"], none["max"]["median_step_s"]) == (2.0, 1.0, 4.0)
    assert none["recovery_s"] is None and none["write_MBps"] is None
    assert sync["median_step_s"] == 4.0 and sync["repetitions"] == 2 and sync["errors"] == ["boom"]
    assert (sync["overhead_ratio"], sync["min"]["overhead_ratio"], sync["max"]["overhead_ratio"]) == (2.0, 1.5, 2.5)
    assert (sync["recovery_s"], sync["min"]["recovery_s"], sync["max"]["recovery_s"]) == (2.0, 1.0, 3.0)
    assert sync["runs"][1] == {"error": "boom", "wall_s": 1.0, "load_1m": None}


class _FakeProcess:
    """What CpuTrace reads of a psutil.Process: pid, creation time, cumulative CPU times."""

    def __init__(self, pid: int, created: float, user: float, system: float = 0.0) -> None:
        self.pid, self._created, self._times = pid, created, (user, system)

    def oneshot(self):
        return contextlib.nullcontext()

    def create_time(self) -> float:
        return self._created

    def cpu_times(self):
        return types.SimpleNamespace(user=self._times[0], system=self._times[1])


def test_cpu_per_role_is_each_process_interpolated_over_the_window():
    """Trainer 10 -> 12 s between samples at t=100 and 102 (1 s/s), engine created at t=101 and at
    0.5 s CPU at 102, the launcher (the root) 3 -> 3.2 s; a process gone after t=102 keeps its last
    value. The window 100.5-101.5: trainer 1 s, engine 0.25 s (0 before its creation), launcher
    0.1 s; beyond the last sample nothing is added."""
    trace = CpuTrace(root_pid=1)
    trace.record([_FakeProcess(1, 0.0, 2.0, 1.0), _FakeProcess(2, 0.0, 10.0)], now=100.0)
    trace.record([_FakeProcess(1, 0.0, 2.1, 1.1), _FakeProcess(2, 0.0, 11.0, 1.0), _FakeProcess(3, 101.0, 0.5)],
                 now=102.0)
    roles = trace.per_role(2, 100.5, 101.5)
    assert roles == pytest.approx({"trainer": 1.0, "engine": 0.25, "launcher": 0.1})
    assert trace.per_role(2, 102.0, 200.0) == {"trainer": 0.0, "engine": 0.0, "launcher": 0.0}
    assert trace.per_role(1, 100.0, 102.0)["launcher"] is None  # the trainer is the root: no launcher
    assert trace.per_role(9, 100.0, 102.0)["trainer"] is None  # never sampled


def test_configurations_put_none_first_and_name_intervals():
    names = [c.name for c in plan.configurations("checkfreq,torch.save", "1,5")]
    assert names == ["none", "checkfreq@1", "checkfreq@5", "torch.save@1", "torch.save@5"]
    everything = {c.method for c in plan.configurations("all", "1")}
    assert {"none", "torch.save", "dcp-thread", "dcp-process", "sync", "checkfreq"} <= everything
    # The default answers "what does each strategy cost against what I would use otherwise": each
    # registered strategy once at its defaults, one DCP mode; the variants only under `all`.
    default = [c.name for c in plan.configurations("default", "1")]
    assert default == ["none", "torch.save", "dcp-thread", *REGISTRY]
    assert not set(default) & {*plan.VARIANTS, "dcp-process"}
    assert {*plan.VARIANTS, "dcp-process"} <= {c.name for c in plan.configurations("all", "1")}
    assert BenchOptions().strategies == "default" and BenchOptions().repeat == 1
    with pytest.raises(UsageError, match="unknown --strategies nope"):
        plan.configurations("nope", "1")
    with pytest.raises(UsageError, match="--every"):
        plan.configurations("sync", "0")


def test_progress_is_a_bar_on_a_terminal_and_a_line_per_run_in_a_log():
    log = Console(file=io.StringIO(), width=120)
    with RunProgress(log, 2) as shown:
        shown.running("sync (1/1)")
        shown.done("none (repetition 1): 10.0 ms/step")
        shown.done("sync (repetition 1): FAILED: boom", failed=True)
    assert [ln.split(" [")[0] for ln in log.file.getvalue().splitlines()] == [
        "[1/2] none (repetition 1): 10.0 ms/step", "[2/2] sync (repetition 1): FAILED: boom"]
    term = Console(file=io.StringIO(), width=120, force_terminal=True, color_system=None)
    with RunProgress(term, 2) as shown:
        shown.running("sync (1/1)")
        shown.done("none (repetition 1): 10.0 ms/step")
        shown._bar.refresh()
        shown.done("sync (repetition 1): FAILED: boom", failed=True)
    out = term.file.getvalue()
    assert "sync (1/1)" in out and "1/2 runs" in out and "elapsed, left" in out and "0:00:00" in out
    assert "FAILED: boom" in out and "10.0 ms/step" not in out  # a run's figures: in the report, not here


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(CkptrunError, match=r"pip install 'ckptrun\[plot\]'"):
        report.require_matplotlib()


# Dropout off: the references save model, optimizer and scheduler, not the RNG (as most scripts).
REF_ARGS = ["--layers", "1", "--d-model", "32", "--steps", 6, "--threads", 1, "--dropout", 0]


@pytest.fixture(scope="module")
def no_dropout_truth(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ref-truth")
    run_in_process(root, EXAMPLE, *REF_ARGS, "--save-at", 6, "--save-path", root / "truth.pt")
    return load(root / "truth.pt")


# dcp-thread under --full: it differs from dcp-process only in where DCP's async save runs.
@pytest.mark.parametrize("ref", ["torch", pytest.param("dcp-thread", marks=FULL), "dcp-process"])
def test_reference_resumes_from_its_newest_save_like_an_uninterrupted_run(tmp_path, ref, no_dropout_truth):
    """Saves at 2, 4, 6 (the newest two kept); without the one of step 6, a resumed run restores
    step 4, takes steps 5 and 6, and ends where the uninterrupted run did."""
    ref_dir, timing = tmp_path / "ref", tmp_path / "timing.jsonl"
    python(tmp_path, EXAMPLE, *REF_ARGS, "--ref-save", ref, "--ref-every", 2, "--ref-dir", ref_dir,
           "--timing-json", timing)
    saves = sorted(p.name for p in ref_dir.iterdir() if p.name.startswith("step-"))
    assert [s.split(".")[0] for s in saves] == ["step-00000004", "step-00000006"]
    newest = ref_dir / saves[-1]
    shutil.rmtree(newest) if newest.is_dir() else newest.unlink()
    python(tmp_path, EXAMPLE, *REF_ARGS, "--ref-save", ref, "--ref-every", 7, "--ref-dir", ref_dir, "--ref-resume",
           "--timing-json", timing, "--save-at", 6, "--save-path", tmp_path / "resumed.pt")
    assert_training_state(load(tmp_path / "resumed.pt"), no_dropout_truth)
    first, resumed = figures.attempts(timing)
    assert [s["step"] for s in first.saves] == [2, 4, 6] and all(s["bytes"] > 0 for s in first.saves)
    ended = {s["step"]: s["t"] for s in first.steps}  # a save is on disk after its step began, before the end
    assert all(ended[s["step"] - 1] < s["done_t"] <= ended[6] + 1 for s in first.saves)
    assert [s["step"] for s in first.steps] == [1, 2, 3, 4, 5, 6]
    assert resumed.start_step == 4 and [s["step"] for s in resumed.steps] == [5, 6]
    assert resumed.saves == [] and resumed.recovery["recovery_s"] > 0
    assert 0 < resumed.recovery["setup_s"] and 0 < resumed.recovery["restore_s"] < resumed.recovery["recovery_s"]


def test_compressed_training_is_compared_with_compressed_training_without_checkpointing():
    """`lowdiff+topk` changes training (`Option.trains`): its overhead is against `none+topk:0.01`,
    the example script trained with the same compression, which `none+topk:0.01` is measured
    against `none` (the cost of compression itself)."""
    configs = {c.name: c for c in plan.configurations("checkfreq,lowdiff+topk", "1")}
    assert list(configs) == ["none", "none+topk:0.01", "checkfreq", "lowdiff+topk"]
    ref = configs["none+topk:0.01"]
    assert (ref.kind, ref.flags, ref.reference) == ("baseline", ("--compress", "topk:0.01"), "none")
    assert configs["lowdiff+topk"].reference == "none+topk:0.01" and configs["checkfreq"].reference == "none"
    steps = {"none": 1.0, "none+topk:0.01": 2.0, "checkfreq": 1.5, "lowdiff+topk": 3.0}
    outcomes = {name: [Outcome(_figures(s, None if name.startswith("none") else 1.0), None, 1.0)]
                for name, s in steps.items()}
    rows = {r["name"]: r for r in stats.summarize(list(configs.values()), outcomes)}
    assert rows["lowdiff+topk"]["overhead_ratio"] == 1.5 and rows["lowdiff+topk"]["against"] == "none+topk:0.01"
    assert rows["none+topk:0.01"]["overhead_ratio"] == 2.0 and rows["checkfreq"]["overhead_ratio"] == 1.5


def test_the_compressed_reference_trains_exactly_as_lowdiff_does(tmp_path, no_dropout_truth):
    """The fair reference is fair only if it computes what lowdiff+topk computes: the example
    script's own `--compress` and lowdiff's `--compress` end in the same state, bit for bit."""
    args = [*REF_ARGS, "--save-at", 6]
    run_in_process(tmp_path, EXAMPLE, *args, "--compress", "topk:0.05", "--save-path", tmp_path / "plain.pt")
    ok(ckptrun(tmp_path, "--strategy", "lowdiff", "--compress", "topk:0.05", "--dir", "ck", EXAMPLE, *args,
               "--save-path", tmp_path / "lowdiff.pt"))
    assert_training_state(load(tmp_path / "lowdiff.pt"), load(tmp_path / "plain.pt"))
    with pytest.raises(AssertionError):  # (the compression does change training: the same run uncompressed)
        assert_training_state(no_dropout_truth, load(tmp_path / "plain.pt"))


SHARER = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, 0)
for i in range(0, len(m), 4096):
    m[i] = 1
print("ready", flush=True)
time.sleep(60)
"""


def test_memory_counts_shared_staging_once(tmp_path):
    """Two processes map one 16 MiB shared-memory file (as a worker and its engine map a staging
    slot): RSS counts it twice, the memory held once, and it is the staging figure."""
    import subprocess

    from ckptrun.bench.procmem import PeakMemory
    from ckptrun.ipc.staging import shm_root

    slot = shm_root() / f"ckptrun-test-{tmp_path.name}"
    slot.write_bytes(b"\0" * (16 << 20))
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "ps = [subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], "
                               "stdout=subprocess.PIPE) for _ in range(2)]\n"
                               "[p.stdout.readline() for p in ps]\nprint('ready', flush=True)\ntime.sleep(60)",
                               SHARER, str(slot)], stdout=subprocess.PIPE)
    try:
        assert parent.stdout.readline().strip() == b"ready"
        sampler = PeakMemory(parent.pid, include_root=False)
        rss, held, staging = sampler.sample()
    finally:
        for p in psutil_children(parent.pid):
            p.kill()
        parent.kill()
        parent.wait()
        slot.unlink()
    assert staging == 16 << 20
    assert rss >= 2 * (16 << 20) and staging < held < rss - (16 << 20) + (4 << 20)


def psutil_children(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def test_durable_twins_are_measured_against_their_plain_runs(tmp_path):
    """`bench --durable URL`: each strategy's configuration is followed by NAME+durable, the same
    run draining to URL, its ratio against NAME; each launch drains under a prefix of its own
    (a run never resumes from another's remote steps)."""
    configs = {c.name: c for c in plan.configurations("torch.save,checkfreq", "1", durable="s3://b/p/")}
    assert list(configs) == ["none", "torch.save", "checkfreq", "checkfreq+durable"]
    twin = configs["checkfreq+durable"]
    assert (twin.method, twin.reference, twin.durable) == ("checkfreq", "checkfreq", "s3://b/p/")
    work = plan.Workload(EXAMPLE, "tiny", "cpu", 1)
    urls = [argv[argv.index("--durable") + 1] for argv in
            (plan.launch(twin, work, tmp_path / "r0", 4).argv for _ in range(2))]
    assert all(u.startswith("s3://b/p/r0-") for u in urls) and urls[0] != urls[1]
    assert "--durable" not in plan.launch(configs["checkfreq"], work, tmp_path / "r0", 4).argv


@pytest.mark.parametrize("durable", ["", "/tmp/remote"])
def test_the_against_column_stays_at_80_columns_where_a_ratio_is_not_against_none(durable):
    """At 80 columns `against` is left out first, unless a row's ratio is against another row
    (`NAME+durable` against `NAME`): then it stays, and says which."""
    configs = plan.configurations("checkfreq", "1", durable=durable)
    outcomes = {c.name: [Outcome(_figures(1.0 + 0.5 * i, None if i == 0 else 1.0), None, 1.0)]
                for i, c in enumerate(configs)}
    console = Console(record=True, width=80, file=io.StringIO())
    report.print_tables(report.tables(stats.summarize(configs, outcomes), "title", 80), console)
    lines = console.export_text().splitlines()
    header = next(line for line in lines if "configuration" in line)
    assert ("against" in header) == bool(durable), "\n".join(lines)
    if durable:
        row = next(line for line in lines if "checkfreq+durable" in line)
        assert "1.33x" in row and "checkfreq " in row.replace("checkfreq+durable", ""), row


def test_two_node_configurations_twin_each_replicable_strategy_and_leave_out_the_references():
    """`bench --nodes 2 --replicas 2`: `default` leaves the references out (one process each)
    and one named is refused; each strategy that takes --replicas is followed by NAME+node-local
    (a --dir per node), its ratio against NAME, then NAME+replicas, its ratio against
    NAME+node-local (what the copies alone add); a strategy that does not take it has no twin."""
    configs = {c.name: c for c in plan.configurations("default", "1", nodes=2, replicas=2)}
    assert not set(plan.REFERENCES) & set(configs)
    replicable = {name for name, e in REGISTRY.items() if e.replicas}
    for suffix in ("+node-local", "+replicas"):
        assert {n.removesuffix(suffix) for n in configs if n.endswith(suffix)} == replicable
    names = list(configs)
    assert names.index("checkfreq") + 1 == names.index("checkfreq+node-local") == names.index("checkfreq+replicas") - 1
    local, twin = configs["checkfreq+node-local"], configs["checkfreq+replicas"]
    assert (local.method, local.reference, local.flags[-1]) == ("checkfreq", "checkfreq", "--node-local-dir")
    assert (twin.method, twin.reference) == ("checkfreq", "checkfreq+node-local")
    assert twin.flags == (*local.flags, "--replicas", "2")
    with pytest.raises(UsageError, match="torch.save run on one node"):
        plan.configurations("torch.save,checkfreq", "1", nodes=2)
    for bad, match in (({"nodes": 3}, "--nodes takes 1 or 2"), ({"replicas": 2}, "1 <= K <= --nodes"),
                       ({"nodes": 2, "failures": "node"}, "--failures runs on one node")):
        with pytest.raises(UsageError, match=match):
            BenchOptions(**bad).validate()


def test_a_first_checkpoint_in_the_timed_steps_is_named():
    """The first checkpoint allocates, touches and (on a GPU) page-locks the staging slots: in a
    short run at --every 10 with the default warm-up it would be the one checkpoint measured."""
    assert BenchOptions(every="10", steps=12).first_checkpoint_timed() == [10]
    assert BenchOptions(every="1,5,10", steps=22, warmup=4).first_checkpoint_timed() == [5, 10]
    assert BenchOptions(every="10", steps=22, warmup=10).first_checkpoint_timed() == []
    assert BenchOptions(every="1", steps=6).first_checkpoint_timed() == []  # step 1 is in the warm-up
    assert BenchOptions(every="50", steps=30).first_checkpoint_timed() == []  # none in the run


@FULL
def test_two_node_bench_times_a_lost_node_back_from_its_partner(tmp_path):
    """`bench --nodes 2 --replicas 2` end to end (network namespaces; skipped without root):
    every configuration measured, the +replicas twin's copies shipped and the lost node's state
    taken back from its partner's memory (its recovery measured, the take-back in its restore)."""
    from ckptrun.bench import netns

    if why := netns.why_not():
        pytest.skip(f"two-node bench skipped: {why}")
    out = tmp_path / "bench.json"
    ok(ckptrun(tmp_path, "bench", "--nodes", "2", "--replicas", "2", "--model", "tiny", "--strategies",
               "checkfreq", "--steps", "10", "--json", out))
    rows = {r["name"]: r for r in json.loads(out.read_text())["configurations"]}
    assert list(rows) == ["none", "checkfreq", "checkfreq+node-local", "checkfreq+replicas"]
    assert all(r["repetitions"] == 1 for r in rows.values()), rows
    assert rows["checkfreq"]["shipped_per_step"] is rows["checkfreq+node-local"]["shipped_per_step"] is None
    assert rows["checkfreq+replicas"]["shipped_per_step"] > 0
    for name in ("checkfreq", "checkfreq+node-local", "checkfreq+replicas"):
        assert rows[name]["recovery_s"] > rows[name]["restore_s"] > 0, rows[name]


def test_every_default_runs_each_strategy_at_its_defaults_and_forwards_a_given_budget(tmp_path):
    """`--every default` (the default): a strategy's run gets no --every (its own defaults, its
    recovery still measured), a reference's interval is chosen before it runs; a numeric interval
    works as before; --max-overhead reaches every ckptrun run only when given."""
    assert BenchOptions().every == plan.DEFAULTS
    configs = {c.name: c for c in plan.configurations("checkfreq,torch.save", "default")}
    assert (configs["checkfreq"].every, configs["torch.save"].every) == (None, None)
    work = plan.Workload(EXAMPLE, "tiny", "cpu", 1)
    run = plan.launch(configs["checkfreq"], work, tmp_path / "r", 4)
    assert "--every" not in run.argv and "--max-overhead" not in run.argv and run.crash_step == 5
    with pytest.raises(CkptrunError, match="no interval yet"):
        plan.launch(configs["torch.save"], work, tmp_path / "r", 4)
    at_5 = plan.launch(plan.configurations("checkfreq", "5")[1], work, tmp_path / "r", 4).argv
    assert at_5[at_5.index("--every") + 1] == "5"
    assert [c.name for c in plan.configurations("sync", "default,5")] == ["none", "sync@auto", "sync@5"]
    budgeted = {c.name: c for c in plan.configurations("checkfreq,torch.save", "default", max_overhead="3")}
    argv = plan.launch(budgeted["checkfreq"], work, tmp_path / "r", 4).argv
    assert argv[argv.index("--max-overhead") + 1] == "3" and "--max-overhead" not in budgeted["torch.save"].flags
    for bad in ("sometimes", "0,default"):
        with pytest.raises(UsageError, match="--every"):
            BenchOptions(every=bad).validate()
    with pytest.raises(UsageError, match="--max-overhead"):
        BenchOptions(max_overhead="120").validate()
    assert BenchOptions(max_overhead="off").budget() is None and BenchOptions().budget() == 0.05
    assert BenchOptions().mtbf_s() == [3600.0] and BenchOptions(failures="worker").mtbf_s() == [30.0]


def test_a_reference_runs_at_the_fewest_steps_between_saves_within_the_budget(tmp_path, monkeypatch):
    """A save costing 0.5 s against a 2 s step keeps within 5% saved every 5 steps (0.5 / 10 s);
    the cost is a calibration run's step time less none's (saving every step)."""
    assert budget.reference_interval(0.5, 2.0, 0.05) == 5
    assert budget.reference_interval(0.51, 2.0, 0.05) == 6
    assert budget.reference_interval(0.0, 2.0, 0.05) == budget.reference_interval(-0.1, 2.0, 0.05) == 1
    step_s = {"none": 2.0, "torch.save": 3.0, "dcp-thread": 2.2}
    ran = []

    def fake_run(cfg, work, run_dir, steps, warmup, timeout_s, *, recover=True):
        ran.append((cfg.name, cfg.every, steps, recover))
        lag = freshness.Freshness(disk_mean=0.0 if cfg.method == "torch.save" else 1.5)
        return Outcome(_figures(step_s[cfg.method]).set_freshness(lag), None, 1.0)

    monkeypatch.setattr(budget, "run_configuration", fake_run)
    configs = plan.configurations("checkfreq,torch.save,dcp-thread", "default")
    console = Console(file=io.StringIO(), width=200)
    work = plan.Workload(EXAMPLE, "tiny", "cpu", 1)
    chosen, cal = budget.calibrate(configs, work, tmp_path, 2, 0.05, 60.0, console)
    assert ran == [("none", None, 7, False), ("torch.save@1", 1, 7, False), ("dcp-thread@1", 1, 7, False)]
    every = {c.name: c.every for c in chosen}
    assert every == {"none": None, "checkfreq": None, "torch.save": 10, "dcp-thread": 2}
    assert cal.save_cost_s == pytest.approx({"torch.save": 1.0, "dcp-thread": 0.2})
    assert {c.name: c.save_lag_steps for c in chosen if c.kind == "reference"} == {"torch.save": 0.0,
                                                                                   "dcp-thread": 1.5}
    assert "torch.save every 10 (1000 ms a save)" in cal.note() and "2000 ms step" in cal.note()
    assert [c.every for c in budget.calibrate(configs, work, tmp_path, 2, None, 60.0, console)[0]][2:] == [1, 1]
    assert len(ran) == 3  # no budget: every step, nothing calibrated


def test_freshness_is_the_distance_back_to_the_newest_step_in_memory_and_on_disk():
    """Per timed step, the newest step in host memory (snapshot done or held) and on disk; the
    largest distance over ranks; a restarted worker's second record of a step is not timed."""
    def rec(step, rank=0, snap=None, mem=None, durable=None):
        return {"type": "step", "rank": rank, "step": step, "last_snapshot_done": snap,
                "last_durable_step": durable, **({} if mem is None else {"last_memory_step": mem})}

    records = [rec(2, snap=1), rec(3, snap=2), rec(3, rank=1, snap=3), rec(4, snap=3, durable=2),
               rec(5, snap=4, mem=5, durable=2), rec(6, snap=6, durable=6), {"type": "commit", "step": 6},
               rec(4, snap=4, durable=4)]  # (step 4 again, after a restart)
    f = freshness.worker_freshness(records, 3, 6)
    # memory distances 3:1 (rank 0 behind), 4:1, 5:0, 6:0; disk 3:3, 4:2, 5:3, 6:0; either: 3:1, 4:1, 5:0, 6:0
    assert (f.memory_median, f.memory_max, f.disk_median, f.disk_max) == (0.5, 1, 2.5, 3)
    assert (f.restorable_mean, f.disk_mean) == (0.5, 2.0)
    no_memory = freshness.worker_freshness([rec(s, durable=s - 1 if s > 3 else None) for s in (3, 4, 5)], 3, 5)
    assert (no_memory.memory_median, no_memory.disk_max, no_memory.restorable_mean) == (None, 3, 5 / 3)
    # A script's own saves are on disk when `done_t` says: step 2's save lands during step 3
    steps = [{"step": s, "t": 10.0 + s} for s in (2, 3, 4)]
    saves = [{"step": 2, "done_t": 12.5}, {"step": 4, "done_t": 13.9}]
    on_disk = freshness.saves_freshness(steps, saves)
    assert (on_disk.memory_median, on_disk.disk_median, on_disk.disk_max, on_disk.disk_mean) == (None, 1, 2, 1.0)
    assert not (f.nothing_on_disk or no_memory.nothing_on_disk or on_disk.nothing_on_disk)
    # A run whose interval exceeds it: nothing on disk by its end, its distances only grow (said, a lower bound)
    unsaved = freshness.saves_freshness(steps, [{"step": 4, "done_t": 15.0}])
    assert (unsaved.disk_median, unsaved.disk_max, unsaved.nothing_on_disk) == (3, 4, True)


def test_predicted_waste_is_overhead_plus_lost_work_and_recovery_per_mtbf():
    """At 1h with the default split (half the failures process, half lose the memory): 3% overhead,
    2 s steps, 1 step back to memory-or-disk, 5 to disk, 10 s recovery: (0.5*1 + 0.5*5 + 0.5
    steps) * 2 s + 10 s = 17 s per hour on top of the overhead."""
    assert waste.predicted_waste(0.03, 2.0, 1.0, 5.0, 10.0, 3600.0) == pytest.approx(0.03 + 17 / 3600)
    assert waste.predicted_waste(-0.01, 2.0, 5.0, 5.0, None, 3600.0) == pytest.approx(11 / 3600)  # noise: 0
    configs = plan.configurations("sync", "default")
    figs = {"none": _figures(2.0, None), "sync": _figures(2.06, 10.0).set_freshness(
        freshness.Freshness(0.0, 1, 4.0, 6, 1.0, 5.0))}
    rows = {r["name"]: r for r in stats.summarize(configs, {n: [Outcome(f, None, 1.0)] for n, f in figs.items()},
                                                   (3600.0, 60.0))}
    assert rows["sync"]["predicted_waste"] == pytest.approx({"1h": 0.03 + (3.5 * 2.06 + 10) / 3600,
                                                             "1m": 0.03 + (3.5 * 2.06 + 10) / 60})
    assert rows["none"]["predicted_waste"] == {"1h": None, "1m": None}
    # A reference at every 10 that saved nothing in the run: (10 - 1) / 2 steps + its 1.5 steps of lag
    ref = next(c for c in plan.configurations("torch.save", "10") if c.kind == "reference")
    ref = dataclasses.replace(ref, save_lag_steps=1.5)
    unsaved = _figures(2.06, None).set_freshness(freshness.Freshness(None, None, 5.0, 9, 5.0, 5.0, True))
    row = stats.summarize([configs[0], ref], {"none": [Outcome(figs["none"], None, 1.0)],
                                              "torch.save": [Outcome(unsaved, None, 1.0)]})[1]
    assert stats.interval_model(row) and row["predicted_waste"]["1h"] == pytest.approx(0.03 + 6.5 * 2.06 / 3600)


def test_a_run_that_says_it_cannot_keep_within_the_budget_is_marked():
    """The worker's `budget` event with verdict `over` marks the row; its last `overhead` event
    before a restart is the run's own figure (`run says`); the budget table reads at 80 columns."""
    events = [{"type": "overhead", "overhead": 0.09, "budget": 0.05, "t": 1},
              {"type": "budget", "verdict": "over", "strategy": "lowdiff", "t": 2},
              {"type": "overhead", "overhead": 0.081, "budget": 0.05, "t": 3}, {"type": "restart", "t": 4},
              {"type": "overhead", "overhead": 0.5, "budget": 0.05, "t": 5}]
    said = figures._budget(events)
    assert said == {"budget_over": events[1], "own_overhead": 0.081, "own_budget": 0.05}
    assert figures._budget([{"type": "budget", "verdict": "within"}])["budget_over"] is None
    configs = plan.configurations("checkfreq,lowdiff", "default")
    outcomes = {c.name: [Outcome(_figures(1.0 + 0.1 * i), None, 1.0)] for i, c in enumerate(configs)}
    for f in (outcomes["lowdiff"][0].figures,):
        f.budget_over, f.own_overhead, f.own_budget = events[1], 0.081, 0.05
        f.stall_by_cause = {"snapshot": 1.25, "backpressure": 40.0, "sync_write": 0.0}
        f.set_freshness(freshness.Freshness(0.0, 1, 3.0, 7, 0.5, 3.5))
    rows = stats.summarize(configs, outcomes)
    assert [r["over_budget"] for r in rows] == [False, False, True]
    console = Console(record=True, width=80, file=io.StringIO())
    report.print_tables(report.budget_tables(rows, 0.05, None, 80), console)
    lines = console.export_text().splitlines()
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    row = next(line for line in lines if "lowdiff*" in line)
    assert all(cell in row for cell in ("8.1% of 5%", "bp 40 snap 1.2", "0/1", "3/7", "%")), row
    assert any(line.startswith("* the run said its strategy cannot keep within the budget") for line in lines)
    rows[1]["nothing_on_disk"], rows[1]["predicted_waste"] = True, {"1h": 0.2}  # (checkfreq saved nothing)
    console = Console(record=True, width=80, file=io.StringIO())
    report.print_tables(report.budget_tables(rows, 0.05, None, 80), console)
    row = next(line for line in console.export_text().splitlines() if "checkfreq" in line)
    assert " none " in row and " >20.0%" in row, row


def test_a_strategy_at_its_defaults_may_have_committed_nothing_by_the_crash():
    """At its defaults a strategy's budget may space its checkpoints beyond a short run: the
    restarted worker starting over from 0 then leaves its recovery unmeasured; with a given
    interval it is an error, as before."""
    events = [{"type": "restart", "resume_step": 0, "recovery_s": 3.0}]
    result = _figures(1.0, None)
    figures.ckptrun_recovery(result, events, required=False)
    assert result.recovery_s is None
    with pytest.raises(CkptrunError, match="started over from step 0"):
        figures.ckptrun_recovery(result, events)


def test_a_strategy_without_its_budget_runs_beside_it_with_the_budget_off():
    from ckptrun.bench import plan

    configs = {c.name: c for c in plan.configurations("checkfreq,checkfreq-nobudget", "default")}
    assert configs["checkfreq"].flags == ("--io-engine", "auto")
    assert configs["checkfreq-nobudget"].method == "checkfreq"
    assert configs["checkfreq-nobudget"].flags == ("--max-overhead", "off", "--io-engine", "auto")
    assert "checkfreq-nobudget" not in [c.name for c in plan.configurations("all", "default")]


def test_a_host_memory_given_to_bench_reaches_every_ckptrun_run_and_a_bad_one_is_refused():
    from ckptrun.bench import plan
    from ckptrun.bench.options import BenchOptions

    configs = plan.configurations("checkfreq,torch.save", "default", host_memory="12G")
    assert [c.flags for c in configs if c.kind == "ckptrun"] == [("--host-memory", "12G", "--io-engine", "auto")]
    with pytest.raises(UsageError, match="--host-memory"):
        BenchOptions(host_memory="lots").validate()
