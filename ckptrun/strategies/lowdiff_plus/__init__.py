"""lowdiff+: layer-wise gradient snapshots in backward, a CPU replica in the engine updated with
them, the replica persisted every P steps, a worker crash recovered from the engine's memory.

Torch-free: the registry imports this package for its options.
"""

from ..options import Option

OPTIONS = (
    Option("persist_every", "auto", "steps between writes of the engine's replica to disk, or auto (as often "
                                    "as the disk drains it, re-measured)."),
    Option("rebase_every", "auto", "steps between full snapshots that replace the replica (bounds CPU/GPU "
                                   "rounding drift); 0 never; auto: never on CPU, 100 on a GPU."),
)
