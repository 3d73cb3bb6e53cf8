"""The bench's outputs: a table on the terminal, the JSON document, the PNG bar chart."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from rich.console import Console, RenderableType
from rich.text import Text

from ..errors import CkptrunError
from ..widthfit import Col, fit_table, left_out_line
from ..widthfit import print_tables as print_tables  # (the bench's drivers print through this module)
from .budget import Calibration
from .plan import BASELINE, every_label
from .stats import interval_model

SCHEMA = "ckptrun-bench/1"


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _spread(row: dict[str, Any], key: str, fmt: str, scale: float = 1.0) -> str:
    """min-max over the repetitions"""
    lo, hi = row["min"][key], row["max"][key]
    return "-" if lo is None else f"{lo * scale:{fmt}}-{hi * scale:{fmt}}"


def _mid(row: dict[str, Any], key: str, fmt: str, scale: float = 1.0) -> str:
    return _num(None if row[key] is None else row[key] * scale, fmt)


# (column, how soon it is left out at a narrow width, the row's key, format, scale); medians
FIGURE_COLUMNS = (("step ms", 0, "median_step_s", ".1f", 1e3), ("overhead", 0, "overhead_ratio", ".2f", 1.0),
                  ("stall ms/step", 1, "stall_ms_per_step", ".1f", 1.0),
                  ("of it layer wait", 8, "layer_wait_ms_per_step", ".1f", 1.0),
                  ("fwd+bwd ms", 8, "compute_s", ".1f", 1e3), ("fwd+bwd ratio", 2, "compute_ratio", ".2f", 1.0),
                  ("trainer CPU ms", 3, "trainer_cpu_ms_per_step", ".1f", 1.0),
                  ("engine CPU ms", 3, "engine_cpu_ms_per_step", ".1f", 1.0),
                  ("launcher CPU ms", 10, "launcher_cpu_ms_per_step", ".1f", 1.0),
                  ("MB/step", 3, "bytes_per_step", ".1f", 1e-6),
                  ("MB shipped/step", 4, "shipped_per_step", ".3f", 1e-6),
                  ("write MB/s", 4, "write_MBps", ".0f", 1.0),
                  ("effective MB/s", 7, "effective_MBps", ".0f", 1.0), ("memory MB", 5, "peak_MB", ".0f", 1.0),
                  ("staging MB", 9, "staging_MB", ".0f", 1.0), ("page cache MB", 10, "page_cache_MB", ".0f", 1.0),
                  ("commits", 6, "committed", ".0f", 1.0), ("recovery s", 2, "recovery_s", ".2f", 1.0),
                  ("of it restart s", 11, "setup_s", ".2f", 1.0), ("of it restore s", 11, "restore_s", ".2f", 1.0))
ONLY_WHEN_SET = ("shipped_per_step",)  # a column shown only where some row has the figure
# the figures whose spread over the repetitions the second table shows
RANGED = ("step ms", "overhead", "stall ms/step", "fwd+bwd ratio", "MB/step", "write MB/s", "recovery s")
RATIO_COLUMNS = ("overhead", "fwd+bwd ratio")  # shown with an x
HINT = "--wide shows them, --json FILE keeps every run's figures"


def tables(rows: list[dict[str, Any]], title: str, width: int | None) -> list[RenderableType]:
    """The medians (the configuration never cut; at a narrow `width` (None: any) the less
    important columns left out, said in a line), then each figure's min-max over the repetitions
    in a second table, then a line per failed configuration."""
    # `against` goes first at a narrow width, unless a row's ratio is not against `none` (a
    # `+durable` twin, a strategy that changes training): then the ratio means nothing without it.
    against = 12 if all(r["against"] in (None, BASELINE) for r in rows) else 0
    shown = [c for c in FIGURE_COLUMNS if c[2] not in ONLY_WHEN_SET or any(r.get(c[2]) is not None for r in rows)]
    columns = (Col("configuration", key=True, justify="left"), Col("every", 12), Col("writer", 12, justify="left"),
               *(Col(h, d) for h, d, *_ in shown[:2]), Col("against", against, justify="left"),
               *(Col(h, d) for h, d, *_ in shown[2:]))
    cells, ranges, failed = [], [], []
    for r in rows:
        if r["repetitions"] == 0:
            failed.append(f"{r['name']} failed: {r['errors'][0].splitlines()[0]}")
            cells.append([r["name"], every_cell(r), "-", "failed", *["-"] * (len(columns) - 4)])
            continue
        figs = {h: _mid(r, key, fmt, scale) + ("x" if h in RATIO_COLUMNS and r[key] is not None else "")
                for h, _, key, fmt, scale in shown}
        cells.append([r["name"], every_cell(r), ",".join(r["io_engines"]) or "-", figs["step ms"],
                      figs["overhead"], r["against"] or "-", *(figs[h] for h, *_ in shown[2:])])
        ranges.append([r["name"], *(_spread(r, key, fmt, scale) for h, _, key, fmt, scale in shown
                                    if h in RANGED)])
    main, left_out = fit_table(columns, cells, width, title=title, title_justify="left")
    out: list[RenderableType] = [main]
    if left_out:
        out.append(Text(left_out_line(left_out, HINT)))
    if any(r["repetitions"] > 1 for r in rows):
        n = max(r["repetitions"] for r in rows)
        spread, gone = fit_table((Col("configuration", key=True, justify="left"),
                                  *(Col(h, i) for i, h in enumerate(RANGED))), ranges, width,
                                 title=f"min-max over the {n} repetitions", title_justify="left")
        out += [spread, *([Text(left_out_line(gone, HINT))] if gone else [])]
    out += [Text(line, style="red") for line in failed]
    return out


def every_cell(row: dict[str, Any]) -> str:
    """A row's interval: `-` for a baseline, `auto` for a strategy at its defaults."""
    return "-" if row["kind"] == "baseline" else every_label(row["every"])


# The stall's causes as the budget table names them, and the legend under it.
CAUSES = {"snapshot": "snap", "backpressure": "bp", "setup": "setup", "sync_write": "write", "layer_wait": "layer",
          "save": "save"}
CAUSES_LEGEND = ("snap: waiting for a snapshot, bp: back-pressure, setup: the staging slots' set-up (made, "
                 "faulted in, page-locked), write: a synchronous write, layer: a layer's copy, save: the script's "
                 "own save")
OVER = "*"
NOTHING = "none"  # the disk cell of a configuration none of whose steps reached the disk in the run


def _causes_cell(causes: dict[str, float] | None) -> str:
    """`snap 12 bp 3.1`: the causes with any stall, the largest first, in ms per step."""
    if not causes:
        return "-"
    shown = sorted(((ms, c) for c, ms in causes.items() if ms >= 0.05), reverse=True)
    return " ".join(f"{CAUSES.get(c, c)} {ms:.0f}" if ms >= 10 else f"{CAUSES.get(c, c)} {ms:.1f}"
                    for ms, c in shown) or "0"


def _fresh_cell(row: dict[str, Any], tier: str) -> str:
    med, top = row[f"fresh_{tier}_median"], row[f"fresh_{tier}_max"]
    if tier == "disk" and row["nothing_on_disk"]:
        return NOTHING
    return "-" if med is None else f"{med:g}/{top:g}"


def _waste_cell(row: dict[str, Any], mtbf: str) -> str:
    w = row["predicted_waste"][mtbf]
    mark = "~" if interval_model(row) else ">" if row["nothing_on_disk"] else ""
    return "-" if w is None else f"{mark}{100 * w:.1f}%"


def _own_cell(row: dict[str, Any]) -> str:
    own, of = row["own_overhead"], row["own_budget"]
    return "-" if own is None else f"{own:.1%}" + ("" if of is None else f" of {of:.0%}")


def budget_tables(rows: list[dict[str, Any]], budget: float | None, calibration: Calibration | None,
                  width: int | None) -> list[RenderableType]:
    """The second table: against the overhead budget, per configuration: what the run said of its
    own overhead, the stall by cause, the freshness in memory and on disk, the predicted waste;
    a configuration whose run said it cannot keep within the budget marked OVER; then what each
    column means and how the references' intervals were chosen."""
    mtbfs = list(rows[0]["predicted_waste"]) if rows else []
    columns = (Col("configuration", key=True, justify="left"), Col("every", 3), Col("run says", 2),
               Col("stall by cause", 1, justify="left"), Col("memory"), Col("disk"),
               *(Col(f"waste {m}" if len(mtbfs) > 1 else "waste") for m in mtbfs))
    cells = [[r["name"] + (OVER if r["over_budget"] else ""), every_cell(r), _own_cell(r),
              _causes_cell(r["stall_by_cause"]), _fresh_cell(r, "memory"), _fresh_cell(r, "disk"),
              *(_waste_cell(r, m) for m in mtbfs)]
             for r in rows if r["repetitions"]]
    against = "without an overhead budget" if budget is None else f"against the {budget:.0%} overhead budget"
    title = f"{against}: freshness, predicted waste at MTBF {', '.join(mtbfs)}"
    table, left_out = fit_table(columns, cells, width, title=title, title_justify="left")
    lines = [f"run says: the overhead the run measured itself, of its budget; stall by cause in ms per step ("
             f"{CAUSES_LEGEND}); memory, disk: steps from each timed step back to the newest step in host memory, "
             "on disk (median/max); waste: the expected share of time lost, overhead plus each failure's lost "
             "work and recovery over the MTBF"]
    if any(r["over_budget"] for r in rows):
        lines.append(f"{OVER} the run said its strategy cannot keep within the budget")
    if any(r["nothing_on_disk"] for r in rows if r["repetitions"]):
        lines.append(f"{NOTHING}: no step reached the disk by the end of the run (an interval longer than the "
                     "run): its waste counts only the steps run (>), a longer --steps measures it; a reference's "
                     "(~) is predicted from its interval N, (N-1)/2 steps plus its saves' lag in calibration")
    if calibration is not None:
        lines.append(calibration.note())
    if left_out:
        lines.append(left_out_line(left_out, HINT))
    return [table, *(Text(line) for line in lines)]


def report_width(console: Console, wide: bool) -> int | None:
    """The width a bench table may take: the console's; piped or logged, at least 200 columns
    rather than 80; any with --wide."""
    if wide:
        return None
    return console.width if console.is_terminal else max(console.width, 200)


def document(settings: dict[str, Any], machine: dict[str, Any], rows: list[dict[str, Any]],
             command: str, wall_s: float) -> dict[str, Any]:
    return {"schema": SCHEMA, "command": command, "wall_s": wall_s, "settings": settings, "machine": machine,
            "configurations": rows}


def write_json(doc: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n")


def require_matplotlib() -> None:
    """Fail before any run when --plot cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CkptrunError("--plot needs matplotlib: pip install 'ckptrun[plot]'", exit_code=2) from None


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    """Two bar charts: overhead ratio (min-max whiskers) and stall per step, per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["repetitions"]]
    names = [r["name"] for r in rows]
    width = max(6.0, 0.8 * len(rows) + 2)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(width, 7), sharex=True)
    ratio = [r["overhead_ratio"] or 0.0 for r in rows]
    err = [[max(0.0, m - (r["min"]["overhead_ratio"] or m)) for m, r in zip(ratio, rows, strict=True)],
           [max(0.0, (r["max"]["overhead_ratio"] or m) - m) for m, r in zip(ratio, rows, strict=True)]]
    colors = ["0.6" if r["kind"] == "baseline" else "tab:orange" if r["kind"] == "reference" else "tab:blue"
              for r in rows]
    ax1.bar(names, ratio, yerr=err, capsize=3, color=colors)
    ax1.axhline(1.0, color="0.3", linewidth=0.8)
    ax1.set_ylabel("step time / none")
    ax1.set_title(textwrap.fill(title, int(width * 13)), fontsize=8)
    ax2.bar(names, [r["stall_ms_per_step"] or 0.0 for r in rows], color=colors)
    ax2.set_ylabel("stall ms / step")
    ax2.tick_params(axis="x", labelrotation=45)
    for label in ax2.get_xticklabels():
        label.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
