"""The memory tier: a step held in the checkpoint engine's memory every step, written to disk
every P steps (`--persist-every`). lowdiff+ holds its CPU replica there; a snapshot strategy
(`checkfreq`, `sync`) given `--persist-every` holds its newest snapshot's staging slot
(`ckptrun/engine/held.py`). A worker crash resumes from the engine's memory; a lost machine from
the newest write. The waste model (`model.py`) and the auto interval (`policy.py`) are shared.

Torch-free: the registry imports this package for its options.
"""

from ...errors import UsageError
from ..options import Option

PERSIST_HELP = ("steps between writes to disk of the state the engine holds in memory every step, or auto (the "
                "waste model of machine losses: Daly's interval for the write time and --mtbf, never faster than "
                "the disk drains; re-measured)")
# lowdiff+: its replica is the memory tier, so unset means auto.
REPLICA_PERSIST_EVERY = Option("persist_every", "auto", PERSIST_HELP + "; unset: auto.", ints=(1, 10**9))
# A snapshot strategy: unset keeps one tier (every checkpoint written); given, each step is held in
# memory and every P-th written.
SNAPSHOT_PERSIST_EVERY = Option(
    "persist_every", None, "the same; unset: every checkpoint is written, none held in memory.",
    ints=(1, 10**9))


# `ckptrun tune`'s row of checkfreq given --persist-every (Entry.tuning_variants): its measured
# checkpoint cost is the snapshot a held step costs every step. sync's is its blocking write, which
# with --persist-every it pays only every P steps, so no row of sync's is planned from it.
TUNED_VARIANT = ("persist", "ckptrun.strategies.memory_first.tuning:SNAPSHOT")

HELD_WHY = (" and, with --replicas, the one before (a partner's copy of a lost node's newest step may not "
            "have left it)")


def least_slots(replicas: int) -> int:
    """The fewest staging slots a snapshot strategy holding its steps works with: the newest
    step's, with --replicas the step before's (engine/held.py), and the next capture's."""
    return 3 if replicas > 1 else 2


def replica_every(options: dict, every: int) -> dict:
    """lowdiff+ with --every N: P = N unless given (see `_divisor`)."""
    if REPLICA_PERSIST_EVERY.integer(options) is None:
        return {**options, "persist_every": str(every)}
    return _divisor(options, every)


def snapshot_every(options: dict, every: int) -> dict:
    """A snapshot strategy with --every N: one tier while --persist-every is unset; auto is P = N."""
    raw = options.get("persist_every")
    if raw is None:
        return options
    if raw == "auto":
        return {**options, "persist_every": str(every)}
    return _divisor(options, every)


def _divisor(options: dict, every: int) -> dict:
    """--every N given: every multiple of N must be on disk when the run ends, so a given P must
    divide N; any other P is refused."""
    given = REPLICA_PERSIST_EVERY.integer(options)
    flag = REPLICA_PERSIST_EVERY.flag
    if every % given:
        raise UsageError(f"{flag} {given} with --every {every}: the engine writes the state it holds in memory "
                         f"to disk only every {flag} steps, so step {every} would not be restorable; give "
                         f"{flag} a divisor of {every} (or leave it unset)")
    return options
