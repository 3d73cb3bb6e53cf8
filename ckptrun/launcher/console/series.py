"""Running statistics of a per-step quantity (a stall, a commit's lag), bounded in memory."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence

P99_WINDOW = 2_000  # p99 is computed over this many recent steps (mean is over the whole run); each
# stall cause of each rank keeps this many floats (~64 KB), reached within the first minutes of a run


def percentile(values: Sequence[float] | Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); ``None`` for no values.

    Nearest-rank returns an observed value, so a p99 of stalls is a stall that really happened.
    """
    ordered = sorted(values)
    if not ordered:
        return None
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[k]


class Series:
    """Running statistics of one per-step quantity.

    The mean is exact over the whole run; the p99 uses the most recent ``window`` values so
    memory stays bounded on long runs.
    """

    def __init__(self, window: int = P99_WINDOW) -> None:
        self.last: float | None = None
        self.count = 0
        self.total = 0.0
        self.max: float | None = None
        self._recent: deque[float] = deque(maxlen=window)
        self._p99_cache: float | None = None
        self._dirty = False

    def add(self, value: float) -> None:
        self.last = value
        self.count += 1
        self.total += value
        self.max = value if self.max is None else max(self.max, value)
        self._recent.append(value)
        self._dirty = True

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    @property
    def p99(self) -> float | None:
        if self._dirty:
            self._p99_cache = percentile(self._recent, 99)
            self._dirty = False
        return self._p99_cache
