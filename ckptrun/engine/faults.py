"""The one point where a test's injected fault (ckptrun/faults.py, CKPTRUN_FAULT) reaches the
engine: production code asks here at the moments a fault may strike, and without a fault, or
with another kind, each answer is "nothing". `EngineFaults` serves the writes and commits
(engine/persist.py, engine/commit_path.py, a handler's context) and the durable uploads
(engine/drain.py); `ReplicaFaults` the replication (engine/replica_*.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time

from .. import faults
from ..faults import Fault
from ..ipc.messages import FaultKill
from ..storage.fsutil import FaultHook, _no_fault
from .worker_link import WorkerLink


class EngineFaults:
    """The fault of the worker's Hello (`set`), as hooks for the engine's writes and uploads."""

    def __init__(self, link: WorkerLink) -> None:
        self.fault: Fault | None = None
        self._link = link  # a write-phase kill asks the worker to die, and waits for it to go
        self._enospc_left = 0
        self._lock = threading.Lock()

    def set(self, fault: Fault | None) -> None:
        """The fault the (re)started worker names; an ENOSPC fault's count starts again."""
        self.fault = fault
        self._enospc_left = fault.times if fault and fault.target == "enospc" else 0

    def write_hook(self, step: int) -> FaultHook:
        """The injected fault for the writes of a record of `step`, if one applies: a full disk
        (`enospc`), the engine killed, or the worker killed once the data is written."""
        fault = self.fault
        if fault is None or fault.phase != "write":
            return _no_fault
        if fault.target == "enospc":
            return self._enospc_hook(fault) if step >= fault.step else _no_fault
        if fault.step != step:
            return _no_fault

        def hook(point: str) -> None:
            if point != "data:written":
                return
            self.fault = None
            if fault.target == "kill-engine":
                os._exit(137)
            self._kill_worker()

        return hook

    def _kill_worker(self) -> None:
        """Ask the worker to kill itself, and wait (10 s at most) until its connection is gone."""
        link = self._link
        conn = link.conn
        link.send(FaultKill())
        deadline = time.time() + 10
        while link.conn is conn and conn is not None and time.time() < deadline:
            time.sleep(0.01)

    def _enospc_hook(self, fault: Fault) -> FaultHook:
        def hook(point: str) -> None:
            with self._lock:
                if point != fault.at or self._enospc_left <= 0:
                    return
                self._enospc_left -= 1
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected at {point})")

        return hook

    def upload_hook(self, step: int) -> FaultHook:
        """The injected engine kill at a point of the durable upload of `step` or later
        (`kill-engine:step=N:phase=upload:at=part|commit|committed`)."""
        fault = self.fault
        if fault is None or fault.target != "kill-engine" or fault.phase != "upload" or step < fault.step:
            return _no_fault
        return lambda point: os._exit(137) if point == fault.at else None

    def write_due(self, step: int) -> bool:
        """Is the fault a write-phase fault at `step` (`EngineContext.write_fault_due`)?"""
        fault = self.fault
        return fault is not None and fault.phase == "write" and fault.step == step


class ReplicaFaults:
    """The faults of the engine's replication: production code calls it at the two moments a
    fault may strike there, and without a fault (`fault` None, or another kind) it does nothing."""

    def __init__(self, fault: Fault | None = None) -> None:
        self.fault = fault

    def receiving(self, manifest: bytes) -> None:
        """`kill-engine:step=N:phase=receive`: this engine dies while it receives a partner's
        copy of step N or later, the copy's manifest in and its data not."""
        fault = self.fault
        if fault is None or fault.target != "kill-engine" or fault.phase != "receive":
            return
        with contextlib.suppress(ValueError, KeyError, TypeError):
            if json.loads(manifest)["step"] >= fault.step:
                faults.die()

    def corrupts(self, step: int) -> bool:
        """`corrupt-replica:step=N`: a bit flips in each copy held of step N or later, after its
        checks, as memory going bad would. Whether the copy of `step` just held must go bad."""
        fault = self.fault
        return fault is not None and fault.target == "corrupt-replica" and step >= fault.step
