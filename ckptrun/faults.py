"""Fault injection for the crash-matrix tests, read from CKPTRUN_FAULT.

Forms: `kill:step=7` (the worker SIGKILLs itself mid-step 7: after backward, before the
update), `kill:step=7:phase=write` (the worker dies while step 7's checkpoint is being
written), `kill-engine:step=7:phase=write` (the engine dies mid-write, leaving a torn record),
`kill-engine:step=7:phase=upload:at=part|commit|committed` (the engine dies while uploading step
7 or a later one to --durable: after a piece, before the commit object, after it),
`kill-engine:step=7:phase=receive` (--replicas: the engine dies while it receives a partner's
copy of step 7 or later, the copy's manifest in and its files not).
`enospc:step=7:at=manifest.synced[:times=3]` makes the engine's writes fail with ENOSPC at that
point of the durable-write sequence (data|index|manifest . open|written|synced|renamed|dir-synced)
for records of step 7 and later, `times` times in all (default 1): a full disk for a while.
Faults fire only in the first attempt, so the restarted run can finish. Several faults joined by
`;` fire one per attempt, in order (the i-th in restart i): one run goes through each of them.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

ENV = "CKPTRUN_FAULT"


@dataclass(frozen=True)
class Fault:
    target: str  # "kill" (worker), "kill-engine", "enospc" (engine writes fail) or "corrupt-replica"
    step: int
    phase: str  # "compute" or "write"
    rank: int | None = None
    at: str = ""  # enospc: the fault point of fsutil.publish_bytes, e.g. "data:written"
    times: int = 1  # enospc: how many writes fail
    text: str = ""  # the form it was parsed from (what the worker hands its engine)

    @classmethod
    def parse(cls, text: str) -> Fault:
        parts = text.split(":")
        if parts[0] not in ("kill", "kill-engine", "enospc", "corrupt-replica"):
            raise ValueError(f"{ENV}={text!r}: expected kill:step=N[:phase=compute|write][:rank=R] "
                             "or enospc:step=N:at=FILE.POINT[:times=T]")
        opts = dict(p.split("=", 1) for p in parts[1:])
        phase = opts.get("phase", {"kill": "compute", "corrupt-replica": "memory"}.get(parts[0], "write"))
        rank = int(opts["rank"]) if "rank" in opts else None
        return cls(parts[0], int(opts["step"]), phase, rank, opts.get("at", "").replace(".", ":", 1),
                   int(opts.get("times", 1)), text)


def from_env(rank: int, restart_count: int) -> Fault | None:
    """The fault of this attempt of `rank`, if any."""
    forms = [f for f in os.environ.get(ENV, "").split(";") if f]
    if restart_count >= len(forms):
        return None
    fault = Fault.parse(forms[restart_count])
    return fault if fault.rank is None or fault.rank == rank else None


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)

