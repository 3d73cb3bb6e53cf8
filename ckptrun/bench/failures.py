"""When `ckptrun bench --failures` kills a run: a kill schedule, drawn or replayed, and the
failure trace it is written as.

A schedule is a list of offsets (seconds after a run's launch). Drawn: exponential gaps with a
given MTBF from a seeded generator, so one seed gives every configuration the same kills. A
trace is the schedule as a failure log (`tuning.durations`: one ISO-8601 timestamp per line, what
`ckptrun tune --failure-log` reads) after a `# ckptrun-bench-start <timestamp>` line that fixes the
origin; `--failure-log` replays one. A foreign failure log has no such line: its origin is one
mean gap before its first failure, so its first kill comes as far into the run as its others are
apart.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from ..errors import UsageError
from ..tuning.durations import format_duration, parse_timestamp, read_failure_log

START_MARK = "# ckptrun-bench-start"


@dataclass(frozen=True)
class Schedule:
    """Kill offsets (s after launch, increasing) within a run of `duration_s`, and where they came from."""

    offsets: tuple[float, ...]
    duration_s: float
    source: str  # "MTBF 30s, seed 0" or the replayed file

    @classmethod
    def draw(cls, mtbf_s: float, duration_s: float, seed: int) -> Schedule:
        """Exponential gaps of mean `mtbf_s` until `duration_s`, from `seed` alone."""
        rng, t, out = random.Random(seed), 0.0, []
        while True:
            t += rng.expovariate(1.0 / mtbf_s)
            if t >= duration_s:
                return cls(tuple(out), duration_s, f"MTBF {format_duration(mtbf_s)}, seed {seed}")
            out.append(t)

    @classmethod
    def replay(cls, path: Path, duration_s: float) -> Schedule:
        """The kills of a failure trace that fall within `duration_s` of its origin (see above)."""
        try:
            times = read_failure_log(path)
            origin = _origin(path)
        except (OSError, ValueError) as e:
            raise UsageError(f"--failure-log {path}: {e}") from None
        if not times:
            raise UsageError(f"--failure-log {path}: no failure timestamps in it")
        if origin is None:
            if len(times) < 2:
                raise UsageError(f"--failure-log {path}: one failure and no `{START_MARK}` line; the origin of "
                                 "its schedule is unknown (add the line, or give two failures or more)")
            origin = times[0] - (times[-1] - times[0]) / (len(times) - 1)
        if (origin.tzinfo is None) != (times[0].tzinfo is None):
            raise UsageError(f"--failure-log {path}: its start line and its failures differ in having a timezone")
        offsets = [(t - origin).total_seconds() for t in times]
        if offsets[0] < 0:
            raise UsageError(f"--failure-log {path}: a failure precedes its `{START_MARK}` line")
        return cls(tuple(o for o in offsets if o < duration_s), duration_s, str(path))

    def write_trace(self, path: Path, start: datetime | None = None) -> None:
        """This schedule as a failure trace (`--failure-log` replays it exactly)."""
        start = start or datetime.now(timezone.utc)
        lines = [f"{START_MARK} {start.isoformat()}", f"# {self.source}, {len(self.offsets)} kills in "
                 f"{format_duration(self.duration_s)}"]
        lines += [(start + timedelta(seconds=o)).isoformat() for o in self.offsets]
        path.write_text("\n".join(lines) + "\n")


def _origin(path: Path) -> datetime | None:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith(START_MARK):
            text = line[len(START_MARK):].strip()
            try:
                return parse_timestamp(text)
            except ValueError:
                raise ValueError(f"{START_MARK} {text!r} is not an ISO-8601 timestamp") from None
    return None
