"""The run's overhead budget (`--max-overhead`, DESIGN §6): what checkpointing costs the training
loop, measured against the no-checkpoint step, in one figure that every save decision keeps.

The cost counts both ways a checkpoint slows training: stall on the training thread (the hooks'
waits, measured per cause) and the slowdown of the step itself (copies and the engine's writes
competing for the cores and memory bandwidth the step uses). Both are in a step's wall time, so
the overhead over a window of steps is `mean(step wall time) / no-checkpoint step - 1`.

The no-checkpoint step (`Baseline`) is measured, as `ckptrun tune` measures it, by running steps
without checkpointing: the first `PROBE_STEPS` optimizer steps of a fresh run take no checkpoint
at all (the strategy starts after them, as if the run began there); the trimmed mean of them but
the first (which holds the script's warm-up) is the baseline. Later, steps with nothing of a
checkpoint in flight (no snapshot begun, every snapshot durable, no stall beyond the hooks' own
check) are no-checkpoint steps too, and the baseline follows their trimmed mean: a checkpoint's
cost is the sum of its window's steps less that many baselines, so a baseline off by a few percent
is charged to every step of an interval (on the wide model, steps of 2.1-4.8 s against a probe's
fastest 2.78 s read a 4 s checkpoint as 40 s). A strategy that works every step has no such step:
its baseline is the probe's. A restarted worker reads the baseline its predecessor kept
(`kept.py`), so a recovery does not probe again.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from statistics import median, median_low
from typing import Any

from ..strategies.save_policy import Measured
from ..tuning.durations import format_duration
from ..tuning.intervals import checkfreq_min_interval_steps
from .kept import Kept

PROBE_STEPS = 5  # a fresh run's first steps, taken without checkpointing (the first is left out)
QUIET_KEPT = 32  # no-checkpoint steps seen later: the baseline is their trimmed mean...
QUIET_MIN = 6  # ...once this many were seen
MOVE = 0.01  # relative change of that mean that replaces the baseline (and rewrites the kept file)
SHIFT = 0.25  # the newest QUIET_MIN's median this far off: the step changed, the older ones are dropped
QUIET_STALL = 0.01  # a step whose stall is under this share of it is quiet (the hooks' due check)
REPORT_EVERY = 10  # steps between the run's overhead reports (and one at the end)
TOLERANCE = 0.2  # measured overhead within budget * (1 + this) counts as within (the noise of a step)


class Baseline:
    """The no-checkpoint step time of this rank (seconds), or None until measured; kept for a
    restarted worker (`Kept`)."""

    def __init__(self, kept: Kept | None = None) -> None:
        self.kept = kept or Kept()
        self.step_s: float | None = self.kept.number("step_s")
        self._probe: list[float] = []
        self._quiet: deque[float] = deque(maxlen=QUIET_KEPT)

    def probed(self, step_s: float, last: bool) -> None:
        """A probe step took `step_s`; at the `last` one the baseline is their trimmed mean (the
        first left out: it holds the warm-up). Not the fastest: a step's own time varies (the wide
        model's by a factor of two, its allocator's page faults), and the fastest is an outlier."""
        self._probe.append(step_s)
        if last:
            self._set(trimmed_mean(self._probe[1:] or self._probe))

    def quiet(self, step_s: float) -> bool:
        """A later step with nothing of a checkpoint in flight: True when the step changed (what
        was measured before describes the old one)."""
        self._quiet.append(step_s)
        if len(self._quiet) < QUIET_MIN:
            return False
        newest = list(self._quiet)[-QUIET_MIN:]
        shifted = self.step_s is not None and abs(median(newest) - self.step_s) > SHIFT * self.step_s
        if shifted:  # keep only the newest near their median: a mean across the change would lag it
            center = median_low(newest)  # (one of them: at least it is kept)
            self._quiet = deque((s for s in newest if abs(s - center) <= SHIFT * center), maxlen=QUIET_KEPT)
        mean = trimmed_mean(self._quiet)
        if self.step_s is None or abs(mean - self.step_s) > MOVE * self.step_s:
            self._set(mean)
        return shifted

    def _set(self, step_s: float) -> None:
        self.step_s = step_s
        self.kept.set("step_s", step_s)


class Watch:
    """The budget as a worker keeps it: the no-checkpoint step (`Baseline`, probed at a fresh
    run's start), the overhead (a metrics event `{"type": "overhead"}` the dashboard shows), and
    two verdicts, each said once.

    It reports the run's overhead so far every REPORT_EVERY steps and at the end (`report`).
    Verdicts:
    - an explicit `--every N` (never changed): what it costs against the budget, and the
      interval that would keep within it;
    - a strategy still over budget at an evaluation that changed nothing (its mechanism works
      every step: nothing is left to thin): said with the strategy that would keep within it
      (metrics event `{"type": "budget", "verdict": "over"}`).
    """

    def __init__(self, budget: float, baseline: Baseline, *, strategy: str, instead: str, every_step: bool = False,
                 explicit_every: int | None = None, say: Callable[[str, bool], None] = lambda line, warn: None,
                 emit: Callable[..., None] = lambda **event: None) -> None:
        self.budget, self.baseline = budget, baseline
        self.strategy, self.instead, self.explicit_every = strategy, instead, explicit_every
        self.every_step = every_step  # the strategy's mechanism works every step (`Strategy.every_step`)
        self.probe_until = 0
        self._say, self._emit = say, emit
        self.said: set[str] = set(baseline.kept.words("said"))  # (a restarted worker's predecessor's too)
        self._over_before = False  # the last evaluation found it over budget, and changed nothing
        self.measured = False  # an evaluation saw a written checkpoint's cost (`_disk_behind`, `_cost_due`)
        self._seen, self._steps, self._step_s, self._stall_s = 0, 0, 0.0, 0.0  # since the probe: `run_overhead`

    def base_step_s(self, records: list[tuple]) -> float | None:
        """The no-checkpoint step for the window `records` ((step_s, stall_s, ...) each): the
        baseline, or, before one was measured under an explicit --every (no probe: its steps are
        due), the window's median step less its stall (the step's own slowdown then uncounted)."""
        if self.baseline.step_s is not None or self.explicit_every is None or not records:
            return self.baseline.step_s
        return median(r[0] - r[1] for r in records)

    def start_probe(self, step: int) -> bool:
        """A fresh run at `step`: probe the no-checkpoint step unless it is known already."""
        if self.baseline.step_s is not None:
            return False
        self.probe_until = step + PROBE_STEPS
        return True

    def end_probe(self, step: int) -> None:
        """The run stops during the probe: it ends at `step` (measured or not)."""
        self.probe_until = min(self.probe_until, step)

    def observe(self, step: int, record: dict[str, Any], checkpointed: bool) -> bool:
        """Fold in a step's metrics record; True for a probe step or one that found the step
        itself changed (either way, what the cost window holds no longer describes it)."""
        if step <= self.probe_until:
            self.baseline.probed(record["step_s"], last=step == self.probe_until)
            return True
        stall = sum((record.get("stall_s") or {}).values())
        shifted = False
        if not checkpointed and stall <= QUIET_STALL * record["step_s"] and not record.get("inflight"):
            shifted = self.baseline.quiet(record["step_s"])
        self._seen += 1
        if self._seen > 1:  # (a worker's first step holds its set-up: left out)
            self._steps, self._step_s, self._stall_s = self._steps + 1, self._step_s + record["step_s"], \
                self._stall_s + stall
            if self._steps % REPORT_EVERY == 0:
                self.report(step)
        return shifted

    def run_overhead(self) -> float | None:
        """The overhead of every step since the probe (a restarted worker: since it began), the
        first left out, against the baseline (or, before one, the steps less their stall)."""
        if not self._steps:
            return None
        base = self.baseline.step_s or (self._step_s - self._stall_s) / self._steps
        return self._step_s / self._steps / base - 1 if base > 0 else None

    def report(self, step: int) -> None:
        """The run's overhead so far, for the dashboard and the summary (every REPORT_EVERY steps
        and at the end): metrics event {"type": "overhead"}."""
        overhead = self.run_overhead()
        if overhead is not None:
            self._emit(type="overhead", step=step, overhead=overhead, budget=self.budget,
                       base_s=self.baseline.step_s)

    def evaluate(self, step: int, m: Measured, changed: bool) -> None:
        """At a re-tuner evaluation: the verdicts due, from the window's overhead."""
        if m.overhead is None or m.base_step_s is None:
            return
        self.measured = self.measured or (m.cost_s is not None and m.persist_s is not None)
        if m.cost_s is None and not self.every_step:  # no checkpoint in the window
            return
        if self.explicit_every is not None:
            self._explicit(step, m) if m.cost_s is not None else None
            return
        over = not changed and not within(m.overhead, self.budget)
        if over and (self.every_step or self._over_before):  # (an interval gets a second look)
            self._over(step, m)
        self._over_before = over

    def _first_time(self, verdict: str) -> bool:
        """Is `verdict` said now for the first time in the run (a restarted worker's too)?"""
        if verdict in self.said:
            return False
        self.said.add(verdict)
        self.baseline.kept.set("said", sorted(self.said))
        return True

    def _explicit(self, step: int, m: Measured) -> None:
        if not self._first_time("explicit"):
            return
        every = self.explicit_every
        fits = interval_within(m.cost_s, m.base_step_s, self.budget)
        if m.persist_s:
            fits = max(fits, checkfreq_min_interval_steps(m.persist_s, m.base_step_s))
        what = "stall only: no step ran without checkpointing" if self.baseline.step_s is None else \
            "stall and slowdown"
        cost = (f"--every {every} costs {percent(m.overhead)} of the step against --max-overhead "
                f"{percent(self.budget)} (measured by step {step}, {what}: a checkpoint costs "
                f"{format_duration(m.cost_s)} against a {format_duration(m.base_step_s)} step)")
        if within(m.overhead, self.budget):
            self._say(f"{cost}: within budget", False)
        else:
            self._say(f"warning: {cost}; kept as given: --every {fits} would keep within it", True)
        self._emit(type="budget", verdict="explicit", step=step, every=every, fits=fits, overhead=m.overhead,
                   budget=self.budget)

    def _over(self, step: int, m: Measured) -> None:
        if not self._first_time("over"):
            return
        if self.every_step:
            why, fix = "its mechanism works every step", f"--strategy {self.instead} keeps within it (its " \
                "interval follows the budget)"
        else:
            why, fix = "after re-tuning its settings", "give --every N or a larger --max-overhead"
        self._say(f"warning: --strategy {self.strategy} costs {percent(m.overhead)} of the step here, "
                  f"over --max-overhead {percent(self.budget)} ({why}; measured by step {step} against a "
                  f"{format_duration(m.base_step_s)} step without checkpointing); {fix}", True)
        self._emit(type="budget", verdict="over", step=step, strategy=self.strategy, instead=self.instead,
                   overhead=m.overhead, budget=self.budget)


def trimmed_mean(values: Iterable[float]) -> float:
    """The mean without the fastest and the slowest (one stray step, a collection or a swap-in,
    does not move the baseline); the mean, not the median, as a cost is a sum of steps."""
    ordered = sorted(values)
    return sum(ordered[1:-1]) / (len(ordered) - 2) if len(ordered) > 2 else sum(ordered) / len(ordered)


def interval_within(cost_s: float, base_s: float, budget: float) -> int:
    """The fewest steps between checkpoints that keep a checkpoint costing `cost_s` (stall and
    slowdown together) within `budget` of a `base_s` step: ceil(cost / (budget * step))."""
    return max(1, math.ceil(cost_s / (budget * base_s) - 1e-9))


def within(overhead: float, budget: float) -> bool:
    return overhead <= budget * (1 + TOLERANCE)


def percent(fraction: float) -> str:
    return f"{fraction:.1%}"
