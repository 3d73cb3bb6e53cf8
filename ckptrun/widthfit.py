"""Tables that read at any terminal width (`ckptrun ls`, the bench table, the dashboard).

A column is either identifying (the step, the record, the configuration: never cut, never
left out) or ranked by how soon it may be left out. :func:`fit_table` builds the table with
every column, and while it is wider than the console leaves out the least important column
left; the caller prints :func:`left_out_line` under it, which names the columns left out and
how to see them. Cells are never wrapped or cut: a column is whole or absent.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

_MEASURE = Console(file=io.StringIO(), width=100_000)


@dataclass(frozen=True)
class Col:
    """A column: `key` columns identify the row; otherwise the higher `drop`, the sooner it is
    left out at a narrow width (ties: the rightmost first)."""

    header: str
    drop: int = 0
    key: bool = False
    justify: str = "right"


def width_of(renderable: RenderableType) -> int:
    """The width `renderable` takes when nothing in it wraps."""
    return Measurement.get(_MEASURE, _MEASURE.options, renderable).maximum


def fit_table(columns: Sequence[Col], rows: Sequence[Sequence[Any]], width: int | None, **table_args: Any
              ) -> tuple[Table, list[str]]:
    """The table of `rows` (cells in `columns`' order) with as many columns as fit in `width`
    (None: all of them); returns it and the headers left out."""
    shown = list(range(len(columns)))
    table = _build(columns, rows, shown, table_args)
    optional = sorted((i for i, c in enumerate(columns) if not c.key), key=lambda i: (columns[i].drop, i),
                      reverse=True)
    left_out: list[int] = []
    for i in optional:
        if width is None or width_of(table) <= width:
            break
        shown.remove(i)
        left_out.append(i)
        table = _build(columns, rows, shown, table_args)
    for i in reversed(left_out[:-1]):  # back, most important first, the narrower ones that still fit
        trial = _build(columns, rows, sorted([*shown, i]), table_args)
        if width_of(trial) > width:
            break
        shown, table = sorted([*shown, i]), trial
        left_out.remove(i)
    return table, [columns[i].header for i in sorted(left_out)]


def print_tables(parts: Sequence[RenderableType], console: Console) -> None:
    """Print `parts` at their full width: tables fitted by `fit_table` fit the width asked
    already, and one asked to take every column (None) is not squeezed to the console's."""
    need = max((width_of(p) for p in parts if not isinstance(p, Text)), default=0)
    if need > console.width:
        console = Console(file=console.file, width=need, highlight=False, color_system=console.color_system)
    for part in parts:
        console.print(part)


def left_out_line(headers: Sequence[str], hint: str) -> str:
    """One line under a table that lost columns: which, and how to see them."""
    return f"not shown: {', '.join(headers)} ({hint})" if headers else ""


def _build(columns: Sequence[Col], rows: Sequence[Sequence[Any]], shown: list[int], table_args: dict) -> Table:
    table = Table(**table_args)
    for i in shown:
        c = columns[i]
        table.add_column(c.header, justify=c.justify, no_wrap=True, overflow="fold" if c.key else "ellipsis",
                         min_width=max((len(str(r[i])) for r in rows), default=0) if c.key else None)
    for r in rows:
        table.add_row(*(r[i] for i in shown))
    return table
