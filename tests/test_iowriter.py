"""The engine's file writers (ckptrun/storage/iowriter.py): the compiled io_uring + O_DIRECT one
(native/uring_writer.c) writes exactly the bytes the pure-Python one does, whatever the sizes,
offsets, memory alignment and threads; errors are OSError, never a hang; selection falls back
to Python, with one warning, where the native writer cannot run."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import EXAMPLE, TINY, ckptrun, logged, ok, verify

from ckptrun.bench import plan
from ckptrun.launcher.console.dashboard import render_header
from ckptrun.launcher.console.metrics_state import MetricsState
from ckptrun.storage import fsutil, iowriter

NATIVE_MISSING = iowriter.native_unavailable()
needs_native = pytest.mark.skipif(NATIVE_MISSING is not None,
                                  reason=f"the native writer is not built or cannot run here: {NATIVE_MISSING}")


class AllDirect(iowriter.NativeOutFile):
    """The native writer with no small-write shortcut: every whole page through the ring."""

    SMALL = 0


WRITERS = [iowriter.OutFile, pytest.param(iowriter.NativeOutFile, marks=needs_native),
           pytest.param(AllDirect, marks=needs_native)]
SIZES = [0, 1, 4095, 4096, 4097, 3 * 2**20 + 5]
OFFSETS = [0, 1, 4096, 8191]


@pytest.fixture(autouse=True)
def _fresh_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test chooses its writer from scratch; the process's choice is restored afterwards."""
    monkeypatch.setattr(iowriter, "_current", None)
    monkeypatch.setattr(iowriter, "_warned", False)
    monkeypatch.delenv(iowriter.ENV, raising=False)


def _payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def _unaligned(data: bytes, shift: int = 3) -> memoryview:
    """`data` as a view starting `shift` bytes into a buffer (not 4 KiB-aligned)."""
    buf = bytearray(len(data) + shift)
    buf[shift:] = data
    return memoryview(buf)[shift:]


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("offset", OFFSETS)
def test_a_write_lands_exactly(tmp_path: Path, writer: type[iowriter.OutFile], size: int, offset: int) -> None:
    data = _payload(size, seed=size)
    for i, src in enumerate((data, _unaligned(data), memoryview(bytearray(data)))):
        path = tmp_path / f"f{i}"
        with writer(path) as f:
            f.write_at(src, offset)
            f.sync()
        assert path.read_bytes() == (bytes(offset) + data if size else b""), (i, size, offset)


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("offset", OFFSETS)
def test_an_existing_file_is_written_in_place(tmp_path: Path, writer: type[iowriter.OutFile], offset: int) -> None:
    """`existing`: the bytes around the write stay (a preallocated region), and a missing file
    is an error, never created."""
    old, data = _payload(3 * 2**20 + 12288, 1), _payload(2**20 + 4097, 2)
    path = tmp_path / "region"
    path.write_bytes(old)
    with writer(path, existing=True) as f:
        f.write_at(_unaligned(data), offset)
        f.sync()
    assert path.read_bytes() == old[:offset] + data + old[offset + len(data):]
    with pytest.raises(FileNotFoundError):
        writer(tmp_path / "gone", existing=True)
    assert not (tmp_path / "gone").exists()


@pytest.mark.parametrize("writer", WRITERS)
def test_threads_writing_pieces_of_one_file(tmp_path: Path, writer: type[iowriter.OutFile]) -> None:
    """Pieces of odd sizes at odd offsets, from 4 threads at once, typed views (not bytes) among them."""
    data = _payload(9 * 2**20 + 4097, 1)
    cuts = [0, 1, 4096, 5000, 2**20 + 3, 3 * 2**20, 3 * 2**20 + 4095, 6 * 2**20 + 1, 8 * 2**20, len(data)]
    pieces = list(zip(cuts, cuts[1:], strict=False))
    path = tmp_path / "threads"
    f = writer(path)
    errors: list[BaseException] = []

    def put(mine: list[tuple[int, int]]) -> None:
        try:
            for a, b in mine:
                f.write_at(_unaligned(data[a:b], a % 7) if a % 2 else memoryview(data)[a:b], a)
        except BaseException as e:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=put, args=(pieces[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    f.sync()
    f.close()
    assert not errors and path.read_bytes() == data


@needs_native
def test_close_waits_for_the_writes_running(tmp_path: Path) -> None:
    """A close racing with writes from other threads: each write lands whole or fails with
    EBADF (it came after the close); nothing crashes or hangs."""
    data = _payload(16 * 2**20, 3)
    for _ in range(5):
        f = AllDirect(tmp_path / "racing")
        outcomes: list[int] = []

        def put(at: int, f: iowriter.OutFile = f, outcomes: list[int] = outcomes) -> None:
            try:
                f.write_at(data, at)
                outcomes.append(at)
            except OSError as e:
                assert e.errno == errno.EBADF

        threads = [threading.Thread(target=put, args=(i * len(data),)) for i in range(3)]
        for t in threads:
            t.start()
        f.close()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        written = (tmp_path / "racing").read_bytes()
        for at in outcomes:
            assert written[at : at + len(data)] == data


@needs_native
def test_both_writers_make_the_same_files(tmp_path: Path) -> None:
    import array

    floats = memoryview(array.array("f", range(300_001)))  # a typed view, 1.2 MB, not page-multiple
    for writer in (iowriter.OutFile, iowriter.NativeOutFile):
        with writer(tmp_path / writer.engine) as f:
            f.write_at(floats, 12345)
            f.write_at(b"tail", 12345 + floats.nbytes)
            f.sync()
    assert (tmp_path / "native").read_bytes() == (tmp_path / "python").read_bytes()


@needs_native
@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_native_without_o_direct(tmp_path: Path, where: str) -> None:
    """Buffered through the same ring: what a file system refusing O_DIRECT gets (tmpfs before
    Linux 6.6); and whatever /dev/shm's tmpfs accepts here, the bytes land exactly."""
    from ckptrun import _uring

    folder = tmp_path if where == "tmp" else Path("/dev/shm")
    if not folder.is_dir():
        pytest.skip("no /dev/shm")
    path = folder / f"ckptrun-iowriter-{os.getpid()}"
    data = _payload(2**20 + 4097, 2)
    try:
        w = _uring.Writer(os.fsencode(path), 4, 65536, where == "shm")
        assert w.direct is False or where == "shm"
        w.write_at(_unaligned(data), 5)
        w.write_at(data[:3], 0)
        w.sync()
        w.close()
        assert path.read_bytes() == data[:3] + bytes(2) + data
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("writer", WRITERS)
def test_errors_are_oserror(tmp_path: Path, writer: type[iowriter.OutFile]) -> None:
    f = writer(tmp_path / "closed")
    f.close()
    with pytest.raises(OSError) as e:
        f.write_at(b"x" * 10000, 0)
    assert e.value.errno == errno.EBADF
    with pytest.raises((OSError, ValueError)):  # Python's os.fsync(-1): ValueError
        f.sync()
    if os.path.exists("/dev/full"):  # every write fails with ENOSPC: a full disk
        with writer(Path("/dev/full")) as full:
            for n in (10, 4 * 2**20):
                with pytest.raises(OSError) as e:
                    full.write_at(bytes(n), 0)
                assert e.value.errno == errno.ENOSPC
    with pytest.raises(FileNotFoundError):
        writer(tmp_path / "no-such-dir" / "f")


_FILE_SIZE_LIMIT = """
import errno, resource, signal, sys
from ckptrun.storage import iowriter
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
f = iowriter.NativeOutFile(sys.argv[1])
try:
    f.write_at(bytes(8 * 2**20), 0)
except OSError as e:
    print(errno.errorcode[e.errno], f.direct)
"""


@needs_native
def test_a_failing_write_in_the_ring_is_oserror(tmp_path: Path) -> None:
    """A file-size limit makes the kernel fail the pieces in flight (O_DIRECT, through the ring)."""
    out = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMIT, str(tmp_path / "big")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "EFBIG"


def test_publish_bytes_goes_through_the_selected_writer(tmp_path: Path) -> None:
    points: list[str] = []
    data = os.urandom(40 * 2**20 + 77)  # several 16 MiB chunks
    for name in ("python", "native"):
        engine = iowriter.select(name)
        assert engine == iowriter.engine_name() == (name if NATIVE_MISSING is None else "python")
        fsutil.publish_bytes(tmp_path / name, memoryview(data), fault=points.append, name="data", threads=3)
        assert (tmp_path / name).read_bytes() == data
        assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert points == ["data:open", "data:written", "data:synced", "data:renamed", "data:dir-synced"] * 2


def test_native_where_it_cannot_run_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(iowriter, "native_unavailable", lambda: "the compiled writer ckptrun._uring is not built")
    with logged() as lines:
        assert iowriter.select("native") == "python"
        assert iowriter.select("native") == "python"
        assert iowriter.engine_name() == "python"
        assert isinstance(iowriter.open_out(os.devnull), iowriter.OutFile)
    assert len(lines) == 1 and "not built" in lines[0] and "Python writer runs instead" in lines[0]
    with logged() as lines:  # nobody asked for native: no warning
        monkeypatch.setattr(iowriter, "DEFAULT", "native")
        assert iowriter.select("auto") == "python"
    assert lines == []


def test_auto_follows_the_environment_then_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert iowriter.select() == iowriter.DEFAULT or NATIVE_MISSING is not None
    monkeypatch.setenv(iowriter.ENV, "python")
    assert iowriter.select("auto") == "python"
    monkeypatch.setenv(iowriter.ENV, "native")
    assert iowriter.select("python") == "python"  # an explicit choice wins over the environment
    assert iowriter.select("auto") == ("native" if NATIVE_MISSING is None else "python")
    monkeypatch.setenv(iowriter.ENV, "fast")
    with logged() as lines:
        iowriter.select("auto")
    assert "CKPTRUN_IO_ENGINE='fast'" in lines[0]
    with pytest.raises(ValueError, match="io engine must be one of"):
        iowriter.select("fast")


def test_bench_runs_each_strategy_with_each_writer_and_headers_say_which() -> None:
    configs = plan.configurations("checkfreq,torch.save", "1", "native,python")
    assert [c.name for c in configs] == ["none", "checkfreq:native", "checkfreq:python", "torch.save"]
    assert configs[1].flags[-2:] == ("--io-engine", "native")
    with pytest.raises(Exception, match="--io-engine"):
        plan.configurations("sync", "1", "native,fast")
    state = MetricsState()
    state.apply({"type": "io_engine", "t": 1.0, "rank": 0, "engine": "native"})
    assert state.io_engine == "native" and "writer native" in str(render_header(state, 2.0).renderables[0])


def test_run_option_reaches_the_engine(tmp_path: Path) -> None:
    """`--io-engine` travels launcher -> worker -> engine (Hello), which says which writer runs."""
    ok(ckptrun(tmp_path, "--io-engine", "native", "--dir", "ckpts", "--metrics-dir", "metrics", EXAMPLE, *TINY))
    events = [json.loads(line) for line in (tmp_path / "metrics" / "engine-0.jsonl").read_text().splitlines()]
    said = [e["engine"] for e in events if e.get("type") == "io_engine"]
    assert said == ["native" if NATIVE_MISSING is None else "python"]
    ok(verify(tmp_path, "ckpts"))
