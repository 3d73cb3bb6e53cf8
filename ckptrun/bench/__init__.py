"""`ckptrun bench`: overhead, stall, bandwidth, memory and recovery time of every strategy next to
`none` and the PyTorch references, on the example GPT. One job per module: `plan` (what runs),
`runner` (one run and its recovery), `procmem` (peak memory), `figures` (a run's numbers),
`stats` (over repetitions), `machine` (what it ran on), `report` (table, JSON, plot), `driver`."""

from .driver import BenchOptions, run_bench

__all__ = ["BenchOptions", "run_bench"]
