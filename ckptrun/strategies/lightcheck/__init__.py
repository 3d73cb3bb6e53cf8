"""lightcheck (LightCheck, ICCD'23): after each checkpointed step, every parameter and its
optimizer state are copied layer by layer, in the order the next update needs them, straight
into a preallocated memory-mapped region file while the next forward/backward runs; the next
update of layer j waits only for layer j's copy. Two (more with --keep/--max-inflight) slots
with per-slot metadata, a sequence number and checksums make it crash-consistent.

Torch-free: the registry imports this package for its options.
"""

from ..options import Option

LAYER_WAIT = Option("layer_wait", "layer",
                    "layer: the next update of a layer waits only for that layer's copy (LightCheck); whole: the next "
                    "update waits for the whole copy (CheckFreq's wait, for comparison).", choices=("layer", "whole"))
COPY_TO = Option("copy_to", "auto",
                 "region: copy straight into the mapped region file (LightCheck-D); host: into a shared-memory staging "
                 "slot, which the engine then writes into the region (LightCheck-C); auto: region on a GPU, host on "
                 "a CPU (where writing through the file mapping slowed training ~1.9x in ckptrun bench).",
                 choices=("auto", "region", "host"))
OPTIONS = (LAYER_WAIT, COPY_TO)
