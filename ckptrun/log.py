"""One logger for every ckptrun process: `ckptrun: ...` lines on stderr.

Workers, engines and the launcher all say what they have to say through `log` (never `print`
or `warnings.warn`), so that every line has the same form and a script's own logging setup
neither swallows nor doubles them (the logger does not propagate to the root logger). The one
exception is a message from a signal or parent-death handler, where taking logging's locks
could deadlock.
"""

from __future__ import annotations

import logging
import shutil
import sys
import textwrap


class _Stderr(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time (pytest and the worker bootstrap swap it).

    `fresh_lines`: start each line on a new line unless the output is known to be at a line start
    (the launcher off a terminal, whose output the workers share: one may have left a progress
    bar's line open)."""

    fresh_lines = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.fresh_lines:
            from .ipc.stdio import at_line_start

            try:
                if not at_line_start(self.stream):
                    self.stream.write("\n")
            except Exception:
                pass
        super().emit(record)

    def format(self, record: logging.LogRecord) -> str:
        """On a terminal, long lines are wrapped at its width between words (a line that breaks
        mid-word at 80 columns is hard to read); elsewhere (a log file, a pipe) kept whole."""
        text = super().format(record)
        try:
            width = shutil.get_terminal_size().columns if self.stream.isatty() else 0
        except (AttributeError, ValueError, OSError):
            width = 0
        if width <= 0 or all(len(line) <= width for line in text.splitlines()):
            return text
        return "\n".join(textwrap.fill(line, width, break_long_words=False, break_on_hyphens=False)
                         for line in text.splitlines())

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure(*, quiet: bool | None = None, fresh_lines: bool | None = None) -> None:
    """The launcher's settings (`ckptrun run`): `quiet` logs errors only; `fresh_lines` as
    `_Stderr`'s. A handler a user added to the ``ckptrun`` logger gets the same records."""
    if quiet is not None:
        log.setLevel(logging.ERROR if quiet else logging.INFO)
    if fresh_lines is not None:
        for handler in log.handlers:
            if isinstance(handler, _Stderr):
                handler.fresh_lines = fresh_lines


log = logging.getLogger("ckptrun")
if not log.handlers:
    _handler = _Stderr()
    _handler.setFormatter(logging.Formatter("ckptrun: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False
