"""lowdiff+: layer-wise gradient snapshots in backward, a CPU replica in the engine updated with
them, the replica persisted every P steps, a worker crash recovered from the engine's memory.

Torch-free: the registry imports this package for its options.
"""

from ..options import Option

PERSIST_EVERY = Option(
    "persist_every", "auto",
    "steps between writes of the engine's replica to disk, or auto (the waste model of machine losses: Daly's "
    "interval for the write time and --mtbf / --hw-failure-share, never faster than the disk drains; re-measured).",
    ints=(1, 10**9))
HW_FAILURE_SHARE = Option(
    "hw_failure_share", "0.5",
    "share of failures that lose the machine and the engine's replica with it (the rest resume from memory); "
    "sets --persist-every auto.", fraction=True)
REBASE_EVERY = Option(
    "rebase_every", "auto",
    "steps between full snapshots that replace the replica (bounds CPU/GPU rounding drift); 0 never; auto: never "
    "on CPU, 100 on a GPU.", ints=(0, 10**9))
OPTIONS = (PERSIST_EVERY, HW_FAILURE_SHARE, REBASE_EVERY)
