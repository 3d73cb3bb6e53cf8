"""gockpt (GoCkpt): one checkpoint's transfer spread over k steps in blocks (a parameter block
with its optimizer-state block), the gradients of blocks already sent shipped every step after,
and the engine rolling every block forward to one version V before writing an ordinary full
record. k comes from the corrected stall model (`model.py`).

Torch-free: the registry imports this package for its options.
"""

from ...errors import UsageError
from ..options import Option

MAX_AUTO_SPREAD = 7  # the paper's cap: past it the gradients cost more than the hidden transfer saves

SPREAD = Option(
    "spread", "auto",
    "steps one checkpoint's transfer is spread over (k), or auto: the stall model's k* = 1/r + 1/2 (r = gradient "
    f"bytes / state bytes), re-chosen from the measured copy bandwidth and step time, at most {MAX_AUTO_SPREAD}.",
    ints=(1, 64))
BLOCK_MB = Option(
    "block_mb", "4",
    "size in MB of one transfer block (a parameter slice together with its optimizer-state slices); a positive "
    "number, fractions allowed (tests use small blocks on small models).")
OPTIONS = (SPREAD, BLOCK_MB)


def explicit_every(options: dict, every: int) -> dict:
    """--every N given: each spread ends at a multiple of N (it starts k-1 steps before), so k is
    at most N (auto: capped at N); a given --spread above N is refused."""
    k = SPREAD.integer(options)
    if k is not None and k > every:
        raise UsageError(f"{SPREAD.flag} {k} with --every {every}: gockpt completes at most one checkpoint per "
                         f"spread of {k} steps, so not every multiple of {every} would be restorable; give "
                         f"{SPREAD.flag} at most {every} (or leave it unset: auto, at most {every})")
    return options
