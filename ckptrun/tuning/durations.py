"""Durations for `--mtbf 2h`, `--every 90s` and friends, and MTBF from a log of past failures.

Everything the tuning formulas consume is in seconds; this module is the one place where a
human spelling becomes a number of seconds and back.

Accepted duration forms (case-insensitive, surrounding whitespace ignored):

- a plain number means seconds: ``120``, ``1.5``
- a number with a unit: ``500ms``, ``90s``, ``45m``, ``2h``, ``1.5d`` (m = minutes)
- several unit parts, largest first or not: ``1h30m``, ``1h 56m 40s`` (what `format_duration` prints)

Zero, negative, empty, non-finite and unparseable values are rejected with a ValueError that
quotes the input and lists these forms.

Failure log format (`mtbf_from_failure_log`): a text file with one ISO-8601 timestamp per line,
each the moment a failure happened, e.g.::

    # failures of run 42 (comments and blank lines are ignored)
    2024-05-01T03:12:00Z
    2024-05-01 17:40:05+02:00   # node 7 lost its GPU (trailing comments are allowed too)
    2024-05-03T09:00:00

Order does not matter (lines are sorted). Use either all timezone-aware or all naive timestamps.
MTBF = mean gap between consecutive failures = (last - first) / (count - 1).

A timestamp may be followed by the failure's kind, one of KINDS (`2024-05-01T03:12:00Z node`):
`failure_log_kinds` counts them, and `ckptrun tune` splits the MTBF among the kinds as logged
(tuning/levels.py) instead of by its default shares.
"""

from __future__ import annotations

import math
import os
import re
from datetime import datetime

__all__ = ["KINDS", "parse_duration", "format_duration", "mtbf_from_failure_log", "read_failure_log",
           "failure_log_kinds"]

KINDS = ("process", "node", "job")  # the kinds of failure (tuning/levels.py says what each loses)

_UNIT_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_ACCEPTED = "a positive number of seconds (120, 1.5) or with units: 500ms, 90s, 45m, 2h, 1.5d, 1h30m"
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_PLAIN_RE = re.compile(rf"^{_NUMBER}$")
_PART_RE = re.compile(rf"({_NUMBER})\s*(ms|s|m|h|d)(?![a-z])", re.IGNORECASE)


def _bad(text: object, why: str) -> ValueError:
    return ValueError(f"invalid duration {text!r}: {why}; accepted forms: {_ACCEPTED}")


def parse_duration(text: str) -> float:
    """Seconds in `text` (see the module docstring for the forms); ValueError if not positive."""
    if not isinstance(text, str):
        raise TypeError(f"parse_duration expects a string, got {type(text).__name__}")
    s = text.strip()
    if not s:
        raise _bad(text, "it is empty")
    if s.startswith("-"):
        raise _bad(text, "it is negative; a duration must be positive")
    if s.startswith("+"):
        s = s[1:].lstrip()
    if _PLAIN_RE.match(s):
        total = float(s)
    else:
        total, pos = 0.0, 0
        for m in _PART_RE.finditer(s):
            if s[pos : m.start()].strip():  # something that is not a number+unit part
                raise _bad(text, f"cannot read {s[pos:m.start()].strip()!r}")
            total += float(m.group(1)) * _UNIT_SECONDS[m.group(2).lower()]
            pos = m.end()
        if pos == 0 or s[pos:].strip():
            raise _bad(text, "it is not a number with an optional unit")
    if not math.isfinite(total):
        raise _bad(text, "it is too large")
    if total <= 0:
        raise _bad(text, "it is zero; a duration must be positive")
    return total


def format_duration(seconds: float) -> str:
    """Short human form: ``500ms``, ``2.5s``, ``1h 56m 40s``, ``1d 12h`` (whole seconds from 1 min up)."""
    if not math.isfinite(seconds):
        raise ValueError(f"cannot format a non-finite duration: {seconds!r}")
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds == 0:
        return "0s"
    if seconds < 1e-6:
        return f"{seconds:.3g}s"
    if round(seconds * 1e3, 1) < 1000:
        return f"{round(seconds * 1e3, 1):g}ms"
    if round(seconds, 2) < 60:
        return f"{round(seconds, 2):g}s"
    rest = int(round(seconds))
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, rest = divmod(rest, size)
        if count:
            parts.append(f"{count}{unit}")
    return " ".join(parts)


def parse_timestamp(text: str) -> datetime:
    # Python < 3.11 does not read a trailing "Z" (UTC) in fromisoformat.
    if text[-1:] in "zZ":
        text = text[:-1] + "+00:00"
    return datetime.fromisoformat(text)


def _read_log(path: str | os.PathLike[str]) -> list[tuple[datetime, str | None]]:
    """(timestamp, kind or None) of every failure in a failure log, sorted; ValueError naming
    the line where it cannot be read."""
    stamps: list[tuple[datetime, str | None, int]] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, raw in enumerate(fh, start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            head, _, last = line.rpartition(" ")
            kind = last.lower() if head.strip() and last.lower() in KINDS else None
            text = head.strip() if kind else line
            try:
                stamps.append((parse_timestamp(text), kind, lineno))
            except ValueError:
                raise ValueError(
                    f"{os.fspath(path)}:{lineno}: {line!r} is not an ISO-8601 timestamp "
                    f"(e.g. 2024-05-01T03:12:00Z), optionally followed by a kind: {', '.join(KINDS)}"
                ) from None
    aware = [ts.tzinfo is not None for ts, _, _ in stamps]
    if any(aware) and not all(aware):
        odd = next(lineno for (_, _, lineno), a in zip(stamps, aware, strict=True) if a != aware[0])
        raise ValueError(
            f"{os.fspath(path)}:{odd}: mixes timestamps with and without a timezone; use one form"
        )
    return sorted(((ts, kind) for ts, kind, _ in stamps), key=lambda tk: tk[0])


def read_failure_log(path: str | os.PathLike[str]) -> list[datetime]:
    """The failure timestamps of a failure log (format above), sorted; ValueError naming the line
    where it cannot be read."""
    return [ts for ts, _ in _read_log(path)]


def failure_log_kinds(path: str | os.PathLike[str]) -> dict[str, int]:
    """How many failures of each kind the log names (kinds no line names are absent)."""
    counts: dict[str, int] = {}
    for _, kind in _read_log(path):
        if kind:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def mtbf_from_failure_log(path: str | os.PathLike[str]) -> float:
    """Mean time between failures, in seconds, from a file of failure timestamps (format above)."""
    times = read_failure_log(path)
    if len(times) < 2:
        raise ValueError(
            f"{os.fspath(path)}: need at least two failure timestamps to compute an MTBF, "
            f"found {len(times)}"
        )
    span = (times[-1] - times[0]).total_seconds()
    if span <= 0:
        raise ValueError(f"{os.fspath(path)}: all failure timestamps are identical; MTBF is undefined")
    return span / (len(times) - 1)
