"""Dashboard pipeline: tailing metrics files, folding events, rendering, log mode, metrics file."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from ckptrun.launcher.console.dashboard import (
    Dashboard,
    log_line,
    render,
    render_host_memory,
    render_rank_table,
    render_summary,
    sparkline,
)
from ckptrun.launcher.console.hostmetrics import HostSampler
from ckptrun.launcher.console.metrics_feed import MetricsFileWriter, MetricsTailer
from ckptrun.launcher.console.metrics_state import MetricsState
from ckptrun.launcher.console.series import percentile

T0 = 1_700_000_000.0


def _append(path: Path, text: str) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(text)


def _line(event: dict) -> str:
    return json.dumps(event) + "\n"


def _run(rank: int, t: float = T0, pid: int = 1000) -> dict:
    return {
        "type": "run",
        "t": t,
        "rank": rank,
        "pid": pid + rank,
        "strategy": "async-overlap",
        "settings": {"interval": 10, "keep": 3},
        "dir": "/ckpts/[exp1]",
        "world_size": 2,
        "restart_count": 0,
    }


def _step(
    rank: int,
    step: int,
    t: float,
    snapshot: float = 0.0,
    backpressure: float = 0.0,
    sync_write: float = 0.0,
    nbytes: int = 0,
    step_s: float = 0.5,
    durable: int | None = None,
) -> dict:
    return {
        "type": "step",
        "t": t,
        "rank": rank,
        "step": step,
        "step_s": step_s,
        "stall_s": {"snapshot": snapshot, "backpressure": backpressure, "sync_write": sync_write},
        "bytes": nbytes,
        "inflight": 1 if nbytes else 0,
        "last_snapshot_step": step - step % 10,
        "last_durable_step": durable,
    }


def _scenario() -> MetricsState:
    """Rank 0: 100 steps of 0.5 s, snapshot stall i ms at step i, two writes, commit of step 90."""
    state = MetricsState()
    state.apply(_run(0))
    state.apply({"type": "engine", "t": T0, "local_rank": 0, "pid": 2000})
    for i in range(1, 101):
        state.apply(
            _step(
                0,
                i,
                T0 + 0.5 * i,
                snapshot=i / 1000,
                backpressure=0.002 if i == 50 else 0.0,
                nbytes=10_000_000 if i % 10 == 0 else 0,
            )
        )
    state.apply(
        {
            "type": "write",
            "t": T0 + 46,
            "rank": 0,
            "step": 80,
            "bytes": 10_000_000,
            "write_s": 0.5,
            "queue_depth": 2,
        }
    )
    state.apply(
        {
            "type": "write",
            "t": T0 + 47,
            "rank": 0,
            "step": 90,
            "bytes": 30_000_000,
            "write_s": 1.0,
            "queue_depth": 1,
        }
    )
    state.apply(
        {
            "type": "commit",
            "t": T0 + 48,
            "step": 90,
            "bytes": 40_000_000,
            "kind": "full",
            "ranks": 1,
            "lag_s": 2.5,
        }
    )
    return state


class FakeNvml:
    """Stand-in for pynvml; ``fail`` names the call that raises."""

    def __init__(self, count: int = 1, fail: str | None = None) -> None:
        self.count, self.fail, self.shutdowns = count, fail, 0

    def _maybe_fail(self, name: str) -> None:
        if self.fail == name:
            raise RuntimeError(f"{name} exploded")

    def nvmlInit(self) -> None:
        self._maybe_fail("nvmlInit")

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        self._maybe_fail("nvmlDeviceGetCount")
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        self._maybe_fail("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=87 + handle, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        self._maybe_fail("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(used=30_000_000_000, total=80_000_000_000, free=50_000_000_000)


def _text(renderable: object, width: int = 140) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


# --------------------------------------------------------------------------- tailer


def test_tailer_reads_only_complete_lines_and_new_files(tmp_path: Path) -> None:
    tailer = MetricsTailer(tmp_path / "not-yet")
    assert tailer.poll() == []  # folder does not exist yet

    tailer = MetricsTailer(tmp_path)
    w0 = tmp_path / "worker-0.jsonl"
    first = _line(_step(0, 1, T0 + 1))
    second = _line(_step(0, 2, T0 + 2))
    _append(w0, first + second[:25])  # second line half written
    assert [e["step"] for e in tailer.poll()] == [1]
    assert tailer.poll() == []  # still half written
    _append(w0, second[25:])
    assert [e["step"] for e in tailer.poll()] == [2]

    # A new file appears; a bad line in it is skipped, not fatal; events come back ordered by time.
    e0 = tmp_path / "engine-0.jsonl"
    _append(
        e0, _line({"type": "engine", "t": T0 + 4, "local_rank": 0, "pid": 7}) + "{not json\n" + "[1, 2]\n"
    )
    _append(w0, _line(_step(0, 3, T0 + 3)))
    (tmp_path / "notes.txt").write_text('{"type": "step"}\n')  # not *.jsonl: ignored
    events = tailer.poll()
    assert [e["type"] for e in events] == ["step", "engine"]
    assert tailer.bad_lines == 2
    assert tailer.poll() == []


def test_tailer_rereads_truncated_file(tmp_path: Path) -> None:
    tailer = MetricsTailer(tmp_path)
    w0 = tmp_path / "worker-0.jsonl"
    _append(w0, _line(_step(0, 1, T0)) + _line(_step(0, 2, T0 + 1)))
    assert len(tailer.poll()) == 2
    w0.write_text(_line(_step(0, 7, T0 + 9)))  # replaced by a shorter file
    assert [e["step"] for e in tailer.poll()] == [7]


# --------------------------------------------------------------------------- state


def test_percentile_nearest_rank() -> None:
    assert percentile(range(1, 101), 99) == 99
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 99) is None


def test_state_stall_rate_bandwidth_and_work_at_risk() -> None:
    state = _scenario()
    rs = state.ranks[0]
    assert rs.step == 100
    assert rs.steps_per_s == pytest.approx(2.0)
    snap = rs.stall["snapshot"]
    assert snap.last == pytest.approx(0.100)
    assert snap.mean == pytest.approx(0.0505)  # mean of 1..100 ms
    assert snap.p99 == pytest.approx(0.099)
    assert rs.stall["backpressure"].mean == pytest.approx(0.00002)
    assert rs.stall["backpressure"].p99 == pytest.approx(0.0)
    assert rs.stall_total.mean == pytest.approx(0.0505 + 0.00002)
    assert rs.ckpt_bytes_last == 10_000_000 and rs.ckpts_taken == 10
    assert rs.inflight == 1 and rs.queue_depth == 1 and rs.last_snapshot_step == 100
    assert list(rs.bw_history) == pytest.approx([20.0, 30.0])
    assert rs.bw_last_mbps == pytest.approx(30.0)
    assert rs.mean_bw_mbps == pytest.approx(40 / 1.5)

    assert state.durable(0) == (90, T0 + 48)
    assert state.durable_age(0, now=T0 + 50) == pytest.approx(2.0)
    steps, seconds = state.at_risk(0)
    assert steps == 10 and seconds == pytest.approx(5.0)  # steps 91..100 at 0.5 s each
    assert state.pids() == {"rank0": 1000, "engine0": 2000}

    ov = state.overview(now=T0 + 50)
    assert (ov.step, ov.durable_step, ov.restarts) == (100, 90, 0)
    assert ov.durable_age_s == pytest.approx(2.0)
    assert ov.stall_p99_s == pytest.approx(0.099)
    assert ov.bw_mbps == pytest.approx(30.0)


def test_a_commit_ahead_of_the_step_lines_moves_the_step() -> None:
    state = _scenario()  # step lines up to 100
    state.apply({"type": "write", "t": T0 + 51, "rank": 0, "step": 105, "bytes": 1, "write_s": 0.1})
    state.apply({"type": "commit", "t": T0 + 52, "step": 105, "bytes": 1, "kind": "full", "ranks": 1, "lag_s": 0.1})
    ov = state.overview(now=T0 + 52)
    assert (ov.step, ov.durable_step) == (105, 105)


def test_state_restart_recovery_and_summary() -> None:
    state = _scenario()
    state.apply(
        {"type": "restart", "t": T0 + 60, "rank": 0, "restart_count": 1, "resume_step": 90, "recovery_s": 3.5}
    )
    rs = state.ranks[0]
    assert rs.step == 90 and rs.restarts == 1 and rs.recovery_s == [3.5]
    assert state.at_risk(0) == (0, 0.0)
    for i in range(91, 96):
        state.apply(_step(0, i, T0 + 60 + (i - 90), snapshot=0.0, step_s=1.0))
    steps, seconds = state.at_risk(0)
    assert steps == 5 and seconds == pytest.approx(5.0)  # measured from the restore, not the old run
    assert rs.steps_per_s == pytest.approx(1.0)  # rate window restarted with the new process

    state.apply({"type": "save_error", "t": T0 + 66, "rank": 0, "step": 95, "error": "disk full"})
    summary = state.summary()
    assert summary.steps == 100 and summary.steps_executed == 105
    assert summary.wall_s == pytest.approx(66.0)
    assert summary.step_time_s == pytest.approx(50.0 + 5.0)
    assert summary.stall_s_per_rank == pytest.approx(5.05 + 0.002)
    assert summary.stall_share == pytest.approx(5.052 / 55.0)
    assert summary.stall_by_cause_s["snapshot"] == pytest.approx(5.05)
    assert summary.checkpoints_committed == 1 and summary.bytes_written == 40_000_000
    assert summary.mean_bw_mbps == pytest.approx(40 / 1.5)
    assert summary.commit_lag_mean_s == pytest.approx(2.5)
    assert summary.restarts == 1 and summary.recovery_s == [3.5]
    assert summary.save_errors == 1


def test_state_durable_from_worker_report_and_no_durable() -> None:
    state = MetricsState()
    state.apply(_run(1, t=T0))
    for i in range(1, 5):
        state.apply(_step(1, i, T0 + i, step_s=1.0))
    assert state.durable(1) == (None, None)
    assert state.at_risk(1) == (4, pytest.approx(4.0))  # everything since the run started
    state.apply(_step(1, 5, T0 + 5, step_s=1.0, durable=3))
    assert state.durable(1) == (3, T0 + 5)
    assert state.at_risk(1) == (2, pytest.approx(2.0))


def test_in_memory_step_is_shown_beside_the_durable_one_with_both_risks() -> None:
    """lowdiff+: a worker crash loses the steps since the engine's in-memory step, a machine
    loss those since the durable one; the line, the table and the summary say both."""
    state = MetricsState()
    state.apply(_run(0, t=T0))
    for i in range(1, 11):
        state.apply({**_step(0, i, T0 + i, step_s=1.0, durable=5 if i >= 6 else None),
                     **({"last_memory_step": i - 1} if i > 1 else {})})
    assert state.at_risk(0) == (5, pytest.approx(5.0))
    assert state.at_risk(0, memory=True) == (1, pytest.approx(1.0))
    assert "in memory 9 | durable 5" in log_line(state, now=T0 + 11)
    state.apply({"type": "in_memory", "t": T0 + 12, "rank": 0, "step": 10})
    assert state.summary().last_memory_step == 10
    console = Console(file=io.StringIO(), width=200)
    console.print(render_summary(state.summary()))
    assert "last in-memory step" in console.file.getvalue()


def test_state_counts_malformed_events_without_raising() -> None:
    state = MetricsState()
    state.apply({"type": "step", "t": T0, "rank": 0})  # no step
    state.apply({"type": "write", "t": "soon", "rank": 0})
    state.apply({"type": "mystery", "t": T0})  # unknown types are ignored
    state.apply({"type": "commit", "t": T0, "step": 4, "bytes": 1, "lag_s": 0.5})
    state.apply({"type": "commit", "t": T0 + 1, "step": 4, "bytes": 1, "lag_s": 0.7})  # second engine
    assert state.bad_events == 2
    assert state.commits.checkpoints_committed == 1 and state.commits.committed_t == T0


# --------------------------------------------------------------------------- rendering & host


def test_render_with_simulated_gpu() -> None:
    state = _scenario()
    sampler = HostSampler(nvml_loader=lambda: FakeNvml(count=2), cpu_percent=lambda: 42.0)
    host = sampler.sample({"self": os.getpid(), "gone": 2**22 + 12345})
    assert host.cpu_percent == 42.0
    assert host.rss["self"] is not None and host.rss["self"] > 1_000_000
    assert host.rss["gone"] is None
    assert host.gpus is not None and [g.util_percent for g in host.gpus] == [87.0, 88.0]

    out = _text(render(state, host, now=T0 + 50, wide=True), width=400)
    for expected in (
        "async-overlap",
        "interval=10",
        "keep=3",
        "/ckpts/[exp1]",
        "step 90 (full, 40.0 MB",
        "host CPU 42%",
        "0: 87% mem 30.0/80.0 GB",
        "1: 88% mem",
        "10.0 MB",
        "30.0",
    ):
        assert expected in out, expected
    rows = [line for line in out.splitlines() if line.strip().startswith("0 ")]
    row = next(line for line in rows if "100.0 / 50.5 / 99.0" in line)
    assert "0.0 / 0.0 / 0.0" in row  # sync write cause column
    assert sparkline([20.0, 30.0]) in row
    progress = next(line for line in rows if " 100 " in line)
    assert "10 st / 5.0 s" in progress and "2.00" in progress and "2.0 s" in progress
    assert "GPU n/a" not in out
    sampler.close()


def test_sparkline_scales_to_max() -> None:
    assert sparkline([0, 5, 10]) == "▁▅█"
    assert sparkline([0.0, 0.0]) == "▁▁"
    assert sparkline(range(100), width=4) == sparkline([96, 97, 98, 99]) == "████"


def test_render_without_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    host = HostSampler().sample({})
    assert host.gpus is None and host.gpu_note == "pynvml not installed"
    out = _text(render(_scenario(), host, now=T0 + 50))
    assert out.rstrip().endswith("GPU -")  # no GPU to read: nothing more to say


@pytest.mark.parametrize(
    ("fake", "note"),
    [
        (FakeNvml(fail="nvmlInit"), "NVML unavailable: RuntimeError: nvmlInit exploded"),
        (FakeNvml(fail="nvmlDeviceGetUtilizationRates"), "NVML error: RuntimeError"),
        (FakeNvml(fail="nvmlDeviceGetMemoryInfo"), "NVML error: RuntimeError"),
        (FakeNvml(fail="nvmlDeviceGetCount"), "NVML error: RuntimeError"),
        (FakeNvml(count=0), "no GPU"),
    ],
)
def test_render_when_nvml_fails(fake: FakeNvml, note: str) -> None:
    sampler = HostSampler(nvml_loader=lambda: fake, cpu_percent=lambda: 5.0)
    for _ in range(2):  # failures are stable, never raised
        host = sampler.sample({})
        assert host.gpus is None and host.gpu_note.startswith(note)
    out = _text(render(_scenario(), host, now=T0 + 50))
    # a GPU that NVML found but cannot read says so, in short; no NVML or no GPU: `GPU -`
    assert ("GPU n/a (NVML error)" if note.startswith("NVML error") else "GPU -") in out
    assert "NVMLError" not in out and "exploded" not in out
    assert "host CPU 5%" in out


def test_sampler_survives_broken_cpu_and_loader() -> None:
    def boom() -> float:
        raise OSError("no /proc")

    def bad_loader() -> object:
        raise OSError("driver mismatch")

    host = HostSampler(nvml_loader=bad_loader, cpu_percent=boom).sample({"x": os.getpid()})
    assert host.cpu_percent is None and host.gpus is None and "driver mismatch" in host.gpu_note
    assert "host CPU n/a" in _text(render(MetricsState(), host))


def test_summary_table_shows_totals() -> None:
    out = _text(render_summary(_scenario().summary()))
    for expected in (
        "100 (100 executed)",
        "checkpoints committed",
        "40.0 MB",
        "26.7 MB/s",
        "2.50 / 2.50 s",
        "5.052 s (10.10% of step time)",
        "snapshot 5.050 s, backpressure 0.002 s, sync write 0.000 s",
    ):
        assert expected in out, expected


def test_log_line_format() -> None:
    line = log_line(_scenario(), now=T0 + 50)
    assert line == (
        "step 100 | 2.0 it/s | durable 90 (2.0 s ago) | at risk 10 st / 5.0 s | stall 50.5 ms/step (p99 99.0) "
        "| 30 MB/s | restarts 0"
    )


@pytest.mark.parametrize("width", [80, 120])
def test_compact_view_fits_the_terminal_without_cutting_a_header(width: int) -> None:
    """Made for 80 columns: one table, one line per rank, every header whole; what is left out
    is said in one line; the wide view has every column."""
    state = _scenario()
    state.apply(_run(1))
    state.apply(_step(1, 1, T0 + 1, snapshot=0.001))
    state.apply({"type": "in_memory", "t": T0 + 50, "rank": 0, "step": 99})
    state.apply({"type": "replica_sent", "t": T0 + 50, "rank": 0, "step": 98, "partners": [1], "of": 1})
    host = HostSampler(nvml_loader=lambda: FakeNvml(fail="nvmlInit"), cpu_percent=lambda: 5.0).sample(
        {"rank0": os.getpid(), "engine0": os.getpid()})
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(render(state, host, now=T0 + 50, width=width))
    lines = console.export_text().splitlines()
    assert all(len(ln.rstrip()) <= width for ln in lines), "\n".join(lines)
    assert "…" not in "\n".join(lines)
    header = next(ln for ln in lines if ln.lstrip().startswith("rank"))
    for name in ("step", "durable", "at risk", "stall ms/step"):
        assert name in header, header
    rows = [ln for ln in lines if re.match(r"^\s+[01]\s+\d+\s", ln)]
    assert len(rows) == 2, "\n".join(lines)  # one line per rank
    shown = re.split(r"\s{2,}", header.strip())
    missing = [c for c in ("it/s", "in memory", "replicated", "MB/s", "restarts", "errors") if c not in shown]
    note = [ln for ln in lines if ln.startswith("not shown: ")]
    assert bool(missing) == bool(note)
    if note:
        assert all(c in note[0] for c in missing) and "--dashboard-wide" in note[0]
    assert lines[-1].endswith("GPU -") and "RSS trainers" in lines[-1]
    wide = _text(render(state, host, now=T0 + 50, wide=True), width=400)
    assert "in-flight" in wide and "bandwidth history" in wide and "at risk (machine)" in wide
    assert "replicated" in wide


def test_a_step_counts_as_replicated_once_every_partner_has_it() -> None:
    """--replicas: a rank's replicated step is the newest its engine shipped to every partner of
    the round; a copy that went to fewer (a partner dropped) does not move it."""
    state = MetricsState()
    state.apply(_run(0))
    sent = {"type": "replica_sent", "t": T0 + 1, "rank": 0, "bytes": 10, "seconds": 0.1, "of": 2}
    state.apply({**sent, "step": 4, "partners": [1, 2]})
    state.apply({**sent, "step": 5, "partners": [2]})
    assert state.ranks[0].replicated_step == 4
    assert "replicated" in _text(render_rank_table(state, T0 + 2, None)[0])


# --------------------------------------------------------------------------- driver


def _wait_for(predicate, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


LOG_RE = re.compile(
    r"^ckptrun: (step \d+ \| ([\d.]+|n/a) it/s \| durable (\d+ \([\d.]+ s ago\)|none) \| at risk \d+ st / [\d.]+ s "
    r"\| stall [\d.]+ ms/step \(p99 [\d.]+\) \| (\d+|n/a) MB/s \| restarts \d+"
    r"|rank \d+ restarted .*)$"
)


def _logger(buf: io.StringIO) -> logging.Logger:
    """A logger of ckptrun's form writing to `buf` (the launcher's is `ckptrun`, on stderr)."""
    logger = logging.getLogger(f"ckptrun-test-{id(buf)}")
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("ckptrun: %(message)s"))
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    return logger


def test_non_tty_logs_lines_and_writes_metrics_file(tmp_path: Path) -> None:
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    metrics_file = tmp_path / "out" / "metrics.jsonl"
    buf = io.StringIO()
    console = Console(file=io.StringIO(), width=80)  # not a terminal
    dash = Dashboard(
        metrics_dir, metrics_file, live=None, console=console, poll_interval=0.01, log_interval=0.05,
        logger=_logger(buf)
    )
    assert dash.live is False
    dash.start()
    now = time.time()
    events = [_run(0, t=now)] + [
        _step(0, i, now + 0.01 * i, snapshot=0.001, nbytes=5_000_000 * (i == 3)) for i in range(1, 4)
    ]
    _append(metrics_dir / "worker-0.jsonl", "".join(_line(e) for e in events) + '{"type": "step", "t"')
    assert _wait_for(lambda: "ckptrun: step 3" in buf.getvalue())
    late = [
        {
            "type": "commit",
            "t": now + 0.1,
            "step": 3,
            "bytes": 5_000_000,
            "kind": "full",
            "ranks": 1,
            "lag_s": 0.05,
        },
        {
            "type": "restart",
            "t": now + 0.2,
            "rank": 0,
            "restart_count": 1,
            "resume_step": 3,
            "recovery_s": 1.25,
        },
    ]
    _append(metrics_dir / "engine-0.jsonl", "".join(_line(e) for e in late))
    dash.stop()  # drains the engine file even if the thread never saw it
    dash.stop()  # idempotent

    out = buf.getvalue()
    assert "\x1b" not in out and console.file.getvalue() == ""  # all through logging
    log_part, _, summary = out.partition("ckptrun: summary: ")
    lines = [ln for ln in log_part.splitlines() if ln.strip()]
    assert len(lines) >= 3
    for ln in lines:
        assert LOG_RE.match(ln), ln
    assert "rank 0 restarted (#1), resumed at step 3 in 1.25 s" in log_part
    assert "durable 3" in lines[-1] and "restarts 1" in lines[-1]
    assert "checkpoints committed" in summary and "1.25 s" in summary

    written = [json.loads(ln) for ln in metrics_file.read_text().splitlines()]
    assert all(isinstance(e, dict) for e in written)
    assert written == events + late  # every event once, in order; the partial line not copied


def test_dashboard_errors_are_reported_once_and_never_raise(tmp_path: Path) -> None:
    buf = io.StringIO()
    dash = Dashboard(tmp_path, live=False, console=Console(file=io.StringIO(), width=200), poll_interval=0.01,
                     logger=_logger(buf))

    def broken(event: dict) -> None:
        raise RuntimeError("kaboom")

    dash.state.apply = broken  # type: ignore[method-assign]
    _append(tmp_path / "worker-0.jsonl", _line(_step(0, 1, T0)))
    dash.start()
    assert _wait_for(lambda: dash.errors >= 1)
    _append(tmp_path / "worker-0.jsonl", _line(_step(0, 2, T0 + 1)))
    assert _wait_for(lambda: dash.errors >= 2)  # the thread survived the first error
    dash.stop()
    assert buf.getvalue().count("dashboard error") == 1
    assert "RuntimeError: kaboom" in buf.getvalue()


def test_live_mode_draws_dashboard(tmp_path: Path) -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=140, force_terminal=True, color_system=None)
    sampler = HostSampler(nvml_loader=lambda: FakeNvml(), cpu_percent=lambda: 1.0)
    _append(tmp_path / "worker-0.jsonl", _line(_run(0)) + _line(_step(0, 1, T0, snapshot=0.002)))
    dash = Dashboard(tmp_path, live=True, console=console, poll_interval=0.0, sampler=sampler)
    assert dash._interval >= 0.25  # refresh capped at 4 per second
    dash.start()
    assert _wait_for(lambda: "async-overlap" in buf.getvalue())
    dash.stop()
    out = buf.getvalue()
    assert "0: 87% mem 30.0/80.0 GB" in out and "ckptrun summary" in out


@pytest.mark.parametrize("live", [True, False])
def test_no_summary_before_the_first_step(tmp_path: Path, live: bool) -> None:
    """A run stopped before its first step (no optimizer, a refused flag) ends with its error
    alone: no summary of nothing."""
    buf, log = io.StringIO(), io.StringIO()
    console = Console(file=buf, width=80, force_terminal=live, color_system=None)
    _append(tmp_path / "worker-0.jsonl", _line(_run(0)))
    dash = Dashboard(tmp_path, live=live, console=console, poll_interval=0.01, logger=_logger(log),
                     sampler=HostSampler(nvml_loader=None, cpu_percent=lambda: 1.0))
    dash.start()
    dash.stop()
    assert "summary" not in buf.getvalue() + log.getvalue()


def test_metrics_file_writer_appends_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"type": "old"}\n')
    with MetricsFileWriter(path) as writer:
        writer.write([{"type": "step", "step": 1}, {"type": "note", "text": "line\nbreak"}])
        assert len(path.read_text().splitlines()) == 3  # flushed before close
        writer.write([])
    lines = path.read_text().splitlines()
    assert [json.loads(ln)["type"] for ln in lines] == ["old", "step", "note"]
    assert json.loads(lines[2])["text"] == "line\nbreak"


def test_quiet_keeps_errors_only_and_a_users_handler_gets_the_log() -> None:
    """The launcher logs through the `ckptrun` logger: a handler added to it (a JSON formatter, a
    log shipper) gets each line; --quiet keeps the errors only."""
    from ckptrun.log import configure, log

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.addHandler(handler)
    try:
        log.info("step 1 | durable 1")
        configure(quiet=True)
        log.info("step 2 | durable 2")
        log.warning("rank 0 restarted")
        log.error("save error: rank 0 step 3: ENOSPC")
    finally:
        configure(quiet=False)
        log.removeHandler(handler)
    assert buf.getvalue().splitlines() == ["INFO step 1 | durable 1", "ERROR save error: rank 0 step 3: ENOSPC"]


def test_header_shows_the_host_memory_budget_in_use_summed_over_ranks() -> None:
    state = _scenario()
    assert render_host_memory(state) is None  # no budget reported yet
    for rank, used in ((0, 100_000_000), (1, 50_000_000)):
        state.apply({"type": "host_memory", "t": T0, "rank": rank, "step": 1, "host_memory": 1_000_000_000,
                     "host_memory_used": used, "host_memory_uses": {"slots": used}})
    assert render_host_memory(state).plain == "host memory 150.0 MB of 2.0 GB (slots 150.0 MB)"
    assert render_host_memory(state, wide=False).plain == "host memory 150.0 MB of 2.0 GB"
