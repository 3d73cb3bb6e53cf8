"""The engine runs with one malloc arena (ckptrun/engine/arena.py): per-thread arenas each kept
a freed copy of CPython's interned-string table, and the engine's RSS rose with the run."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Threads that allocate (as the engine's writers and committer do), then glibc's own account of
# its arenas: one <heap> element per arena.
PROBE = """
import ctypes, sys, tempfile, threading
from ckptrun.engine.arena import one_arena
assert not {limit} or one_arena()
def work():
    for _ in range(50):
        blocks = [bytearray(2000) for _ in range(100)]
        blocks.clear()
threads = [threading.Thread(target=work) for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile("r") as f:
    fp = ctypes.c_void_p(libc.fopen(f.name.encode(), b"w"))
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    print(f.read().count("<heap nr="))
"""


def arenas(limit: bool) -> int:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(limit=limit)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="needs glibc (malloc_info, mallopt); one_arena() is a no-op elsewhere")
def test_one_arena_for_every_thread():
    assert arenas(limit=False) > 1  # the probe does make per-thread arenas without the limit
    assert arenas(limit=True) == 1


# A heap left in pieces: 100 MB of small blocks, 99 of each 100 freed, the rest pinning the heap's
# top so that glibc's own trimming at free() cannot give the pages back.
TRIM_PROBE = """
from ckptrun.engine.arena import HeapTrimmer, one_arena
one_arena()
trimmer = HeapTrimmer(grow_bytes=8 << 20, every_s=0)
blocks = [bytearray(1000) for _ in range(100_000)]
kept = blocks[::100]
del blocks
before = trimmer.rss()
said = trimmer.maybe_trim()
assert said is not None and said == (said[0], trimmer.rss()) and said[0] >= before, said
again = trimmer.maybe_trim()
print(before, trimmer.rss(), int(again is not None))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs glibc (malloc_trim) and /proc")
def test_a_grown_heap_gives_its_free_pages_back_once():
    proc = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after, again = map(int, proc.stdout.split())  # the probe asserts that the first call trimmed
    assert before - after > 50 << 20, (before, after)
    assert again == 0  # no growth since: no second trim
