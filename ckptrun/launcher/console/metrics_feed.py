"""Read the workers' and engines' JSON-lines metrics, and copy them to ``--metrics-file``.

Workers and checkpoint engines append events to ``<metrics_dir>/*.jsonl`` in small flushed
batches. The launcher tails those files (:class:`MetricsTailer`), folds every event into
:class:`~ckptrun.launcher.console.metrics_state.MetricsState` (what the live view and the exit
summary show) and, if asked, copies the raw events to the user's ``--metrics-file``
(:class:`MetricsFileWriter`).

Nothing here talks to the processes: files are the only interface, so a crashed or slow
worker can never block the launcher.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

# --------------------------------------------------------------------------- tailing


class MetricsTailer:
    """Incrementally read complete JSON lines from every ``*.jsonl`` file in a folder.

    Keeps one byte offset per file and only consumes up to the last newline, so a line that
    is being appended while we read is picked up whole on a later poll. Files may appear at
    any time (a restarted worker, a late engine). A file that shrinks or is replaced is read
    again from the start. Undecodable lines are skipped and counted in ``bad_lines``.
    """

    def __init__(self, metrics_dir: str | os.PathLike[str], pattern: str = "*.jsonl") -> None:
        self.metrics_dir = Path(metrics_dir)
        self.pattern = pattern
        self.bad_lines = 0
        self._offsets: dict[Path, int] = {}
        self._inodes: dict[Path, int] = {}

    def poll(self) -> list[dict[str, Any]]:
        """Return the events completed since the last poll, across all files, ordered by ``t``."""
        try:
            paths = sorted(self.metrics_dir.glob(self.pattern))
        except OSError:
            return []
        events: list[dict[str, Any]] = []
        for path in paths:
            events.extend(self._read_new(path))
        events.sort(key=_event_time)  # stable: per-file order is kept for equal times
        return events

    def _read_new(self, path: Path) -> list[dict[str, Any]]:
        try:
            with path.open("rb") as f:
                st = os.fstat(f.fileno())
                offset = self._offsets.get(path, 0)
                if st.st_size < offset or self._inodes.get(path, st.st_ino) != st.st_ino:
                    offset = 0  # truncated or replaced: start over
                self._inodes[path] = st.st_ino
                if st.st_size == offset:
                    self._offsets[path] = offset
                    return []
                f.seek(offset)
                data = f.read(st.st_size - offset)
        except OSError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            self._offsets[path] = offset  # only a partial line so far
            return []
        self._offsets[path] = offset + end + 1
        return self._decode(data[: end + 1])

    def _decode(self, chunk: bytes) -> list[dict[str, Any]]:
        events = []
        for raw in chunk.split(b"\n"):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError:  # includes UnicodeDecodeError and JSONDecodeError
                self.bad_lines += 1
                continue
            if isinstance(obj, dict):
                events.append(obj)
            else:
                self.bad_lines += 1
        return events


def _event_time(event: dict[str, Any]) -> float:
    t = event.get("t")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0


# --------------------------------------------------------------------------- copying


class MetricsFileWriter:
    """Append every event to the user's ``--metrics-file`` as one JSON object per line.

    Flushed after each batch so the file is useful while the run is still going (and after a
    crash of the launcher itself).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.parent:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: IO[str] | None = self.path.open("a", encoding="utf-8")

    def write(self, events: Iterable[dict[str, Any]]) -> None:
        """Append ``events`` and flush."""
        if self._f is None:
            raise ValueError("MetricsFileWriter is closed")
        lines = [json.dumps(e, separators=(",", ":"), default=str) + "\n" for e in events]
        if lines:
            self._f.write("".join(lines))
            self._f.flush()

    def close(self) -> None:
        """Flush and close the file (idempotent)."""
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> MetricsFileWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
