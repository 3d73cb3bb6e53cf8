"""pccheck (PCcheck, ASPLOS'25): several checkpoints in flight, each streamed chunk by chunk
into a preallocated slotted region by parallel writers, committed by a compare-and-swap of the
region's pointer (trainer side, engine side, save decision, tuning model).

Torch-free: the registry imports this package for its options.
"""

from ..options import Option

CKPT_WRITERS = Option("ckpt_writers", "2",
                      "writer threads per checkpoint (the paper's p, 2-4), each writing its own byte range.",
                      ints=(1, 32))
CHUNK_MB = Option("chunk_mb", "auto", "pipeline chunk in MB (the paper's b): persisting starts once a chunk is "
                                      "copied; auto: an eighth of the checkpoint, 1-256 MB.", ints=(1, 4096))
OPTIONS = (
    CKPT_WRITERS,
    CHUNK_MB,
    Option("max_slowdown", None, "with --every auto or unset: the slowdown q the interval f* = ceil(T_w/(N*q*t)) "
                                 "allows; unset: 1 + --max-overhead (1.05)."),
)
