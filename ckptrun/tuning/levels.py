"""The multi-level interval model: per kind of failure, the tier it recovers from, and per tier
its interval and its expected waste.

After SCR's model (Moody, Bronevetsky, Mohror, de Supinski, "Design, Modeling, and Evaluation
of a Scalable Multi-level Checkpointing System", SC'10), to first order: each kind of failure
destroys the tiers below some level, and the run resumes from the newest step of the fastest
tier that survives it. A tier's copies cost the run c each, every T seconds; the failures that
recover from it (rate λ) each lose T/2 of work plus the copy's lag and the restart. Its waste
per unit of time, c/T + λ·(T/2 + lag + restart), is separable across tiers, so each tier's
optimum is Young's interval for its own cost and its own MTBF 1/λ (Daly's refinement and
CheckFreq's bound, never more often than the copies drain, applied on top), and a tier is never
copied more often than the tier below it has steps (it copies one of them). SCR's full model
adds failures during recovery; at the rates ckptrun plans for (MTBF >> interval) its first
order is this one. A tier that no failure needs (λ = 0) is copied only as often as asked, at
the end of the run otherwise.

Kinds (DESIGN §4): `process` (a worker or engine dies; the node's memory and disk stay),
`node` (a machine is lost with its memory and its local disk), `job` (the whole job, or the
storage under --dir, is lost). Tiers, fastest first: `memory` (the engine's host memory),
`disk` (--dir; a lost node's part also comes back from partners with --replicas > 1),
`remote` (--durable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .durations import KINDS, format_duration
from .intervals import check_positive, expected_lost_work_s, tier_interval_steps

__all__ = ["KINDS", "DEFAULT_SHARES", "FailureRates", "Layout", "Level", "LevelPlan", "LevelsPlan",
           "failure_rates", "rates_for", "plan_levels", "durable_every"]

# The split of --mtbf when no kind is given on its own: half the failures leave the machine (a
# crash, an OOM, a NaN), half lose it (node + job: the share that lost --dir before these rates).
DEFAULT_SHARES = {"process": 0.5, "node": 0.4, "job": 0.1}
HOUR = 3600.0
ROUNDING = 1e-2  # relative slack between --mtbf and its kinds: durations written to whole seconds (recipes)


@dataclass(frozen=True)
class FailureRates:
    """Failures per second of each kind, and where the numbers came from (said in the output)."""

    process: float
    node: float
    job: float
    source: str

    def of(self, kind: str) -> float:
        return getattr(self, kind)

    @property
    def total(self) -> float:
        return self.process + self.node + self.job


def failure_rates(mtbf_s: float, given: dict[str, float], *, mtbf_given: bool = True, source: str = "--mtbf",
                  shares: dict[str, float] | None = None) -> FailureRates:
    """The rates from the MTBF of all failures `mtbf_s` and the MTBFs of the kinds `given`
    (kind -> seconds; each taken as given). The kinds not given share what `mtbf_s` leaves in
    the proportions `shares` (a failure log's, else DEFAULT_SHARES); with `mtbf_given` False
    (`mtbf_s` is the default), each takes its default share of it instead. ValueError if the
    given kinds fail more often than `mtbf_s` (beyond ROUNDING), or all three disagree with it."""
    check_positive("mtbf", mtbf_s)
    rates = {k: 1.0 / check_positive(f"--mtbf-{k}", s) for k, s in given.items()}
    logged = shares is not None
    shares = shares or DEFAULT_SHARES
    rest = [k for k in KINDS if k not in given]
    if not rest:
        if mtbf_given and not math.isclose(sum(rates.values()), 1.0 / mtbf_s, rel_tol=ROUNDING):
            raise ValueError("--mtbf-process, --mtbf-node and --mtbf-job disagree with --mtbf, which counts every "
                             "failure; drop one")
        return FailureRates(**rates, source=", ".join(f"--mtbf-{k} {format_duration(v)}" for k, v in given.items()))
    share = sum(shares.get(k, 0.0) for k in rest)
    left = 1.0 / mtbf_s - sum(rates.values()) if mtbf_given else share / mtbf_s
    if left < -ROUNDING / mtbf_s:
        named = ", ".join(f"--mtbf-{k}" for k in given)
        raise ValueError(f"{named} fail more often than --mtbf, which counts every failure; raise --mtbf or drop it")
    for k in rest:
        rates[k] = max(0.0, left) * shares.get(k, 0.0) / share if share else 0.0
    if mtbf_given:
        split = ", ".join(f"{k} {shares.get(k, 0.0) / share if share else 0.0:.0%}" for k in rest)
        said = f"{'the rest of ' if given else ''}{source} split {'as logged' if logged else 'by default'}: {split}"
    else:
        split = ", ".join(f"{k} {DEFAULT_SHARES[k]:.0%}" for k in rest)
        said = f"default shares of {source}: {split}"
    return FailureRates(**rates, source="; ".join([*(f"--mtbf-{k} {format_duration(v)}" for k, v in given.items()),
                                                   said]))


def rates_for(mtbf_s: float, per_kind: dict[str, float], default_mtbf_s: float, source: str = "",
              logged: dict[str, int] | None = None) -> FailureRates:
    """`failure_rates` from flags as given (0: not given): --mtbf (`source` says where it came
    from, when not the flag: a failure log, whose counts per kind `logged` set the split),
    --mtbf-KIND; without --mtbf, the default MTBF's shares."""
    given = {k: v for k, v in per_kind.items() if v}
    if mtbf_s:
        shares = {k: n / sum(logged.values()) for k, n in logged.items()} if logged else None
        return failure_rates(mtbf_s, given, source=source or f"--mtbf {format_duration(mtbf_s)}", shares=shares)
    return failure_rates(default_mtbf_s, given, mtbf_given=False,
                         source=f"the default MTBF {format_duration(default_mtbf_s)}")


@dataclass(frozen=True)
class Layout:
    """Where a lost node's part comes back from: partners' memory (--replicas > 1), a --dir that
    outlives the node (unless --node-local-dir), else only the remote tier."""

    replicas: int = 1
    node_local_dir: bool = False

    def survives(self, tier: str) -> tuple[str, ...]:
        """The kinds of failure after which `tier` still holds its steps (the memory tier of a
        strategy that has one is copied to partners with --replicas > 1)."""
        if tier == "memory":
            return ("process", "node") if self.replicas > 1 else ("process",)
        if tier == "disk":
            return ("process", "node") if self.replicas > 1 or not self.node_local_dir else ("process",)
        return KINDS

    def memory_lost_share(self, rates: FailureRates) -> float:
        """The share of failures after which no engine's memory holds the step: node and job
        ones, or with --replicas > 1 job ones only (a lost node's state comes back from its
        partners' memory). The disk tier of a memory-first run (`--persist-every auto`) is
        planned for these; job failures count too, as a job lost with its --dir intact resumes
        from it."""
        return (rates.job + (0.0 if self.replicas > 1 else rates.node)) / rates.total


@dataclass(frozen=True)
class Level:
    """One tier of a run: its copies' cost to the run and lag, the restart from it, and its
    interval in steps when it is fixed (an explicit flag, or the strategy's own setting)."""

    tier: str  # memory | disk | remote
    flag: str  # the run option that sets its interval
    cost_s: float  # what one copy costs the run: a blocking time, or the copy's duration beside training
    copy_s: float  # how long one copy takes to complete (never copied more often than that)
    restart_s: float = 0.0  # resuming from it
    every: int | None = None  # fixed: kept as is; None: the model's


@dataclass(frozen=True)
class LevelPlan:
    level: Level
    kinds: tuple[str, ...]  # the failures that resume from this tier
    rate_per_h: float
    every: int | None  # steps between copies; None: no failure needs it (copied at the end)
    why: str
    copies_s_per_h: float  # seconds of each run hour spent on its copies
    failures_s_per_h: float  # seconds of each run hour lost to the failures it recovers (work + restart)

    @property
    def waste_s_per_h(self) -> float:
        return self.copies_s_per_h + self.failures_s_per_h


@dataclass(frozen=True)
class LevelsPlan:
    step_s: float
    rates: FailureRates
    layout: Layout
    levels: list[LevelPlan]
    uncovered: tuple[str, ...]  # kinds no tier of the run survives: each one starts the run over
    uncovered_per_h: float

    @property
    def waste_s_per_h(self) -> float:
        return sum(lp.waste_s_per_h for lp in self.levels)


def _recovers(levels: list[Level], layout: Layout) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
    """Per level, the kinds whose fastest surviving tier it is; and the kinds none survives."""
    taken: set[str] = set()
    out = []
    for lv in levels:
        mine = tuple(k for k in layout.survives(lv.tier) if k not in taken)
        taken.update(mine)
        out.append(mine)
    return out, tuple(k for k in KINDS if k not in taken)


def _interval(lv: Level, rate: float, step_s: float, below: int | None) -> tuple[int | None, str]:
    """(steps, why) of one tier: as fixed, else Daly's interval for its copy against its own
    failures within CheckFreq's bound, never more often than (and a multiple of) the tier below."""
    if lv.every is not None:
        return lv.every, "given"
    if rate <= 0:
        return None, "no failure resumes from it: copied at the end of the run only"
    every, why = tier_interval_steps(lv.cost_s, lv.copy_s, step_s, 1.0 / rate)
    if below and every % below:
        every, why = math.ceil(every / below) * below, f"{why}; a multiple of the {below} steps of the tier below"
    return every, why


def plan_levels(levels: list[Level], rates: FailureRates, layout: Layout, step_s: float) -> LevelsPlan:
    """Every tier's interval and waste per hour (module docstring); `levels` fastest first."""
    check_positive("step_s", step_s)
    kinds, uncovered = _recovers(levels, layout)
    plans, below = [], None
    for lv, mine in zip(levels, kinds, strict=True):
        rate = sum(rates.of(k) for k in mine)
        every, why = _interval(lv, rate, step_s, below)
        copies = failures = 0.0
        if every is not None:
            t = every * step_s
            copies = HOUR * lv.cost_s / t
            failures = HOUR * rate * (expected_lost_work_s(t) + lv.copy_s + lv.restart_s)
            below = every
        plans.append(LevelPlan(lv, mine, HOUR * rate, every, why, copies, failures))
    return LevelsPlan(step_s, rates, layout, plans, uncovered, HOUR * sum(rates.of(k) for k in uncovered))


def durable_every(upload_s: float, step_s: float, rates: FailureRates, layout: Layout) -> tuple[int | None, str]:
    """(steps, why) of `--durable-every auto`: the remote tier's interval in `plan_levels` for an
    upload of `upload_s` written beside training, the run's --dir below it."""
    remote = Level("remote", "--durable-every", upload_s, upload_s)
    disk = Level("disk", "--every", 0.0, 0.0, every=1)
    lp = plan_levels([disk, remote], rates, layout, step_s).levels[1]
    return lp.every, lp.why
