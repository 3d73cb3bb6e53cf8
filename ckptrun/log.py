"""One logger for every ckptrun process: `ckptrun: ...` lines on stderr.

Workers, engines and the launcher all say what they have to say through `log` (never `print`
or `warnings.warn`), so that every line has the same form and a script's own logging setup
neither swallows nor doubles them (the logger does not propagate to the root logger). The one
exception is a message from a signal or parent-death handler, where taking logging's locks
could deadlock.
"""

from __future__ import annotations

import logging
import sys


class _Stderr(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time (pytest and the worker bootstrap swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


log = logging.getLogger("ckptrun")
if not log.handlers:
    _handler = _Stderr()
    _handler.setFormatter(logging.Formatter("ckptrun: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False
