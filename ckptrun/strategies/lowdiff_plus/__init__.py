"""lowdiff+: layer-wise gradient snapshots in backward, a CPU replica in the engine updated with
them, the replica persisted every P steps, a worker crash recovered from the engine's memory.

Torch-free: the registry imports this package for its options.
"""

from ...errors import UsageError
from ..options import Option

PERSIST_EVERY = Option(
    "persist_every", "auto",
    "steps between writes of the engine's replica to disk, or auto (the waste model of machine losses: Daly's "
    "interval for the write time and --mtbf / --hw-failure-share, never faster than the disk drains; re-measured).",
    ints=(1, 10**9))
HW_FAILURE_SHARE = Option(
    "hw_failure_share", "auto",
    "share of failures that lose the machine and the engine's replica with it (the rest resume from memory); "
    "sets --persist-every auto. auto: node and job failures among all (--mtbf-KIND; 0.5 by default).",
    fraction=True)
REBASE_EVERY = Option(
    "rebase_every", "auto",
    "steps between full snapshots that replace the replica (bounds CPU/GPU rounding drift); 0 never; auto: never "
    "on CPU, 100 on a GPU.", ints=(0, 10**9))
OPTIONS = (PERSIST_EVERY, HW_FAILURE_SHARE, REBASE_EVERY)


def explicit_every(options: dict, every: int) -> dict:
    """--every N given: every multiple of N must be on disk when the run ends, so the replica is
    persisted every N steps (--persist-every left unset or auto), or every P steps for a given P
    that divides N; any other P is refused."""
    given = PERSIST_EVERY.integer(options)
    if given is None:
        return {**options, PERSIST_EVERY.name: str(every)}
    if every % given:
        raise UsageError(f"{PERSIST_EVERY.flag} {given} with --every {every}: lowdiff+ writes its replica to disk "
                         f"only every {PERSIST_EVERY.flag} steps, so step {every} would not be restorable; give "
                         f"{PERSIST_EVERY.flag} a divisor of {every} (or leave it unset: it follows --every)")
    return options
