"""One malloc arena for the engine process: its memory stays flat over any run length.

glibc gives each thread that allocates its own arena, and a large block freed in an arena stays
there for reuse by that arena only (the trim threshold rises with the largest block freed).
The engine's threads (serving, committing, writers) are Python threads taking turns under one
GIL, and its torch handlers run one intra-op thread, so more arenas buy no parallelism. What
they cost, measured (issue 35): CPython 3.11 rebuilds its table of interned strings every few
thousand steps (about 1 MB; 7.7 MB once torch is imported; the number of strings in it stays
constant), in whichever thread inserts the string that fills it, and the freed table stayed in
that thread's arena. The engine's RSS rose by one table at a time, up to one per thread. With
one arena the next rebuild reuses the freed table.
"""

from __future__ import annotations

import ctypes

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
