"""lowdiff+: layer-wise gradient snapshots in backward, a CPU replica in the engine updated with
them, the replica persisted every P steps, a worker crash recovered from the engine's memory.

Torch-free: the registry imports this package for its options.
"""

from ..memory_first import REPLICA_PERSIST_EVERY
from ..options import Option

HW_FAILURE_SHARE = Option(
    "hw_failure_share", "auto",
    "share of failures that lose the machine and the engine's replica with it (the rest resume from memory); "
    "sets --persist-every auto. auto: node and job failures among all (--mtbf-KIND; 0.5 by default), job "
    "failures only with --replicas > 1 (a lost node's replica comes back from its partners).",
    fraction=True)
REBASE_EVERY = Option(
    "rebase_every", "auto",
    "steps between full snapshots that replace the replica (bounds CPU/GPU rounding drift); 0 never; auto: never "
    "on CPU; on a GPU every 100 steps and at each step written (persisted, or final), so that every record written "
    "is the device's own state.", ints=(0, 10**9))
OPTIONS = (REPLICA_PERSIST_EVERY, HW_FAILURE_SHARE, REBASE_EVERY)

