"""The bench's outputs: a table on the terminal, the JSON document, the PNG bar chart."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..errors import CkptrunError

SCHEMA = "ckptrun-bench/1"


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _spread(row: dict[str, Any], key: str, fmt: str, scale: float = 1.0) -> str:
    """median [min-max]"""
    mid, lo, hi = row[key], row["min"][key], row["max"][key]
    if mid is None:
        return "-"
    text = format(mid * scale, fmt)
    return text if lo == hi else f"{text} [{lo * scale:{fmt}}-{hi * scale:{fmt}}]"


def table(rows: list[dict[str, Any]], title: str) -> Table:
    columns = ("configuration", "every", "writer", "step ms", "overhead", "against", "stall ms/step",
               "of it layer wait", "MB/step", "write MB/s", "effective MB/s", "memory MB", "staging MB",
               "page cache MB", "commits", "recovery s", "of it restart s", "of it restore s")
    t = Table(*columns, title=title, title_justify="left")
    for r in rows:
        if r["repetitions"] == 0:
            t.add_row(r["name"], _num(r["every"], "d"), "-", f"failed: {r['errors'][0].splitlines()[0][:60]}",
                      *["-"] * (len(columns) - 4))
            continue
        t.add_row(r["name"], _num(r["every"], "d"), ",".join(r["io_engines"]) or "-",
                  _spread(r, "median_step_s", ".1f", 1e3),
                  _spread(r, "overhead_ratio", ".2f") + ("x" if r["overhead_ratio"] is not None else ""),
                  r["against"] or "-",
                  _spread(r, "stall_ms_per_step", ".1f"), _spread(r, "layer_wait_ms_per_step", ".1f"),
                  _spread(r, "bytes_per_step", ".1f", 1e-6),
                  _spread(r, "write_MBps", ".0f"), _spread(r, "effective_MBps", ".0f"),
                  _num(r["peak_MB"], ".0f"), _num(r["staging_MB"], ".0f"), _spread(r, "page_cache_MB", ".0f"),
                  _num(r["committed"], ".0f"),
                  _spread(r, "recovery_s", ".2f"), _spread(r, "setup_s", ".2f"), _spread(r, "restore_s", ".2f"))
    return t


def print_table(t: Table, console: Console) -> None:
    if not console.is_terminal:  # piped or logged: full rows rather than 80 columns of truncated cells
        console = Console(file=console.file, width=max(console.width, 200), highlight=False)
    console.print(t)


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
