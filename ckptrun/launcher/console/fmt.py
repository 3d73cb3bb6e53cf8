"""Formatting shared by the dashboard and the batch log lines: sizes, durations, sparklines,
the exit summary's rows."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ckptrun.launcher.console.hostmetrics import NA
from ckptrun.launcher.console.overhead import Budgeted
from ckptrun.launcher.console.run_figures import RunSummary
from ckptrun.launcher.console.series import Series

SPARK_CHARS = "▁▂▃▄▅▆▇█"
CAUSE_LABELS = {"snapshot": "snapshot", "layer_wait": "layer wait", "backpressure": "backpressure",
                 "setup": "slot set-up", "sync_write": "sync write"}


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


def ms(v: float | None) -> str:
    return NA if v is None else f"{v * 1e3:.1f}"


def num(v: float | None, fmt: str = "{:.1f}") -> str:
    return NA if v is None else fmt.format(v)


def opt(v: Any) -> str:
    return "-" if v is None else str(v)


def stall_cell(series: Series | None) -> str:
    if series is None or series.count == 0:
        return "-"
    return f"{ms(series.last)} / {ms(series.mean)} / {ms(series.p99)}"


def risk(steps: int | None, seconds: float | None) -> str:
    return "-" if steps is None else f"{steps} st / {fmt_duration(seconds)}"



def summary_rows(summary: RunSummary) -> list[tuple[str, str]]:
    """The exit summary, (what, value) in order."""
    share = f" ({summary.stall_share * 100:.2f}% of step time)" if summary.stall_share is not None else ""
    causes = ", ".join(f"{CAUSE_LABELS.get(c, c)} {v:.3f} s" for c, v in summary.stall_by_cause_s.items())
    recoveries = ", ".join(f"{s:.2f} s" for s in summary.recovery_s) or "-"
    rows = [
        ("steps", f"{opt(summary.steps)} ({summary.steps_executed} executed)"),
        ("wall time", fmt_duration(summary.wall_s)),
        ("stall (per rank)", f"{summary.stall_s_per_rank:.3f} s{share}"),
        ("stall by cause", causes or "-"),
        ("checkpoints committed", str(summary.checkpoints_committed)),
        ("last durable step", opt(summary.last_durable_step)),
        *([("last in-memory step", opt(summary.last_memory_step))] if summary.last_memory_step is not None else []),
        ("bytes written", fmt_bytes(summary.bytes_written)),
        ("mean write bandwidth", f"{num(summary.mean_bw_mbps)} MB/s"),
        (
            "commit lag mean / max",
            f"{num(summary.commit_lag_mean_s, '{:.2f}')} / {num(summary.commit_lag_max_s, '{:.2f}')} s",
        ),
        ("restarts", str(summary.restarts)),
        ("recovery times", recoveries),
        ("save errors", str(summary.save_errors)),
    ]
    if summary.overhead is not None:
        rows.insert(4, ("overhead", budget_text(summary.overhead)))
    return rows


def budget_text(b: Budgeted) -> str:
    """`2.8% of 5%`: what checkpointing costs the loop against --max-overhead."""
    skipped = f", {b.skipped} skipped: disk behind" if b.skipped else ""
    over = " (over: see the warning)" if b.over else ""
    return f"{max(0.0, b.overhead):.1%} of {b.budget * 100:g}%{skipped}{over}"
