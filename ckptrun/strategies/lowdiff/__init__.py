"""lowdiff: every step's gradient as a differential checkpoint (trainer side, engine side, tuning model).

Torch-free: the registry imports this package for its options.
"""

from ..options import Option

OPTIONS = (
    Option("full_every", "auto", "steps between full checkpoints, or auto (eq. 8 with exact replay)."),
    Option("batch", "auto", "diffs written per record, or auto (eq. 8 with exact replay)."),
    Option("compress", None, "gradient compression in training, e.g. topk:0.01 (top-k with error feedback).",
           trains=True),
)
