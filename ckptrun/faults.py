"""Fault injection for the crash-matrix tests, read from CKPTRUN_FAULT.

Forms: `kill:step=7` (the worker SIGKILLs itself mid-step 7: after backward, before the
update), `kill:step=7:phase=write` (the worker dies while step 7's checkpoint is being
written), `kill-engine:step=7:phase=write` (the engine dies mid-write, leaving a torn record).
Faults fire only in the first attempt, so the restarted run can finish.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

ENV = "CKPTRUN_FAULT"


@dataclass(frozen=True)
class Fault:
    target: str  # "kill" (worker) or "kill-engine"
    step: int
    phase: str  # "compute" or "write"
    rank: int | None = None

    @classmethod
    def parse(cls, text: str) -> Fault:
        parts = text.split(":")
        if parts[0] not in ("kill", "kill-engine"):
            raise ValueError(f"{ENV}={text!r}: expected kill:step=N[:phase=compute|write][:rank=R]")
        opts = dict(p.split("=", 1) for p in parts[1:])
        phase = opts.get("phase", "write" if parts[0] == "kill-engine" else "compute")
        rank = int(opts["rank"]) if "rank" in opts else None
        return cls(parts[0], int(opts["step"]), phase, rank)

    def applies(self, rank: int, restart_count: int) -> bool:
        return restart_count == 0 and (self.rank is None or self.rank == rank)


def from_env(rank: int, restart_count: int) -> Fault | None:
    text = os.environ.get(ENV)
    if not text:
        return None
    fault = Fault.parse(text)
    return fault if fault.applies(rank, restart_count) else None


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
