"""One malloc arena for the engine process: its memory stays flat over any run length.

glibc gives each thread that allocates its own arena, and a large block freed in an arena stays
there for reuse by that arena only (the trim threshold rises with the largest block freed).
The engine's threads (serving, committing, writers) are Python threads taking turns under one
GIL, and its torch handlers run one intra-op thread, so more arenas buy no parallelism. What
they cost, measured (issue 35): CPython 3.11 rebuilds its table of interned strings every few
thousand steps (about 1 MB; 7.7 MB once torch is imported; the number of strings in it stays
constant), in whichever thread inserts the string that fills it, and the freed table stayed in
that thread's arena. The engine's RSS rose by one table at a time, up to one per thread. With
one arena the next rebuild reuses the freed table, unless smaller blocks have been carved out of
it meanwhile: then the new table goes on top of the heap, and the freed one stays resident in
pieces (lowdiff+'s engine: +6.6 MB at one rebuild in 50,000 steps). `HeapTrimmer` hands such
free pages back to the kernel when the RSS has grown.

The churn comes from pathlib, which interns every component of every path it parses: each
step's record name enters the table and leaves it when its paths die, ~8 insertions per step
(counted in a live engine with gdb: `dk_nentries` of `interned`), a rebuild every ~35,000 steps.
"""

from __future__ import annotations

import ctypes
import os
import time

M_ARENA_MAX = -8  # glibc's malloc.h


def one_arena() -> bool:
    """Limit this process to one malloc arena (call it before starting threads); False where
    the C library has no `mallopt` (not glibc) or refuses."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_ARENA_MAX, 1) == 1


class HeapTrimmer:
    """Return the heap's free pages to the kernel (glibc's `malloc_trim`) when the RSS has grown
    by `grow_bytes` since the last trim; the RSS is read every `every_s` (`maybe_trim`, from a
    loop that runs anyway). A trim holds the malloc lock for ~15 ms on a fragmented 100 MB heap,
    so it runs only on growth, not on a clock."""

    def __init__(self, grow_bytes: int = 2 << 20, every_s: float = 5.0) -> None:
        self.grow_bytes, self.every_s = grow_bytes, every_s
        try:
            self._trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):  # not glibc
            self._trim = None
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._next = time.monotonic() + every_s
        self.base = self.rss()

    def rss(self) -> int:
        try:
            with open("/proc/self/statm", "rb") as f:
                return int(f.read().split()[1]) * self._page
        except (OSError, IndexError, ValueError):
            return 0

    def maybe_trim(self) -> tuple[int, int] | None:
        """Trim if due and grown: (RSS before, RSS after) when it trimmed, else None."""
        now = time.monotonic()
        if self._trim is None or now < self._next:
            return None
        self._next = now + self.every_s
        before = self.rss()
        if before <= self.base + self.grow_bytes:
            return None
        self._trim(0)
        self.base = self.rss()
        return before, self.base
