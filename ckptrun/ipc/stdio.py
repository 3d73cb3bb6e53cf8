"""How a worker's output reaches the launcher: the launcher asks (through the environment) for
both streams in one file; the worker merges them first thing, before writing anything."""

from __future__ import annotations

import os
import sys

MERGE_ENV = "CKPTRUN_MERGE_STDERR"


def merge_stderr() -> None:
    """Worker side, before anything is written: stderr into the stdout file when the launcher asked
    for it. Both descriptors then share one file offset, so the file keeps the order of the writes."""
    if os.environ.pop(MERGE_ENV, "") == "1":  # not for the script's own subprocesses
        sys.stderr.flush()
        os.dup2(1, 2)
