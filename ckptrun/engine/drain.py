"""The background drain of committed steps from --dir to the durable tier (`--durable`).

Global rank 0's engine (the committer, which reads every rank's files already) runs it in a
thread: the trainer never waits on it. Each round takes the newest committed step once it is
`--durable-every` steps past the newest remote one (auto, when unset: as soon as the previous
upload is done, so the interval follows the measured upload bandwidth) and uploads it with every
record it depends on that the tier lacks, each record's commit object last. At start it aborts
the partial uploads of a dead engine; after each remote commit it applies `--durable-keep`.
Each upload is one `durable` event in the metrics (step, bytes, seconds, lag), each failure a
`durable_error` (retried with back-off; the previous remote step stays restorable).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..config import ENV, RunConfig
from ..errors import CorruptCheckpoint
from ..ipc.events import EventLog
from ..storage.schema import Manifest
from ..storage.store import Store, retained
from ..storage.tiers import Tier, open_tier
from ..storage.tiers.base import UploadFault
from ..storage.tiers.parts import record_parts

POLL_S = 0.1
BACKOFF_MAX_S = 30.0
PARALLEL_RANKS = 4  # ranks' parts uploaded at once (each large object is itself parallel)


class Drain:
    """Copies `store`'s committed steps to `tier` (see the module docstring)."""

    def __init__(self, store: Store, tier: Tier, every: int, keep: int, log: EventLog,
                 fault: Callable[[int], UploadFault]) -> None:
        self.store, self.tier, self.every, self.keep, self.log, self.fault = store, tier, every, keep, log, fault
        self.remote: dict[str, Manifest] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptrun-durable", daemon=True)
        self._lock = threading.Lock()  # one round at a time (the thread's, or the final one)
        self._adopted = False  # the tier's earlier records read, its dead uploads swept
        self.busy: frozenset[str] = frozenset()  # the records of the round under way: local retention keeps them

    def start(self) -> Drain:
        self._thread.start()
        return self

    def _run(self) -> None:
        delay = 0.0
        while not self._stop.wait(delay or POLL_S):
            try:
                with self._lock:
                    if not self._adopted:
                        self._adopt()
                    self.round()
                delay = 0.0
            except Exception as e:  # noqa: BLE001 - an unreachable store is reported, never fatal
                delay = min(BACKOFF_MAX_S, max(1.0, 2 * delay))
                self.log.emit(type="durable_error", error=f"{type(e).__name__}: {e}", retry_s=delay)

    def _adopt(self) -> None:
        """What the tier holds from earlier runs; the uploads a dead engine left are swept."""
        aborted, torn = self.tier.sweep()
        if aborted or torn:
            self.log.emit(type="durable_sweep", aborted=aborted, records=torn)
        with tempfile.TemporaryDirectory(prefix="ckptrun-durable-") as tmp:
            for name in self.tier.committed():
                try:
                    self.remote[name] = self.tier.manifest(name, Path(tmp) / name)
                except CorruptCheckpoint as e:  # never counted, never removed by retention
                    self.log.emit(type="durable_error", error=f"skipping {e}", retry_s=None)
        self._adopted = True

    def newest_remote(self) -> int:
        return max((m.step for m in self.remote.values()), default=-1)

    def round(self, *, final: bool = False) -> None:
        """Upload the newest committed step if it is due (`final`: whatever the interval)."""
        ms = self.store.manifests(warn=False)
        if not ms:
            return
        newest, last = ms[-1], self.newest_remote()
        if newest.step <= last or (not final and self.every and last >= 0 and newest.step < last + self.every):
            return
        local = {m.name: m for m in ms}
        need, todo = [newest.name], []
        while need:
            name = need.pop()
            if name in self.remote or name in todo:
                continue
            if name not in local:
                return  # a dependency neither here nor there: this step cannot be restorable there
            todo.append(name)
            need += local[name].depends_on
        t0, nbytes = time.time(), 0
        self.busy = frozenset(todo)
        try:
            for m in sorted((local[n] for n in todo), key=lambda m: (m.step, m.kind != "full")):
                try:
                    nbytes += self._upload(m)
                except CorruptCheckpoint:
                    if m.name in {x.name for x in self.store.manifests(warn=False)}:
                        raise
                    return  # removed before it was protected: the next round takes a newer step
        finally:
            self.busy = frozenset()
        took = time.time() - t0
        newest_now = self.store.manifests(warn=False)
        self.log.emit(type="durable", step=newest.step, record=newest.name, bytes=nbytes, upload_s=took,
                      lag_steps=(newest_now[-1].step if newest_now else newest.step) - newest.step,
                      lag_s=time.time() - (newest.committed_at or t0))
        self._retain()

    def _upload(self, m: Manifest) -> int:
        with record_parts(self.store, m) as (parts, manifest), \
                ThreadPoolExecutor(min(PARALLEL_RANKS, len(parts))) as pool:
            self.tier.publish_record(m.name, parts, manifest, fault=self.fault(m.step), pool_map=pool.map)
        self.remote[m.name] = m
        return m.bytes

    def _retain(self) -> None:
        """--durable-keep: runs after a remote commit, so a newer one is always kept."""
        if self.keep <= 0 or not self.remote:
            return
        ms = sorted(self.remote.values(), key=lambda m: (m.step, m.kind != "full"))
        gone = [m.name for m in ms if m.name not in retained(ms, self.keep)]
        if gone:
            records, _ = self.tier.listing()
            for name in gone:
                self.tier.remove_record(name, list(records.get(name, {})))
                del self.remote[name]
            self.log.emit(type="durable_prune", records=gone)

    def close(self) -> None:
        """Stop the thread and upload the run's newest committed step (the run is ending)."""
        self._stop.set()
        self._thread.join()
        try:
            with self._lock:
                if not self._adopted:
                    self._adopt()
                self.round(final=True)
        except Exception as e:  # noqa: BLE001 - reported; the previous remote step stays
            self.log.emit(type="durable_error", error=f"{type(e).__name__}: {e}", retry_s=None)


def from_config(store: Store, log: EventLog, fault: Callable[[int], UploadFault]) -> Drain | None:
    """The drain the run's configuration (--durable ...) asks for, started; None without --durable."""
    cfg = RunConfig.from_env() if ENV in os.environ else None
    if cfg is None or not cfg.durable:
        return None
    tier = open_tier(cfg.durable, cfg.durable_endpoint or None)
    return Drain(store, tier, cfg.durable_every, cfg.durable_keep, log, fault).start()
