"""One host-memory budget that every staging buffer of a rank respects (`--host-memory`).

The budget is per node (`--host-memory SIZE`, or by default `DEFAULT_FRACTION` of the memory
available when the run starts), shared equally by the node's local ranks. Each rank's worker
keeps one `Budget` and every buffer that holds checkpoint data in host memory is a named *use*
of it: the staging slots (slot bytes x --max-inflight), lowdiff's batch of diffs held in the
engine, lowdiff+'s replica, gockpt's rolled-forward state. A strategy declares its own uses
through its context (`StrategyContext.host_memory`); tuners choose within what is left
(`room`), and an explicit setting that does not fit is refused (`refuse`, exit code 2).

Torch-free: the launcher, the CLI and the worker import it.
"""

from __future__ import annotations

import re
import threading

from .errors import UsageError

DEFAULT_FRACTION = 0.25  # of the node's available memory at start, when --host-memory is not given
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'8G', '512M', '1.5GiB', '4096' (bytes) -> bytes; units are binary (K = 1024)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 8G, 512M, 1.5GiB, or bytes)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"a size must be positive (got {text!r})")
    return n


def fmt(nbytes: float) -> str:
    """Bytes as people read them: 512 B, 3.2 MiB, 1.50 GiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.{2 if unit in ('GiB', 'TiB') else 1}f} {unit}"
    return f"{int(nbytes)} B"


def node_budget(given: str | None) -> tuple[int, str]:
    """(bytes per node, where the figure comes from) for --host-memory `given` (None: the default)."""
    if given:
        try:
            return parse_size(given), f"--host-memory {given}"
        except ValueError as e:
            raise UsageError(f"--host-memory: {e}") from None
    import psutil

    available = psutil.virtual_memory().available
    return int(available * DEFAULT_FRACTION), f"{DEFAULT_FRACTION:.0%} of {fmt(available)} available at start"


class BudgetError(UsageError):
    """An explicit setting needs more host memory than the budget holds (exit code 2)."""


class Budget:
    """One rank's share of the node's host-memory budget and what uses it (bytes by use).

    `total` 0 means no budget (a configuration from before --host-memory): nothing is refused."""

    def __init__(self, total: int, *, node: int = 0, nlocal: int = 1, source: str = "") -> None:
        self.total, self.node, self.nlocal, self.source = total, node, nlocal, source
        self.uses: dict[str, int] = {}
        self.least: dict[str, int] = {}  # the fewest bytes each use could do with (its smallest setting)
        self.peak = 0
        self.decided: dict[str, str] = {}  # setting -> the line saying the budget decided it
        self._lock = threading.Lock()
        self.changed = False  # a use moved since the figures were last reported (`report`)

    @property
    def limited(self) -> bool:
        return self.total > 0

    @property
    def used(self) -> int:
        return sum(self.uses.values())

    def room(self, use: str) -> int:
        """Bytes `use` may take: the budget less every other use (unbounded without a budget)."""
        if not self.limited:
            return 1 << 62
        return max(0, self.total - sum(n for u, n in self.uses.items() if u != use))

    def room_least(self, use: str) -> int:
        """Bytes `use` may take once every other use is down to its least (a tunable use, such
        as lowdiff's auto batch, shrinks at its next decision)."""
        if not self.limited:
            return 1 << 62
        return max(0, self.total - sum(n for u, n in self.least.items() if u != use))

    def fits(self, use: str, nbytes: int) -> bool:
        return nbytes <= self.room(use)

    def set(self, use: str, nbytes: int, least: int | None = None) -> None:
        """`use` now holds `nbytes` (0 drops it); `least`: what it could do with at its smallest
        setting (default `nbytes`: nothing smaller would do)."""
        with self._lock:
            if nbytes > 0:
                if self.uses.get(use) != nbytes:
                    self.uses[use], self.changed = int(nbytes), True
                self.least[use] = int(nbytes if least is None else least)
            elif self.uses.pop(use, None) is not None:
                self.least.pop(use, None)
                self.changed = True
            self.peak = max(self.peak, self.used)

    @property
    def minimum(self) -> int:
        """The smallest budget the uses seen so far could run in."""
        return sum(self.least.values())

    def claim(self, use: str, nbytes: int, setting: str) -> None:
        """Take `nbytes` for `use`, which `setting` (e.g. '--batch 500') asked for explicitly;
        refuse the run when it does not fit."""
        if not self.fits(use, nbytes):
            self.refuse(setting, use, nbytes)
        self.set(use, nbytes)

    def refuse(self, setting: str, use: str, nbytes: int) -> None:
        others = self.total - self.room(use)
        raise BudgetError(
            f"{setting} does not fit the host-memory budget: {use} needs {fmt(nbytes)}, and {self.describe()} "
            f"has {fmt(self.room(use))} left" + (f" beside {fmt(others)} of other uses" if others else "")
            + "; raise --host-memory or lower the setting")

    def decide(self, setting: str, line: str) -> bool:
        """Record that the budget, not the cost model, decided `setting` (True the first time)."""
        new = self.decided.get(setting) != line
        self.decided[setting] = line
        return new

    def describe(self) -> str:
        per = f"{fmt(self.total)} per rank"
        return f"--host-memory {fmt(self.node)} per node ({per})" if self.nlocal > 1 else f"--host-memory {per}"

    def start_line(self) -> str:
        share = f", {fmt(self.total)} per rank ({self.nlocal} local ranks)" if self.nlocal > 1 else ""
        return (f"host-memory budget: {fmt(self.node)} per node ({self.source}){share}, for the staging slots "
                "and each strategy's host buffers")

    def report(self) -> dict:
        """The figures for the metrics record (bytes)."""
        self.changed = False
        return {"host_memory": self.total, "host_memory_used": self.used, "host_memory_peak": self.peak,
                "host_memory_min": self.minimum, "host_memory_uses": dict(self.uses)}
