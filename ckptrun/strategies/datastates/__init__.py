"""datastates (DataStates-LLM): lazy snapshots copied to a reused host cache while the next
forward/backward runs (the update waits only for what is not yet copied), state providers that
stream tensors as zero-copy chunks and serialize objects on the side, and one self-describing
file per rank with its header at the end, written chunk by chunk as the snapshot fills.

Torch-free: the registry imports this package for its options.
"""

from ..options import Option

STREAM_MB = Option("stream_mb", "4", "how many MB of copied tensors the trainer announces to the engine at once: "
                                   "each announced chunk is written while the rest is still being copied.",
                  ints=(1, 4096))
OPTIONS = (STREAM_MB,)
