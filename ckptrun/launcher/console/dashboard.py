"""The launcher's live view of checkpointing, and its log when there is no live view.

:func:`render` turns :class:`~ckptrun.launcher.console.metrics_state.MetricsState` into a rich
renderable: the compact view, made for 80 columns (one per-rank table fitted to the terminal,
ckptrun/widthfit.py), or the wide one (every column). :class:`Dashboard` runs a background thread
that tails the metrics folder, keeps the state, copies events to ``--metrics-file`` and either
refreshes a rich ``Live`` view (TTY) or logs a progress line every few seconds
(:mod:`~ckptrun.launcher.console.batch_log`: pipes, batch jobs). It must never raise into the
launcher.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ckptrun.launcher.console.batch_log import event_log_line, log_line, summary_line
from ckptrun.launcher.console.fmt import (
    CAUSE_LABELS,
    budget_text,
    fmt_bytes,
    fmt_duration,
    ms,
    num,
    opt,
    risk,
    sparkline,
    stall_cell,
    summary_rows,
)
from ckptrun.launcher.console.hostmetrics import NA, HostSample, HostSampler
from ckptrun.launcher.console.metrics_feed import MetricsFileWriter, MetricsTailer
from ckptrun.launcher.console.metrics_state import MetricsState
from ckptrun.launcher.console.run_figures import RunSummary
from ckptrun.widthfit import Col, fit_table, left_out_line

MAX_REFRESH_PER_S = 4.0
QUIET_LOG_S = 60.0  # a progress line at least this often when nothing moves


# --------------------------------------------------------------------------- rendering


def render_header(state: MetricsState, now: float, *, wide: bool = True) -> RenderableType:
    """Strategy, world, the engines' file writer, restarts; the latest commit; the checkpoint
    dir; the strategy's settings (each on a line of its own, the commit's lag and the total
    written only when `wide`)."""
    line1 = Text.assemble(
        ("ckptrun ", "bold"),
        ("strategy ", "dim"),
        (state.strategy or NA, "bold cyan"),
        ("  world ", "dim"),
        (opt(state.world_size), ""),
        ("  writer ", "dim"),
        (state.io_engine or NA, ""),
        ("  restarts ", "dim"),
        (str(state.restarts), "bold red" if state.restarts else ""),
    )
    commit = state.commits.last_commit
    if commit is None:
        committed = Text.assemble(("committed ", "dim"), ("none yet", "yellow"))
    else:
        age = max(0.0, now - state.commits.committed_t) if state.commits.committed_t is not None else None
        lag = commit.get("lag_s")
        lag_text = f"lag {num(lag, '{:.2f} s') if isinstance(lag, (int, float)) else NA}, " if wide else ""
        committed = Text.assemble(
            ("committed ", "dim"),
            (f"step {state.commits.committed_step}", "bold green"),
            (f" ({commit.get('kind', '?')}, {fmt_bytes(commit.get('bytes'))}, {lag_text}{fmt_duration(age)} ago)", ""),
            ("  checkpoints ", "dim"),
            (str(state.commits.checkpoints_committed), ""),
            *((("  written ", "dim"), (fmt_bytes(state.bytes_written), "")) if wide else ()),
        )
    settings = ", ".join(f"{k}={v}" for k, v in state.settings.items()) or "-"
    budgeted = state.budgeted()
    if budgeted is not None:
        settings += f"  overhead {budget_text(budgeted)}"
    remote = state.commits.remote  # --durable: the newest step there, and how far behind the commits it is
    remote_line = [] if remote is None else [Text.assemble(
        ("remote ", "dim"), (f"step {remote['step']}", "bold green"),
        (f" (durable lag {state.commits.remote_lag()} steps, upload {fmt_bytes(remote.get('bytes'))} in "
         f"{num(remote.get('upload_s'), '{:.1f} s')})", ""))]
    lines = [line1, committed, *remote_line, Text.assemble(("dir ", "dim"), (state.ckpt_dir or NA, "cyan")),
             Text.assemble(("settings ", "dim"), (settings, ""))]
    budget = render_host_memory(state, wide=wide)
    return Group(*lines, *([budget] if budget else []))


def render_host_memory(state: MetricsState, *, wide: bool = True) -> Text | None:
    """--host-memory: what the ranks' staging uses of their budgets, summed over the ranks (and,
    `wide`, by use: slots, a strategy's buffers); None before any rank reported one."""
    reports = [rs.host_memory for rs in state.ranks.values() if rs.host_memory and rs.host_memory.get("host_memory")]
    if not reports:
        return None
    used = sum(int(r.get("host_memory_used") or 0) for r in reports)
    total = sum(int(r["host_memory"]) for r in reports)
    uses: dict[str, int] = {}
    for r in reports:
        for name, nbytes in (r.get("host_memory_uses") or {}).items():
            uses[name] = uses.get(name, 0) + int(nbytes)
    shown = [f"{name} {fmt_bytes(nbytes)}" for name, nbytes in uses.items() if nbytes] if wide else []
    detail = f" ({', '.join(shown)})" if shown else ""
    return Text.assemble(("host memory ", "dim"), (f"{fmt_bytes(used)} of {fmt_bytes(total)}", ""), (detail, ""))


WIDE_HINT = "a wider terminal shows them; every figure in --metrics-file"


def render_progress_table(state: MetricsState, now: float, width: int | None = None) -> list[RenderableType]:
    """Per rank: progress, durability, work at risk (with an in-memory replica: if the worker
    dies, and if the machine does), restarts; fitted to `width` (None: every column)."""
    memory = any(rs.memory_step is not None for rs in state.ranks.values())
    replicas = any(rs.replicated_step is not None for rs in state.ranks.values())
    columns = [Col("rank", key=True, justify="left"), Col("step", key=True), Col("it/s", 4), Col("snapshot", 6),
               *([Col("in memory", 1)] if memory else []), *([Col("replicated", 1)] if replicas else []),
               Col("durable", 1), Col("durable age", 3),
               Col("at risk", 2), *([Col("at risk (machine)", 2)] if memory else []), Col("in-flight", 5),
               Col("queue", 5), Col("restarts", 4), Col("recovery", 4), Col("errors", 2)]
    rows = []
    for r, rs in sorted(state.ranks.items()):
        durable, _ = state.durable(r)
        recovery = ", ".join(f"{s:.1f} s" for s in rs.recovery_s[-3:]) or "-"
        rows.append([
            str(r),
            opt(rs.step),
            num(rs.steps_per_s, "{:.2f}"),
            f"{opt(rs.last_snapshot_step)}/{opt(rs.last_snapshot_done)}",
            *([opt(rs.memory_step)] if memory else []),
            *([opt(rs.replicated_step)] if replicas else []),
            opt(durable),
            fmt_duration(state.durable_age(r, now)) if durable is not None else "-",
            risk(*state.at_risk(r, memory=True)),  # a worker crash loses less than a machine loss
            *([risk(*state.at_risk(r))] if memory else []),
            opt(rs.inflight),
            opt(rs.queue_depth),
            str(rs.restarts),
            recovery,
            Text(str(rs.save_errors), style="bold red" if rs.save_errors else ""),
        ])
    table, left_out = fit_table(columns, rows, width, title="progress & durability", box=box.SIMPLE_HEAD,
                                title_justify="left", expand=False)
    return [table, *([Text(left_out_line(left_out, WIDE_HINT), style="dim")] if left_out else [])]


def render_io_table(state: MetricsState, width: int | None = None) -> list[RenderableType]:
    """Per rank: stall per step by cause (last / mean / p99, ms) and checkpoint I/O; fitted to
    `width` (None: every column)."""
    causes: list[str] = []
    for rs in state.ranks.values():
        causes.extend(c for c in rs.stall_causes if c not in causes)
    columns = [Col("rank", key=True, justify="left"), Col("total stall"),
               *(Col(CAUSE_LABELS.get(c, c), 2) for c in causes), Col("ckpt size", 1), Col("MB/s", 1),
               Col("bandwidth history", 3, justify="left")]
    rows = [[str(r), stall_cell(rs.stall_total), *(stall_cell(rs.stall.get(c)) for c in causes),
             fmt_bytes(rs.ckpt_bytes_last) if rs.ckpt_bytes_last is not None else "-", num(rs.bw_last_mbps),
             Text(sparkline(rs.bw_history), style="green")] for r, rs in sorted(state.ranks.items())]
    table, left_out = fit_table(columns, rows, width, title="stall per step, ms (last / mean / p99) & checkpoint I/O",
                                box=box.SIMPLE_HEAD, title_justify="left", expand=False)
    return [table, *([Text(left_out_line(left_out, WIDE_HINT), style="dim")] if left_out else [])]


def render_host(host: HostSample | None, *, wide: bool = True) -> Text:
    """One line: host CPU, RSS of trainers and engines (each process; not `wide`: the trainers'
    and the engines' sums), GPU utilisation and memory (`GPU -` where there is none to read: no
    GPU, no NVML)."""
    if host is None:
        return Text.assemble(("host ", "dim"), (NA, ""))
    parts = [("host CPU ", "dim"), (num(host.cpu_percent, "{:.0f}%"), "")]
    rss = host.rss if wide else _rss_by_kind(host.rss)
    if rss:
        parts.append(("  RSS ", "dim"))
        parts.append((" · ".join(f"{label} {fmt_bytes(v)}" for label, v in rss.items()), ""))
    parts.append(("  GPU ", "dim"))
    if host.gpus is None:  # a GPU that NVML found but cannot read says so; no GPU, no NVML: nothing to say
        parts.append((f"{NA} (NVML error)", "yellow") if host.gpu_note.startswith("NVML error") else ("-", ""))
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


def _rss_by_kind(rss: dict[str, int | None]) -> dict[str, int | None]:
    """rank0, rank1, engine0, ... -> trainers, engines (the processes still alive)."""
    out: dict[str, int | None] = {}
    for kind, prefix in (("trainers", "rank"), ("engines", "engine")):
        values = [v for label, v in rss.items() if label.startswith(prefix) and v is not None]
        if values:
            out[kind] = sum(values)
    return out or rss


def render_rank_table(state: MetricsState, now: float, width: int | None) -> list[RenderableType]:
    """The compact view, one row per rank, made for 80 columns: progress, durability, work at
    risk, stall, bandwidth, errors; at a narrower width the less important columns are left out,
    said in a line. Every figure is in the JSONL metrics and the wide view (--dashboard-wide)."""
    memory = any(rs.memory_step is not None for rs in state.ranks.values())
    replicas = any(rs.replicated_step is not None for rs in state.ranks.values())
    columns = [Col("rank", key=True, justify="left"), Col("step", key=True), Col("it/s", 3),
               *([Col("in memory", 1)] if memory else []), *([Col("replicated", 3)] if replicas else []),
               Col("durable", 1), Col("at risk", 2),
               Col("stall ms/step", 1), Col("MB/s", 4), Col("restarts", 5), Col("errors", 2)]
    rows = []
    for r, rs in sorted(state.ranks.items()):
        durable, _ = state.durable(r)
        at_risk = risk(*state.at_risk(r, memory=rs.memory_step is not None))
        stall = rs.stall_total.mean if rs.stall_total is not None else None
        rows.append([str(r), opt(rs.step), num(rs.steps_per_s, "{:.2f}"),
                     *([opt(rs.memory_step)] if memory else []),
                     *([opt(rs.replicated_step)] if replicas else []), opt(durable), at_risk,
                     ms(stall) if stall is not None else "-", num(rs.bw_last_mbps, "{:.0f}"), str(rs.restarts),
                     Text(str(rs.save_errors), style="bold red" if rs.save_errors else "")])
    table, left_out = fit_table(columns, rows, width, box=box.SIMPLE_HEAD, expand=False)
    note = left_out_line(left_out, "--dashboard-wide; every figure in --metrics-file")
    return [table, *([Text(note, style="dim")] if note else [])]


def render_errors(state: MetricsState, limit: int = 3) -> RenderableType | None:
    if not state.errors:
        return None
    lines = [
        Text(f"save error: rank {e['rank']} step {e['step']}: {e['error']}", style="red")
        for e in list(state.errors)[-limit:]
    ]
    return Group(*lines)


def render(state: MetricsState, host: HostSample | None, now: float | None = None, *, width: int | None = None,
           wide: bool = False) -> RenderableType:
    """The whole dashboard: header, per-rank table(s), host/GPU line, recent save errors. The
    compact view fits `width` (one table); `wide` shows every column in two tables."""
    now = time.time() if now is None else now
    parts: list[RenderableType] = [render_header(state, now, wide=wide)]
    if state.ranks and wide:
        parts += [*render_progress_table(state, now, width), *render_io_table(state, width)]
    elif state.ranks:
        parts += render_rank_table(state, now, width)
    else:
        parts.append(Text("waiting for workers…", style="dim"))
    parts.append(render_host(host, wide=wide))
    errors = render_errors(state)
    if errors is not None:
        parts.append(errors)
    return Group(*parts)


def render_summary(summary: RunSummary) -> Table:
    """The exit summary table."""
    table = Table(title="ckptrun summary", box=box.SIMPLE_HEAD, title_justify="left", show_header=False)
    table.add_column("metric", style="dim")
    table.add_column("value")
    rows = summary_rows(summary)
    for name, value in rows:
        table.add_row(name, Text(value))
    return table


# --------------------------------------------------------------------------- driver


class Dashboard:
    """Background dashboard driven by the launcher: ``start()`` once, ``stop()`` at exit.

    ``live=True`` draws a rich ``Live`` view on ``console`` (a terminal): the compact view, made
    for 80 columns, or with ``wide`` every column. ``live=False`` logs (``logger``, default the
    ``ckptrun`` logger; :mod:`~ckptrun.launcher.console.batch_log`) a progress line every
    ``log_interval`` seconds, restarts and save errors as they happen. ``None`` picks by
    ``console.is_terminal``. At ``stop()`` the exit summary, when there is something to summarize
    (a step was taken). Errors inside the dashboard are reported once and never propagate.

    ``top`` gives lines to show at the top of the live panel at each refresh (the workers' open
    lines, e.g. a progress bar: :meth:`~ckptrun.launcher.console.worker_logs.WorkerLogTailer.open_lines`).
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
        wide: bool = False,
        logger: logging.Logger | None = None,
    ) -> None:
        self.console = console or Console()
        self.live = self.console.is_terminal if live is None else bool(live)
        self.wide = wide
        self.log = logger or logging.getLogger("ckptrun")
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
        self._logged: tuple | None = None  # what the last progress line said, and when
        self._logged_at = 0.0
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
        if self.has_progress():  # a run stopped before its first step ends with its error alone
            self._guard(self._print_summary)
        if self._writer is not None:
            self._guard(self._writer.close)
        if self._sampler is not None:
            self._guard(self._sampler.close)

    def __enter__(self) -> Dashboard:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def has_progress(self) -> bool:
        """Whether there is something to summarize: a step taken or a checkpoint committed."""
        state = self.state
        return state.commits.checkpoints_committed > 0 or any(rs.step is not None for rs in state.ranks.values())

    # ---- internals

    def _print_summary(self) -> None:
        if self.live:
            self.console.print(render_summary(self.state.summary()))
        else:
            self.log.info(summary_line(self.state.summary()))

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
            said = event_log_line(event)
            if said is not None:
                self.log.log(*said)
        mono = time.monotonic()
        if final or mono >= self._next_log:
            self._next_log = mono + self._log_interval
            self._log_progress(mono)

    def _log_progress(self, mono: float) -> None:
        """The progress line, when the step or the durable step moved since the last one, and at
        least every QUIET_LOG_S seconds otherwise (a job that stalls still says so)."""
        if not any(rs.step is not None for rs in self.state.ranks.values()):
            return
        ov = self.state.overview(time.time())
        moved = (ov.step, ov.durable_step, ov.memory_step, ov.restarts, ov.save_errors) != self._logged
        if moved or mono - self._logged_at >= QUIET_LOG_S:
            self._logged, self._logged_at = (ov.step, ov.durable_step, ov.memory_step, ov.restarts,
                                             ov.save_errors), mono
            self.log.info(log_line(self.state))

    def _sample_host(self) -> None:
        mono = time.monotonic()
        if mono < self._next_host:
            return
        self._next_host = mono + self._host_interval
        if self._sampler is None:
            self._sampler = HostSampler()
        self._host = self._sampler.sample(self.state.pids())

    def _view(self) -> RenderableType:
        panel = render(self.state, self._host, width=self.console.width, wide=self.wide)
        top = self._top() if self._top is not None else ()
        return Group(*top, panel) if top else panel

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
            self.log.error(f"dashboard error (further ones suppressed): {type(exc).__name__}: {exc}")
        except Exception:
            pass
