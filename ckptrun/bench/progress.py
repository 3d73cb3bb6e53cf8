"""The bench's progress: on a terminal a rich progress bar (runs done, the configuration running,
elapsed time, an estimate of the time left), on stderr; off a terminal (a log) one line per run.
The figures of every run are in the report and its `--json`."""

from __future__ import annotations

import time
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# The time left is estimated from the runs' mean time over the whole bench: a run takes longer
# than rich's default 30-second window, which would leave the estimate blank between runs.
SPEED_WINDOW_S = 24 * 3600.0


class RunProgress:
    """`with RunProgress(console, total) as p:` then `p.running(name)` before each run and
    `p.done(line, failed)` after it."""

    def __init__(self, console: Console, total: int) -> None:
        self.console, self.total, self.n = console, total, 0
        self._t0 = time.perf_counter()
        self._bar: Progress | None = None
        self._task = None
        if console.is_terminal:
            self._bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("runs"), TimeElapsedColumn(),
                                 TextColumn("elapsed, left"), TimeRemainingColumn(), console=console, transient=True,
                                 speed_estimate_period=SPEED_WINDOW_S)

    def __enter__(self) -> RunProgress:
        if self._bar is not None:
            self._bar.start()
            self._task = self._bar.add_task("bench", total=self.total)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()

    def running(self, name: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=name)

    def done(self, line: str, failed: bool = False) -> None:
        """One run ended: `line` says how (a log line off a terminal; on one, only a failure is
        printed, above the bar)."""
        self.n += 1
        if self._bar is not None:
            self._bar.advance(self._task)
            if failed:
                self._bar.console.print(line, markup=False, highlight=False)
            return
        self.console.print(f"[{self.n}/{self.total}] {line} [{time.perf_counter() - self._t0:.0f} s]", markup=False,
                           highlight=False)
