"""Worker output: whole lines in write order above the live panel, carriage-return redraws shown
as one line, and ckptrun's own lines on lines of their own when workers share its output."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from conftest import REPO, SCRIPTS, ckptrun, clean_env, kill_tree, ok
from rich.console import Console
from rich.text import Text

from ckptrun.ipc.stdio import MERGE_ENV, at_line_start
from ckptrun.launcher.console.dashboard import Dashboard
from ckptrun.launcher.console.worker_logs import WorkerLogTailer, last_state
from ckptrun.log import _Stderr


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200, color_system=None), buf


def _write(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def _open(tailer: WorkerLogTailer) -> list[str]:
    return [t.plain for t in tailer.open_lines()]


def test_last_state_of_a_redrawn_line() -> None:
    assert last_state("\r 10%|#\r 20%|##") == " 20%|##"
    assert last_state("done\r\r") == "done"  # CR LF ends a line, it does not clear it
    assert last_state("plain") == "plain" and last_state("") == ""


def test_tailer_echoes_whole_lines_once_and_redraws_as_their_last_state(tmp_path: Path) -> None:
    console, buf = _console()
    tailer = WorkerLogTailer(str(tmp_path), console)
    out = tmp_path / "run" / "attempt_0" / "0" / "stdout.log"  # stdout and stderr, merged
    err = out.with_name("stderr.log")  # what came before the merge
    _write(err, "warning: from start-up\n")
    _write(out, "loading da")
    tailer.poll()
    assert buf.getvalue() == "[rank 0] warning: from start-up\n"  # an open line is not echoed...
    assert _open(tailer) == ["[rank 0] loading da"]  # ...it is shown, as it looks now
    _write(out, "ta\r\n")  # CR LF
    _write(out, "\r  0%|     | 0/3")
    tailer.poll()
    _write(out, "\r 33%|█")
    _write(out, "█".encode()[:2])  # a character cut in the middle
    tailer.poll()
    assert _open(tailer) == ["[rank 0]  33%|█"]  # the cut character waits for its last byte
    _write(out, "█".encode()[2:] + b"   | 1/3")
    tailer.poll()
    assert _open(tailer) == ["[rank 0]  33%|██   | 1/3"]
    _write(out, "step 1 loss 0.5\n")  # a print while the bar is open continues its line, as on a terminal
    _write(out, "\r 66%|███  | 2/3\r100%|█████| 3/3\n\n")  # the finished bar; an empty print()
    _write(out, "\r" + " " * 16 + "\r")  # a bar cleared at its end (tqdm leave=False)...
    _write(out, "\n")  # ...then a newline: nothing to show
    _write(out, "Traceback (most recent call last):\n  File \x1b[31mx\x1b[0m\n")
    tailer.poll()
    assert _open(tailer) == []
    assert buf.getvalue().splitlines() == [
        "[rank 0] warning: from start-up",
        "[rank 0] loading data",
        "[rank 0]  33%|██   | 1/3step 1 loss 0.5",
        "[rank 0] 100%|█████| 3/3",
        "[rank 0]",
        "[rank 0] Traceback (most recent call last):",
        "[rank 0]   File x",
    ]


def test_tailer_ranks_restarts_and_stop(tmp_path: Path) -> None:
    console, buf = _console()
    tailer = WorkerLogTailer(str(tmp_path), console)
    run = tmp_path / "run"
    for rank in (1, 0):
        _write(run / "attempt_0" / str(rank) / "stdout.log", f"rank {rank} up\n\r 50%|## rank {rank}")
    tailer.poll()
    assert buf.getvalue().splitlines() == ["[rank 0] rank 0 up", "[rank 1] rank 1 up"]
    assert _open(tailer) == ["[rank 0]  50%|## rank 0", "[rank 1]  50%|## rank 1"]
    # rank 1 died and came back: its old attempt will never end its line; show its last state
    _write(run / "attempt_1" / "1" / "stdout.log", "rank 1 again\n\r 10%")
    tailer.poll()
    assert buf.getvalue().splitlines()[2:] == ["[rank 1]  50%|## rank 1", "[rank 1] rank 1 again"]
    assert _open(tailer) == ["[rank 0]  50%|## rank 0", "[rank 1]  10%"]
    tailer.stop()  # the lines left open are echoed, in rank order
    assert buf.getvalue().splitlines()[4:] == ["[rank 0]  50%|## rank 0", "[rank 1]  10%"]
    assert _open(tailer) == []


def test_worker_merges_stderr_into_stdout_file_in_write_order(tmp_path: Path) -> None:
    """What torchrun's --redirects does (two files), then the worker's merge: one file, in order."""
    code = ("from ckptrun.ipc.stdio import merge_stderr; merge_stderr()\n"
            "import os, sys\n"
            "for i in range(3):\n"
            "    print(f'out {i}', end='')\n"
            "    print(f' err {i}', file=sys.stderr)\n"
            "os.system('echo child >&2')\n"
            "print(os.environ.get('" + MERGE_ENV + "'))\n")
    env = {**clean_env(None), MERGE_ENV: "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    with open(tmp_path / "stdout.log", "w") as out, open(tmp_path / "stderr.log", "w") as err:
        subprocess.run([sys.executable, "-c", code], stdout=out, stderr=err, env=env, check=True, timeout=60)
    assert (tmp_path / "stdout.log").read_text() == "out 0 err 0\nout 1 err 1\nout 2 err 2\nchild\nNone\n"
    assert (tmp_path / "stderr.log").read_text() == ""


def test_live_panel_shows_open_lines_on_top(tmp_path: Path) -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=True, color_system=None)
    dash = Dashboard(tmp_path, live=True, console=console, poll_interval=0.0,
                     top=lambda: [Text("[rank 0]  42%|####")])
    dash.start()
    dash.stop()
    out = buf.getvalue()
    assert out.index("[rank 0]  42%|####") < out.index("waiting for workers")


def test_at_line_start(tmp_path: Path) -> None:
    path = tmp_path / "log"
    with open(path, "w") as f:  # write-only, as `> log` opens it
        assert at_line_start(f)  # empty
        f.write("progress 50%")
        f.flush()
        assert not at_line_start(f)
        f.write("\n")
        f.flush()
        assert at_line_start(f)
    r, w = os.pipe()
    with os.fdopen(r) as rf, os.fdopen(w, "w") as wf:
        assert not at_line_start(wf) and not at_line_start(rf)  # a pipe cannot be read back: not known
    assert not at_line_start(io.StringIO())


def test_piped_log_lines_start_on_a_fresh_line(tmp_path: Path, monkeypatch) -> None:
    """Off a terminal, a worker's open progress bar (same file, its own descriptor) is ended before
    the launcher's log line; a line that is already ended gets no empty line after it."""
    handler = _Stderr()
    handler.fresh_lines = True
    handler.setFormatter(logging.Formatter("ckptrun: %(message)s"))
    logger = logging.getLogger("ckptrun-fresh-lines-test")
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    path = tmp_path / "out.log"
    with open(path, "a") as f, open(path, "a") as worker:  # `>> out.log 2>&1`
        monkeypatch.setattr(sys, "stderr", f)
        worker.write("\r 50%|#####")
        worker.flush()
        logger.info("one")
        worker.write("epoch done\n")
        worker.flush()
        logger.info("two")
    assert path.read_bytes().decode() == "\r 50%|#####\nckptrun: one\nepoch done\nckptrun: two\n"
    buf = io.StringIO()  # cannot be read back: always a new line first
    monkeypatch.setattr(sys, "stderr", buf)
    logger.info("three")
    assert buf.getvalue() == "\nckptrun: three\n"


def test_piped_run_keeps_ckptrun_lines_at_column_0(tmp_path: Path) -> None:
    """Off a terminal, with a worker's bar on ckptrun's own stderr (its log), left open when the
    script ends."""
    proc = ok(ckptrun(tmp_path, "--dir", "ck", SCRIPTS / "progress_bar.py", "--bar-to", "stderr"))
    lines = proc.stderr.replace("\r", "\n").split("\n")  # (text mode has made each \r a \n already)
    assert not [ln for ln in lines if "ckptrun: " in ln and not ln.startswith("ckptrun: ")], proc.stderr
    assert [ln for ln in lines if ln.startswith("ckptrun: step 12 |")], proc.stderr
    assert [ln for ln in lines if ln.startswith("ckptrun: summary: steps 12")], proc.stderr
    assert "100%|##########| 6/6\n" in proc.stderr and "epoch 0 done\n" in proc.stdout


def _screen(data: str) -> list[str]:
    """The lines a terminal ends up showing for `data`: enough of one for rich's Live (carriage
    return, newline, cursor up, erase line; other escape sequences ignored)."""
    lines: list[str] = [""]
    row = col = 0
    for m in re.finditer(r"\x1b\[([0-9;?]*)([A-Za-z])|\x1b.|([^\x1b])", data, re.S):
        arg, cmd, ch = m.groups()
        if cmd == "A":
            row = max(0, row - int(arg or 1))
        elif cmd == "K":
            lines[row] = "" if arg == "2" else lines[row][:col]
        elif ch == "\r":
            col = 0
        elif ch == "\n":
            row, col = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        elif ch is not None:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + ch + line[col + 1:]
            col += 1
    return [ln.rstrip() for ln in lines]


def _in_terminal(cwd: Path, *args: object, timeout: float = 120) -> tuple[int, str]:
    """`python -m ckptrun ARGS` on a pseudo-terminal (160 columns): its exit code and what it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    env = {**clean_env(None), "TERM": "xterm", "COLUMNS": "160", "LINES": "50"}
    proc = subprocess.Popen([sys.executable, "-m", "ckptrun", *map(str, args)], cwd=cwd, env=env, stdin=slave,
                            stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:  # EIO: every process holding the terminal has ended
                    break
                out += data
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
        os.close(master)


def test_live_run_echoes_worker_lines_whole_and_in_order(tmp_path: Path) -> None:
    """On a terminal: stderr (the bar) and stdout in the order the worker wrote them, each bar once in
    its last state (the open one at the end too), nothing glued to the panel."""
    rc, out = _in_terminal(tmp_path, "--dir", "ck", SCRIPTS / "progress_bar.py")
    screen = _screen(out)
    assert rc == 0, "\n".join(screen)
    assert [ln for ln in screen if ln.startswith("[rank")] == [
        "[rank 0] stdout 1", "[rank 0] stderr 2", "[rank 0] stdout 3",
        "[rank 0] 100%|##########| 6/6", "[rank 0] epoch 0 done", "[rank 0] 100%|##########| 6/6"], "\n".join(screen)
    assert [ln for ln in screen if "ckptrun summary" in ln] == ["ckptrun summary"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_launchers_own_lines_wrap_between_words_on_a_terminal_only(monkeypatch):
    """At 80 columns a long `ckptrun:` line breaks between words (it once broke mid-word, `at st`
    / `art)`); written to a file or a pipe it stays one line, as logs and tests read it."""
    from ckptrun.log import log

    monkeypatch.setenv("COLUMNS", "80")
    words = "host-memory budget: 5.31 GiB per node (25% of 21.23 GiB available at start), for the slots"
    for stream, lines in ((_Terminal(), 2), (io.StringIO(), 1)):
        monkeypatch.setattr(sys, "stderr", stream)
        log.info(words)
        out = stream.getvalue().splitlines()
        assert len(out) == lines and all(len(line) <= 80 for line in out[:-1] if lines > 1), out
        assert " ".join(out) == f"ckptrun: {words}", out
