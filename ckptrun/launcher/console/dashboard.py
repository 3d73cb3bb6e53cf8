"""The launcher's live view of checkpointing, and the log lines and summary when not on a TTY.

:func:`render` turns :class:`~ckptrun.launcher.console.metrics_feed.MetricsState` into a rich renderable.
:class:`Dashboard` runs a background thread that tails the metrics folder, keeps the state,
copies events to ``--metrics-file`` and either refreshes a rich ``Live`` view (TTY) or prints
a compact log line every few seconds (pipes, CI logs). It must never raise into the launcher.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ckptrun.launcher.console.hostmetrics import NA, HostSample, HostSampler
from ckptrun.launcher.console.metrics_feed import MetricsFileWriter, MetricsState, MetricsTailer, RunSummary, Series
from ckptrun.launcher.console.worker_logs import at_line_start

SPARK_CHARS = "▁▂▃▄▅▆▇█"
_CAUSE_LABELS = {"snapshot": "snapshot", "layer_wait": "layer wait", "backpressure": "backpressure",
                 "sync_write": "sync write"}
MAX_REFRESH_PER_S = 4.0


# --------------------------------------------------------------------------- formatting


def sparkline(values: Sequence[float] | Iterable[float], width: int = 16) -> str:
    """Unicode sparkline of the last ``width`` values, scaled from 0 to their max."""
    vals = [max(0.0, float(v)) for v in values][-width:]
    if not vals:
        return ""
    hi = max(vals)
    if hi <= 0:
        return SPARK_CHARS[0] * len(vals)
    top = len(SPARK_CHARS) - 1
    return "".join(SPARK_CHARS[round(v / hi * top)] for v in vals)


def fmt_bytes(n: float | None) -> str:
    """Decimal units (MB = 1e6 bytes), matching the MB/s bandwidth figures."""
    if n is None:
        return NA
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def fmt_duration(s: float | None) -> str:
    if s is None:
        return NA
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _ms(v: float | None) -> str:
    return NA if v is None else f"{v * 1e3:.1f}"


def _num(v: float | None, fmt: str = "{:.1f}") -> str:
    return NA if v is None else fmt.format(v)


def _opt(v: Any) -> str:
    return "-" if v is None else str(v)


def _stall_cell(series: Series | None) -> str:
    if series is None or series.count == 0:
        return "-"
    return f"{_ms(series.last)} / {_ms(series.mean)} / {_ms(series.p99)}"


# --------------------------------------------------------------------------- rendering


def render_header(state: MetricsState, now: float) -> RenderableType:
    """Strategy, its settings, the checkpoint dir, the engines' file writer and the latest commit."""
    line1 = Text.assemble(
        ("ckptrun ", "bold"),
        ("strategy ", "dim"),
        (state.strategy or NA, "bold cyan"),
        ("  dir ", "dim"),
        (state.ckpt_dir or NA, "cyan"),
        ("  world ", "dim"),
        (_opt(state.world_size), ""),
        ("  writer ", "dim"),
        (state.io_engine or NA, ""),
        ("  restarts ", "dim"),
        (str(state.restarts), "bold red" if state.restarts else ""),
    )
    settings = ", ".join(f"{k}={v}" for k, v in state.settings.items()) or "-"
    line2 = Text.assemble(("settings ", "dim"), (settings, ""))
    commit = state.last_commit
    if commit is None:
        line3 = Text.assemble(("committed ", "dim"), ("none yet", "yellow"))
    else:
        age = max(0.0, now - state.committed_t) if state.committed_t is not None else None
        lag = commit.get("lag_s")
        line3 = Text.assemble(
            ("committed ", "dim"),
            (f"step {state.committed_step}", "bold green"),
            (
                f" ({commit.get('kind', '?')}, {fmt_bytes(commit.get('bytes'))}, "
                f"lag {_num(lag, '{:.2f} s') if isinstance(lag, (int, float)) else NA}, "
                f"{fmt_duration(age)} ago)",
                "",
            ),
            ("  checkpoints ", "dim"),
            (str(state.checkpoints_committed), ""),
            ("  written ", "dim"),
            (fmt_bytes(state.bytes_written), ""),
        )
    return Group(line1, line2, line3)


def render_progress_table(state: MetricsState, now: float) -> Table:
    """Per rank: progress, durability, work at risk, restarts."""
    table = Table(title="progress & durability", box=box.SIMPLE_HEAD, title_justify="left", expand=False)
    for name in (
        "rank",
        "step",
        "it/s",
        "snapshot",
        "in memory",
        "durable",
        "durable age",
        "at risk",
        "in-flight",
        "queue",
        "restarts",
        "recovery",
        "errors",
    ):
        table.add_column(name, justify="left" if name == "rank" else "right")
    for r, rs in sorted(state.ranks.items()):
        durable, _ = state.durable(r)
        risk = _risk(*state.at_risk(r))
        if rs.memory_step is not None:  # a worker crash loses less than a machine loss
            risk = f"{_risk(*state.at_risk(r, memory=True))} (machine: {risk})"
        recovery = ", ".join(f"{s:.1f} s" for s in rs.recovery_s[-3:]) or "-"
        table.add_row(
            str(r),
            _opt(rs.step),
            _num(rs.steps_per_s, "{:.2f}"),
            f"{_opt(rs.last_snapshot_step)}/{_opt(rs.last_snapshot_done)}",
            _opt(rs.memory_step),
            _opt(durable),
            fmt_duration(state.durable_age(r, now)) if durable is not None else "-",
            risk,
            _opt(rs.inflight),
            _opt(rs.queue_depth),
            str(rs.restarts),
            recovery,
            Text(str(rs.save_errors), style="bold red" if rs.save_errors else ""),
        )
    return table


def _risk(steps: int | None, seconds: float | None) -> str:
    return "-" if steps is None else f"{steps} st / {fmt_duration(seconds)}"


def render_io_table(state: MetricsState) -> Table:
    """Per rank: stall per step by cause (last / mean / p99, ms) and checkpoint I/O."""
    causes: list[str] = []
    for rs in state.ranks.values():
        causes.extend(c for c in rs.stall_causes if c not in causes)
    table = Table(
        title="stall per step, ms (last / mean / p99) & checkpoint I/O",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        expand=False,
    )
    table.add_column("rank")
    table.add_column("total stall", justify="right")
    for cause in causes:
        table.add_column(_CAUSE_LABELS.get(cause, cause), justify="right")
    for name in ("ckpt size", "MB/s", "bandwidth history"):
        table.add_column(name, justify="right" if name != "bandwidth history" else "left")
    for r, rs in sorted(state.ranks.items()):
        table.add_row(
            str(r),
            _stall_cell(rs.stall_total),
            *(_stall_cell(rs.stall.get(c)) for c in causes),
            fmt_bytes(rs.ckpt_bytes_last) if rs.ckpt_bytes_last is not None else "-",
            _num(rs.bw_last_mbps),
            Text(sparkline(rs.bw_history), style="green"),
        )
    return table


def render_host(host: HostSample | None) -> Text:
    """One line: host CPU, RSS of trainers and engines, GPU utilisation and memory."""
    if host is None:
        return Text.assemble(("host ", "dim"), (NA, ""))
    parts = [("host CPU ", "dim"), (_num(host.cpu_percent, "{:.0f}%"), "")]
    if host.rss:
        parts.append(("  RSS ", "dim"))
        parts.append((" · ".join(f"{label} {fmt_bytes(v)}" for label, v in host.rss.items()), ""))
    parts.append(("  GPU ", "dim"))
    if host.gpus is None:
        parts.append((f"{NA} ({host.gpu_note})" if host.gpu_note else NA, "yellow"))
    else:
        parts.append(
            (
                " · ".join(
                    f"{g.index}: {g.util_percent:.0f}% mem {g.mem_used / 1e9:.1f}/{g.mem_total / 1e9:.1f} GB"
                    for g in host.gpus
                ),
                "",
            )
        )
    return Text.assemble(*parts)


def render_errors(state: MetricsState, limit: int = 3) -> RenderableType | None:
    if not state.errors:
        return None
    lines = [
        Text(f"save error: rank {e['rank']} step {e['step']}: {e['error']}", style="red")
        for e in list(state.errors)[-limit:]
    ]
    return Group(*lines)


def render(state: MetricsState, host: HostSample | None, now: float | None = None) -> RenderableType:
    """The whole dashboard: header, per-rank tables, host/GPU line, recent save errors."""
    now = time.time() if now is None else now
    parts: list[RenderableType] = [render_header(state, now)]
    if state.ranks:
        parts += [render_progress_table(state, now), render_io_table(state)]
    else:
        parts.append(Text("waiting for workers…", style="dim"))
    parts.append(render_host(host))
    errors = render_errors(state)
    if errors is not None:
        parts.append(errors)
    return Group(*parts)


def log_line(state: MetricsState, now: float | None = None) -> str:
    """One plain-text progress line for non-TTY output."""
    now = time.time() if now is None else now
    ov = state.overview(now)
    if ov.durable_step is None:
        durable = "durable none"
    else:
        durable = f"durable {ov.durable_step} ({fmt_duration(ov.durable_age_s)} ago)"
    if ov.memory_step is not None:
        durable = f"in memory {ov.memory_step} | {durable}"
    parts = [
        f"[ckptrun] step {_opt(ov.step)}",
        f"{_num(ov.steps_per_s)} it/s",
        f"stall {_ms(ov.stall_mean_s)} ms/step (p99 {_ms(ov.stall_p99_s)})",
        durable,
        f"{_num(ov.bw_mbps, '{:.0f}')} MB/s",
        f"restarts {ov.restarts}",
    ]
    if ov.save_errors:
        parts.append(f"save errors {ov.save_errors}")
    return " | ".join(parts)


def event_log_line(event: dict[str, Any]) -> str | None:
    """A line for an event worth reporting on its own in non-TTY mode (restarts, save errors)."""
    kind = event.get("type")
    if kind == "restart":
        return (
            f"[ckptrun] rank {event.get('rank')} restarted (#{event.get('restart_count')}), "
            f"resumed at step {event.get('resume_step')} in {_num(event.get('recovery_s'), '{:.2f}')} s"
        )
    if kind == "save_error":
        return (
            f"[ckptrun] save error: rank {event.get('rank')} step {event.get('step')}: {event.get('error')}"
        )
    return None


def render_summary(summary: RunSummary) -> Table:
    """The exit summary table."""
    table = Table(title="ckptrun summary", box=box.SIMPLE_HEAD, title_justify="left", show_header=False)
    table.add_column("metric", style="dim")
    table.add_column("value")
    share = f" ({summary.stall_share * 100:.2f}% of step time)" if summary.stall_share is not None else ""
    causes = ", ".join(f"{_CAUSE_LABELS.get(c, c)} {v:.3f} s" for c, v in summary.stall_by_cause_s.items())
    recoveries = ", ".join(f"{s:.2f} s" for s in summary.recovery_s) or "-"
    rows = [
        ("steps", f"{_opt(summary.steps)} ({summary.steps_executed} executed)"),
        ("wall time", fmt_duration(summary.wall_s)),
        ("stall (per rank)", f"{summary.stall_s_per_rank:.3f} s{share}"),
        ("stall by cause", causes or "-"),
        ("checkpoints committed", str(summary.checkpoints_committed)),
        ("last durable step", _opt(summary.last_durable_step)),
        *([("last in-memory step", _opt(summary.last_memory_step))] if summary.last_memory_step is not None else []),
        ("bytes written", fmt_bytes(summary.bytes_written)),
        ("mean write bandwidth", f"{_num(summary.mean_bw_mbps)} MB/s"),
        (
            "commit lag mean / max",
            f"{_num(summary.commit_lag_mean_s, '{:.2f}')} / {_num(summary.commit_lag_max_s, '{:.2f}')} s",
        ),
        ("restarts", str(summary.restarts)),
        ("recovery times", recoveries),
        ("save errors", str(summary.save_errors)),
    ]
    for name, value in rows:
        table.add_row(name, Text(value))
    return table


# --------------------------------------------------------------------------- driver


class Dashboard:
    """Background dashboard driven by the launcher: ``start()`` once, ``stop()`` at exit.

    ``live=True`` draws a rich ``Live`` view (use when stdout is a TTY); ``live=False`` prints
    one plain log line every ``log_interval`` seconds plus restarts and save errors as they
    happen; ``None`` picks by ``console.is_terminal``. Errors inside the dashboard are reported
    once on the console and never propagate.

    ``top`` gives lines to show at the top of the live panel at each refresh (the workers' open
    lines, e.g. a progress bar: :meth:`~ckptrun.launcher.console.worker_logs.WorkerLogTailer.open_lines`). Off a
    terminal, the workers share the console's output; each line of ours starts on a new line
    unless the output is known to be at a line start (:func:`~ckptrun.launcher.console.worker_logs.at_line_start`).
    """

    def __init__(
        self,
        metrics_dir: str | os.PathLike[str],
        metrics_file: str | os.PathLike[str] | None = None,
        live: bool | None = None,
        console: Console | None = None,
        *,
        poll_interval: float = 0.25,
        log_interval: float = 5.0,
        host_interval: float = 1.0,
        sampler: HostSampler | None = None,
        top: Callable[[], Sequence[RenderableType]] | None = None,
    ) -> None:
        self.console = console or Console()
        self.live = self.console.is_terminal if live is None else bool(live)
        self.state = MetricsState()
        self.tailer = MetricsTailer(metrics_dir)
        self.errors = 0
        self._metrics_file = metrics_file
        self._writer: MetricsFileWriter | None = None
        # Live refreshes happen on our poll, so the poll interval caps the refresh rate.
        self._interval = (
            max(poll_interval, 1.0 / MAX_REFRESH_PER_S) if self.live else max(poll_interval, 0.01)
        )
        self._log_interval = log_interval
        self._host_interval = host_interval
        self._sampler = sampler
        self._top = top
        self._host: HostSample | None = None
        self._next_host = 0.0
        self._next_log = 0.0
        self._live: Live | None = None
        self._thread: threading.Thread | None = None
        self._stop_evt = threading.Event()
        self._started = False
        self._stopped = False
        self._error_reported = False

    # ---- public API

    def start(self) -> None:
        """Open the metrics file, start the Live view (if any) and the polling thread."""
        if self._started:
            return
        self._started = True
        self._guard(self._open_writer)
        if self.live:

            def start_live() -> None:
                self._live = Live(
                    self._view(),
                    console=self.console,
                    auto_refresh=False,
                    refresh_per_second=MAX_REFRESH_PER_S,
                )
                self._live.start()

            self._guard(start_live)
        self._next_log = time.monotonic() + self._log_interval
        try:
            self._thread = threading.Thread(target=self._run, name="ckptrun-dashboard", daemon=True)
            self._thread.start()
        except Exception as exc:
            self._report(exc)

    def stop(self) -> None:
        """Drain the remaining events, stop the thread and print the exit summary (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_evt.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)
        if thread is None or not thread.is_alive():
            if self._writer is None and not self._started:
                self._guard(self._open_writer)
            self._guard(lambda: self._tick(final=True))
        if self._live is not None:
            self._guard(self._live.stop)
            self._live = None
        self._guard(self._fresh_line)
        self._guard(lambda: self.console.print(render_summary(self.state.summary())))
        if self._writer is not None:
            self._guard(self._writer.close)
        if self._sampler is not None:
            self._guard(self._sampler.close)

    def __enter__(self) -> Dashboard:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- internals

    def _open_writer(self) -> None:
        if self._metrics_file is not None and self._writer is None:
            self._writer = MetricsFileWriter(self._metrics_file)

    def _run(self) -> None:
        while not self._stop_evt.is_set():
            self._guard(self._tick)
            self._stop_evt.wait(self._interval)

    def _tick(self, final: bool = False) -> None:
        events = self.tailer.poll()
        for event in events:
            self.state.apply(event)
        if self._writer is not None and events:
            try:
                self._writer.write(events)
            except Exception:
                self._writer = None  # stop copying, keep the dashboard
                raise
        if self.live:
            if self._live is not None:
                self._sample_host()
                self._live.update(self._view(), refresh=True)
            return
        for event in events:
            line = event_log_line(event)
            if line is not None:
                self._print_line(line)
        mono = time.monotonic()
        if final or mono >= self._next_log:
            self._next_log = mono + self._log_interval
            if any(rs.step is not None for rs in self.state.ranks.values()):
                self._print_line(log_line(self.state))

    def _sample_host(self) -> None:
        mono = time.monotonic()
        if mono < self._next_host:
            return
        self._next_host = mono + self._host_interval
        if self._sampler is None:
            self._sampler = HostSampler()
        self._host = self._sampler.sample(self.state.pids())

    def _view(self) -> RenderableType:
        panel = render(self.state, self._host)
        top = self._top() if self._top is not None else ()
        return Group(*top, panel) if top else panel

    def _fresh_line(self) -> None:
        """Off a terminal a worker may have left its line open (a progress bar without its newline):
        end it first, unless the output is known to be at a line start (a regular file ending in a
        newline). A pipe or a terminal cannot be read back, so a line of ours may follow an empty one."""
        if not self.live and not at_line_start(self.console.file):
            self.console.line()

    def _print_line(self, line: str) -> None:
        self._fresh_line()
        self.console.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)

    def _guard(self, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:
            self._report(exc)

    def _report(self, exc: BaseException) -> None:
        self.errors += 1
        if self._error_reported:
            return
        self._error_reported = True
        try:
            self._print_line(
                f"[ckptrun] dashboard error (further ones suppressed): {type(exc).__name__}: {exc}"
            )
        except Exception:
            pass
