"""How a worker's output reaches the launcher: the launcher asks (through the environment) for
both streams in one file; the worker merges them first thing, before writing anything."""

from __future__ import annotations

import os
import stat
import sys
from typing import IO, Any

MERGE_ENV = "CKPTRUN_MERGE_STDERR"


def merge_stderr() -> None:
    """Worker side, before anything is written: stderr into the stdout file when the launcher asked
    for it. Both descriptors then share one file offset, so the file keeps the order of the writes."""
    if os.environ.pop(MERGE_ENV, "") == "1":  # not for the script's own subprocesses
        sys.stderr.flush()
        os.dup2(1, 2)


def at_line_start(file: IO[str] | Any) -> bool:
    """Whether the next character written to `file` starts a line, as far as can be known: only a
    regular file can be read back (its last byte); a pipe or a terminal shared with the workers
    might be in the middle of their progress bar, so the answer there is no."""
    try:
        fd = file.fileno()
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        # Reopened for reading (stdout is often opened write-only); Linux only, elsewhere: no.
        with open(f"/proc/self/fd/{fd}", "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return True
            f.seek(size - 1)
            return f.read(1) == b"\n"
    except (OSError, ValueError, AttributeError):
        return False
