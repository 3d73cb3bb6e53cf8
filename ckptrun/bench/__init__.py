"""`ckptrun bench`: overhead, stall, bandwidth, memory and recovery time of every strategy next to
`none` and the PyTorch references, on the example GPT. One job per module: `plan` (what runs),
`runner` (one run and its recovery), `procmem` (peak memory), `figures` (a run's numbers),
`stats` (over repetitions), `budget` (the references' interval within the overhead budget),
`freshness` (steps back to the newest step in memory, on disk), `waste` (the predicted waste at an
MTBF), `machine` (what it ran on), `report` (table, JSON, plot), `options`
(the flags, below both modes), `driver` (the plain bench) and `failure_driver` (goodput)."""

from .driver import run_bench
from .options import BenchOptions

__all__ = ["BenchOptions", "run_bench"]
