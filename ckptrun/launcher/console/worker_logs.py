"""Worker output: how the workers' stdout/stderr reach the user, and how ckptrun's own lines keep
lines of their own.

Live mode (a terminal, the dashboard's panel at the bottom): torchrun sends each worker's output
to files (:func:`torchrun_args`); the worker joins its stderr to its stdout file and runs
unbuffered (:func:`ckptrun.ipc.stdio.merge_stderr`, first thing in bootstrap), so one file holds a rank's output in
the order the worker wrote it. :class:`WorkerLogTailer` echoes that file through the dashboard's
console, above the panel, whole lines only. A line that is still open (no newline yet, e.g. a
progress bar redrawn with carriage returns) is shown as one transient line at the top of the panel
(:meth:`WorkerLogTailer.open_lines`), as a terminal would show it now: the text after its last
carriage return. When its newline comes, that last state is echoed once. Lines that carriage
returns leave blank are dropped.

Piped mode (not a terminal): workers write straight to the inherited stdout/stderr, and ckptrun
never sees their output; `ckptrun.ipc.stdio.at_line_start` tells the log whether stdout is known to be
at the start of a line, so that its own lines never continue a worker's unfinished one.
"""

from __future__ import annotations

import codecs
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ...ipc.stdio import MERGE_ENV

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

def torchrun_args() -> list[str]:
    """torchrun's arguments for live mode: every worker's output into files under its --log-dir. Also
    asks the workers (through the environment they inherit) to write both streams, unbuffered, into
    the stdout file: torchrun opens stdout.log and stderr.log separately, and a block-buffered
    stdout would hold back prints for kilobytes."""
    os.environ[MERGE_ENV] = "1"
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return ["--redirects", "3"]


def last_state(line: str) -> str:
    """What a terminal shows of a line redrawn with carriage returns: the text after the last one. A
    carriage return right before the newline (CRLF) ends the line rather than clearing it."""
    return line.rstrip("\r").rpartition("\r")[2]


@dataclass
class _Source:
    """One log file: how far it was read and the line still open at its end."""

    rank: str
    key: tuple[int, int, str]  # (attempt, local rank, stream): echo order, newest attempt last
    offset: int = 0
    open_line: str = ""
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))


def _key(path: Path) -> tuple[int, int, str]:
    attempt, rank = path.parent.parent.name.rpartition("_")[2], path.parent.name
    return (int(attempt) if attempt.isdigit() else 0, int(rank) if rank.isdigit() else 0, path.name)


class WorkerLogTailer:
    """Echoes the workers' log files (`<log_dir>/<run>/attempt_<n>/<local rank>/std{out,err}.log`)
    through `console`, each line once, whole, prefixed with its rank.

    Order: a rank's lines come in the order the worker wrote them (one merged file, see
    :func:`~ckptrun.ipc.stdio.merge_stderr`); what the worker wrote to stderr before the merge (interpreter start-up)
    comes from stderr.log, at the poll that sees it. Ranks are interleaved a poll's worth at a time.
    """

    def __init__(self, log_dir: str, console: Console, interval: float = 0.25) -> None:
        self.log_dir, self.console, self.interval = Path(log_dir), console, interval
        self._sources: dict[Path, _Source] = {}
        self._lock = threading.Lock()  # the sources
        self._print_lock = threading.Lock()  # one poll at a time, so lines are printed in order
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptrun-worker-logs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop polling, echo what is left, including lines that never got their newline."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=2.0)
        try:
            self.poll(final=True)
        except Exception:  # called on the launcher's way out: never raise there
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception:  # a vanished file or a closed console must not end the echo
                pass

    def poll(self, final: bool = False) -> None:
        """Echo the lines completed since the last poll (with `final`, the open ones too)."""
        with self._print_lock:
            with self._lock:
                for path in self.log_dir.rglob("std*.log"):
                    if path not in self._sources:
                        self._sources[path] = _Source(path.parent.name, _key(path))
                newest: dict[str, int] = {}
                for src in self._sources.values():
                    newest[src.rank] = max(newest.get(src.rank, 0), src.key[0])
                out: list[Text] = []
                for path, src in sorted(self._sources.items(), key=lambda item: item[1].key):
                    out += self._read(path, src)
                    if final or src.key[0] < newest[src.rank]:  # a restarted rank's old attempt writes no more
                        out += self._close(src)
            for line in out:  # printed outside the lock: the live panel asks for open_lines() meanwhile
                self.console.print(line)

    def open_lines(self) -> list[Text]:
        """The lines still open (a progress bar being redrawn), as they look now, one per file of
        each rank's newest attempt; for the live panel."""
        with self._lock:
            current = [s for s in self._sources.values() if last_state(s.open_line).strip()]
        return [self._line(s.rank, last_state(s.open_line), no_wrap=True) for s in sorted(current, key=lambda s: s.key)]

    def _read(self, path: Path, src: _Source) -> list[Text]:
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size < src.offset:  # rewritten: start over
                    src.offset, src.open_line = 0, ""
                    src.decoder.reset()
                f.seek(src.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        src.offset += len(data)
        lines = (src.open_line + src.decoder.decode(data)).split("\n")
        src.open_line = lines.pop()
        return [text for line in lines if (text := self._echo(src.rank, line)) is not None]

    def _close(self, src: _Source) -> list[Text]:
        line, src.open_line = src.open_line + src.decoder.decode(b"", final=True), ""
        text = self._echo(src.rank, line) if line else None
        return [] if text is None else [text]

    def _echo(self, rank: str, line: str) -> Text | None:
        shown = last_state(line)
        if "\r" in line and not shown.strip():  # cleared by carriage returns, not an empty print()
            return None
        return self._line(rank, shown)

    @staticmethod
    def _line(rank: str, text: str, no_wrap: bool = False) -> Text:
        from rich.text import Text

        line = Text(no_wrap=no_wrap, overflow="ellipsis" if no_wrap else None).append(f"[rank {rank}]", style="dim")
        if text:
            line.append(" ").append_text(Text.from_ansi(text))
        return line
