"""The remote tier a run's --dir records (`ckptrun.durable.json`), so that `ckptrun ls --dir`
shows which tiers hold each step without being given `--durable` again. The file is untrusted
input like the rest of --dir: a regular file, small, two strings, or nothing is read from it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ...errors import CorruptCheckpoint
from ..fsutil import open_regular, publish_json

NAME = "ckptrun.durable.json"
MAX_BYTES = 4096


def record(root: Path, url: str, endpoint: str) -> None:
    """Note in --dir `root` that its steps are drained to `url` (through `endpoint`, if any)."""
    publish_json(Path(root) / NAME, {"url": url, "endpoint": endpoint})


def recorded(root: Path) -> tuple[str, str] | None:
    """(url, endpoint) `root` records, None if it records none; CorruptCheckpoint if the file
    is not what `record` writes."""
    path = Path(root) / NAME
    if not os.path.lexists(path):
        return None
    with os.fdopen(open_regular(path, NAME), "rb") as f:
        raw = f.read(MAX_BYTES + 1)
    try:
        body = json.loads(raw) if len(raw) <= MAX_BYTES else None
    except (ValueError, RecursionError):
        body = None
    if (not isinstance(body, dict) or not isinstance(body.get("url"), str) or not body["url"]
            or not isinstance(body.get("endpoint"), str)):
        raise CorruptCheckpoint(f"{path}: not a record of a --durable URL")
    return body["url"], body["endpoint"]
