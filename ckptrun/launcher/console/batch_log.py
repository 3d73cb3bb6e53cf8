"""The run's log when there is no live panel (`--no-dashboard`, a pipe, a batch job): through
the standard `logging` module, logger ``ckptrun``, so that a user's handlers, formatters and log
shippers get it. INFO: a progress line every `--log-interval` seconds and the exit summary;
WARNING: a restart; ERROR: a save error (`--quiet` keeps the errors only). The JSONL metrics
file (`--metrics-file`) stays the machine-readable record."""

from __future__ import annotations

import logging
import time
from typing import Any

from ckptrun.launcher.console.fmt import budget_text, fmt_duration, ms, num, opt, risk, summary_rows
from ckptrun.launcher.console.metrics_state import MetricsState
from ckptrun.launcher.console.run_figures import RunSummary


def log_line(state: MetricsState, now: float | None = None) -> str:
    """One progress line: step, durable step, work at risk, stall, bandwidth (the slowest or
    worst rank's)."""
    now = time.time() if now is None else now
    ov = state.overview(now)
    if ov.durable_step is None:
        durable = "durable none"
    else:
        durable = f"durable {ov.durable_step} ({fmt_duration(ov.durable_age_s)} ago)"
    if ov.memory_step is not None:
        durable = f"in memory {ov.memory_step} | {durable}"
    parts = [f"step {opt(ov.step)}", f"{num(ov.steps_per_s)} it/s", durable]
    at_risk = _worst_risk(state)
    if at_risk is not None:
        parts.append(f"at risk {at_risk}")
    if ov.overhead is not None:
        parts.append(f"overhead {budget_text(ov.overhead)}")
    parts += [f"stall {ms(ov.stall_mean_s)} ms/step (p99 {ms(ov.stall_p99_s)})",
              f"{num(ov.bw_mbps, '{:.0f}')} MB/s", f"restarts {ov.restarts}"]
    if ov.save_errors:
        parts.append(f"save errors {ov.save_errors}")
    return " | ".join(parts)


def _worst_risk(state: MetricsState) -> str | None:
    """The most work one failure loses now, over the ranks (a machine loss)."""
    risks = [state.at_risk(r) for r, rs in state.ranks.items() if rs.step is not None]
    risks = [(s, t) for s, t in risks if s is not None]
    return risk(*max(risks, key=lambda x: x[0])) if risks else None


def event_log_line(event: dict[str, Any]) -> tuple[int, str] | None:
    """(level, line) for an event worth reporting on its own: a restart, a save error."""
    kind = event.get("type")
    if kind == "restart":
        return logging.WARNING, (
            f"rank {event.get('rank')} restarted (#{event.get('restart_count')}), "
            f"resumed at step {event.get('resume_step')} in {num(event.get('recovery_s'), '{:.2f}')} s"
        )
    if kind == "save_error":
        return logging.ERROR, f"save error: rank {event.get('rank')} step {event.get('step')}: {event.get('error')}"
    return None


def summary_line(summary: RunSummary) -> str:
    """The exit summary in one line."""
    return "summary: " + " | ".join(f"{name} {value}" for name, value in summary_rows(summary))
