"""Worker output while the live dashboard owns the terminal.

With a live panel, workers' stdout/stderr go to files (torchrun's --redirects/--log-dir) and
this tailer prints their new lines through the dashboard's console, above the panel, so the
two never fight over the cursor.
"""

from __future__ import annotations

import threading
from pathlib import Path

from rich.console import Console
from rich.markup import escape


class WorkerLogTailer:
    def __init__(self, log_dir: str, console: Console, interval: float = 0.25) -> None:
        self.log_dir, self.console, self.interval = Path(log_dir), console, interval
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptrun-worker-logs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        for path in sorted(self.log_dir.rglob("std*.log")):
            with open(path, errors="replace") as f:
                f.seek(self._offsets.get(path, 0))
                text = self._partial.pop(path, "") + f.read()
                self._offsets[path] = f.tell()
            lines = text.split("\n")
            if lines[-1]:
                self._partial[path] = lines[-1]
            rank = path.parent.name
            for line in lines[:-1]:
                self.console.print(f"[dim]\\[rank {escape(rank)}][/dim] {escape(line)}", highlight=False)
