"""`ckptrun ls`'s view of differential chains (lowdiff, lowdiff+), where a record per few steps
made one row each: a run of diff records on one base is one row, and a line per run of
restorable steps says which full checkpoints they restore from and what restoring the newest
of them takes. No restore time is recorded anywhere to estimate one from honestly (it is the
read plus one optimizer update per replayed step, both machine-dependent): the line gives the
bytes read and the steps replayed instead. `ls --wide` and `--json` list every record."""

from __future__ import annotations

import textwrap

from ..storage.schema import Manifest
from .recovery import plans_of, runs_of

MOST_FULLS = 6  # full checkpoints named one by one in a line; more are abbreviated


def group_diffs(rows: list[dict]) -> list[dict]:
    """`ls`'s rows (oldest first) with each run of consecutive diff records on one base, alike
    in ranks, layout and tiers, as one row where it starts: its steps first-last, `record` "N
    records", the bytes summed, `depends_on` the base. Other rows are unchanged. (A newer full
    checkpoint may sit between two records of a run: lowdiff writes the diff of its step too.)"""
    out: list[dict] = []
    open_runs: dict[str, int] = {}  # base -> the index in `out` of its newest run's row
    for r in rows:
        if r["kind"] != "diff":
            out.append(r)
            continue
        base = r["depends_on"][0]
        at = open_runs.get(base)
        if at is not None and _continues(out[at], r):
            out[at] = _joined(out[at], r)
        else:
            open_runs[base] = len(out)
            out.append({**r, "depends_on": [base], "records": 1})
    return out


def _continues(row: dict, r: dict) -> bool:
    return r["first_step"] == row["step"] + 1 and all(row.get(k) == r.get(k) for k in ("ranks", "layout", "tiers"))


def _joined(row: dict, r: dict) -> dict:
    n = row["records"] + 1
    sizes = [a + b for a, b in zip(row["rank_bytes"], r["rank_bytes"], strict=True)] \
        if row["rank_bytes"] and r["rank_bytes"] and len(row["rank_bytes"]) == len(r["rank_bytes"]) else None
    return {**row, "step": r["step"], "record": f"{n} records", "records": n, "bytes": row["bytes"] + r["bytes"],
            "rank_bytes": sizes}


def restorable_lines(ms: list[Manifest], width: int) -> list[str]:
    """One line per run of restorable steps of the committed records `ms`, where a diff record
    is among them (else none: a listing of full checkpoints says it all), wrapped at `width`:
    `0-60 restorable: full at 0, 29; 59 diffs; newest reads 19 MB, replays 31 steps` (the
    newest: a restore of the last of those steps, every rank's part)."""
    if not any(m.kind == "diff" for m in ms):
        return []
    plans = plans_of(ms)
    lines = []
    for first, last in runs_of(list(plans)):
        fulls = [s for s in range(first, last + 1) if not plans[s].diffs]
        diffs = last - first + 1 - len(fulls)
        newest = plans[last]
        steps = str(first) if first == last else f"{first}-{last}"
        text = f"{steps} restorable: full at {_steps_text(fulls)}; {_count(diffs, 'diff')}; " \
               f"newest reads {_megabytes(sum(m.bytes for m in newest.records))}"
        if newest.diffs:
            text += f", replays {_count(last - newest.base.step, 'step')}"
        lines += textwrap.wrap(text, max(width, 40), subsequent_indent="  ")
    return lines


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _megabytes(n: int) -> str:
    mb = n / 1e6
    return f"{mb:,.0f} MB" if mb >= 10 else f"{mb:.1f} MB"


def _steps_text(steps: list[int]) -> str:
    if len(steps) <= MOST_FULLS:
        return ", ".join(map(str, steps))
    return f"{steps[0]}, {steps[1]}, ..., {steps[-1]} ({len(steps)} in all)"
