"""The commit path: how a rank's part of a record becomes a committed step, top to bottom.

1. **Ready.** A writer thread writes this rank's part (`write_part`, or a handler's own write
   through `record_with`): the worker hears `Durable`, the record waits in `pending`, and with
   --node-local-dir the part is reported on the round's board.
2. **Checked and committed** (global rank 0, `commit_ready`): in step order, a record whose
   ranks are all durable (on the board: all reported) and whose dependencies are committed is
   committed by publishing its manifest (`Store.try_commit`); then it is announced on the board
   for the other nodes, the worker hears `Committed`, the replicator ships it to the partners,
   and retention runs (engine/retention.py).
3. **Adopted** (other ranks, `watch_commits`): each reports what rank 0 committed; with
   --node-local-dir it publishes the announced manifest in its own --dir first, and acknowledges.
4. **Retry, abandon, failure.** A failed commit is retried with back-off, COMMIT_TRIES times;
   a record a rank failed to write, one that depends on a failed one, or one whose commit kept
   failing is abandoned (its uncommitted files removed, the board and the worker told,
   `SaveError`), and the last committed step stays (DESIGN §3.5).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..errors import AlreadyCommitted, CorruptCheckpoint
from ..ipc.messages import Committed, Durable, RecordSpec
from ..storage.store import WrittenPart
from .board_link import BoardLink
from .engine_state import EngineState
from .retention import retain

COMMIT_TRIES = 6  # a commit that fails this often is abandoned (reported; the previous step stays)
COMMIT_BACKOFF_S = 0.1  # first retry delay; doubles each time
FAILED_KEPT = 1024  # failed records remembered (to abandon what depends on them)


class CommitPath:
    """The records this rank wrote and has not seen committed (`pending`), and those that will
    never commit (`failed`); `queue_depth` says how many writer jobs are in flight (logged)."""

    def __init__(self, state: EngineState, board_link: BoardLink, queue_depth: Callable[[], int]) -> None:
        self.state, self.board_link, self._queue_depth = state, board_link, queue_depth
        self.pending: dict[str, RecordSpec] = {}  # written by this rank, not yet committed
        self.failed: dict[str, str] = {}  # records that will never commit -> why
        self._retries: dict[str, tuple[int, float]] = {}  # record -> (failed commits, next try)
        self._lock = threading.RLock()

    # ---- 1. ready: this rank's part written --------------------------------------------------
    def write_part(self, spec: RecordSpec, data: memoryview) -> int:
        """Persist this rank's part of a record and hand it to the committer (rank 0); with
        --replicas, the replicator cuts its copy from `data` while the slot still holds it."""
        state = self.state

        def write() -> WrittenPart:
            part = state.store.write_rank(spec.record, state.rank, data, spec.tensors, spec.skeleton, spec.meta,
                                          fault=state.faults.write_hook(spec.step), threads=state.io_threads)
            if state.replicator is not None:
                state.replicator.shipper.written(spec.record, state.rank, part.index, data)
            return part

        return self.record_with(spec, write)

    def record_with(self, spec: RecordSpec, write: Callable[[], int | WrittenPart], since: float | None = None) -> int:
        """Persist this rank's part of record `spec` by `write()` (the bytes written, or the part
        written, which spares reading its index back; it raises AlreadyCommitted, touching
        nothing, when the record is committed already) and hand it to the committer (rank 0). A
        failure is a save error. `since`: when the writing began."""
        state = self.state
        t0 = time.time() if since is None else since
        name, step = spec.record, spec.step
        try:
            written = write()
        except AlreadyCommitted:
            # A re-run reaching a step that is committed already (the same state, by exactness):
            # nothing to write, and the committed record is left exactly as it is.
            state.log.emit(type="skip", rank=state.rank, step=step, record=name)
            state.link.send(Durable(step=step, record=name, nbytes=0, write_s=0.0))
            state.link.send(Committed(step=step, record=name))
            return 0
        except Exception as e:  # noqa: BLE001 - any failure is a save error: reported, never a hang
            self._write_failed(spec, e)
            return 0
        if isinstance(written, WrittenPart):
            n, summary = written.nbytes, written.summary
        else:
            n, summary = written, lambda: state.store.part_summary(name, state.rank, spec.layout)
        self.durable(step, name, n, time.time() - t0)
        with self._lock:
            self.pending[name] = spec
        self.board_link.tell(lambda b: b.report(name, state.rank, summary()))
        if state.rank == 0:
            self.commit_ready()
        return n

    def durable(self, step: int, record: str, nbytes: int, write_s: float) -> None:
        """This rank's part of `record` is on disk: logged, and the worker told."""
        state = self.state
        state.log.emit(type="write", rank=state.rank, step=step, bytes=nbytes, write_s=write_s,
                       queue_depth=self._queue_depth())
        state.link.send(Durable(step=step, record=record, nbytes=nbytes, write_s=write_s))

    # ---- 2. checked and committed (global rank 0) ----------------------------------------------
    def commit_ready(self) -> None:
        """Commit, in step order, every pending record whose ranks and dependencies are durable;
        abandon those that can never commit (4.)."""
        state = self.state
        with self._lock:
            todo = sorted(self.pending.values(), key=lambda spec: spec.step)
            committed = {m.name for m in state.store.manifests(warn=False)} if todo else set()
            for spec in todo:
                reason = self._failure(spec.record, spec.depends_on)
                if reason:
                    self._abandon(spec, reason)
                elif all(d in committed for d in spec.depends_on) and self._retry_due(spec.record):
                    if (name := self._commit(spec)) is not None:
                        committed.add(name)
            if todo:
                retain(state)

    def _commit(self, spec: RecordSpec) -> str | None:
        """Commit `spec` if every rank's part is there: its manifest published, then announced
        on the board and reported; the name committed (None: not yet)."""
        state, name = self.state, spec.record
        board = state.board
        parts = board.reported(name, state.world_size) if board is not None else None
        if board is not None and parts is None:
            return None  # a node's part is not reported yet
        try:
            m = state.store.try_commit(name, kind=spec.kind, step=spec.step,
                                       first_step=spec.step if spec.first_step is None else spec.first_step,
                                       world_size=state.world_size, depends_on=spec.depends_on or None,
                                       meta=spec.meta, fault=state.faults.write_hook(spec.step),
                                       layout=spec.layout, parts=parts)
        except (OSError, ValueError) as e:  # ValueError: the schema rejects what a writer sent
            self._commit_failed(spec, e)
            return None
        if m is None:
            return None
        self.board_link.announce(m)
        del self.pending[name]
        self._retries.pop(name, None)
        self.committed(m.step, m.name, nbytes=m.bytes, kind=m.kind, snapshot_time=spec.meta.get("snapshot_time"))
        return m.name

    def committed(self, step: int, record: str, *, nbytes: int, kind: str, snapshot_time: float | None) -> None:
        """`record` is committed in this rank's --dir: the worker told, the partners sent it, and
        logged by each node's first engine (`speaks_for_node`), so that every node's summary
        counts its own --dir."""
        state = self.state
        if not state.store.owned():  # (a region slot committed in the file of a --dir deleted since)
            state.save_error(step, record, f"not committed: {state.lost_dir_error()}")
            return
        state.committed_step = max(state.committed_step or 0, step)
        if state.replicator is not None:
            state.replicator.shipper.offer(record, step)
        if state.speaks_for_node:
            state.log.emit(type="commit", step=step, bytes=nbytes, kind=kind, ranks=state.world_size,
                           lag_s=time.time() - (snapshot_time or time.time()))
        state.link.send(Committed(step=step, record=record))

    def settle(self, timeout: float) -> None:
        """Rank 0 at shutdown: commit what can be committed, waiting out retry back-offs."""
        deadline = time.monotonic() + timeout
        self.commit_ready()
        while self._retries and time.monotonic() < deadline:
            time.sleep(COMMIT_BACKOFF_S)
            self.commit_ready()

    # ---- 3. adopted (the other ranks) --------------------------------------------------------
    def watch_commits(self) -> None:
        """Other ranks: tell the worker (and the node's metrics) when rank 0 has committed a
        record we wrote."""
        state = self.state
        if state.board is not None:
            self._adopt_commits()
        with self._lock:
            done = [spec for name, spec in self.pending.items() if state.store.is_committed(name)]
            gone = [name for name in self.pending if not (state.store.root / name).exists()]  # pruned/abandoned
            for name in [spec.record for spec in done] + gone:
                del self.pending[name]
        for spec in sorted(done, key=lambda spec: spec.step):
            nbytes = self._record_bytes(spec.record) if state.speaks_for_node else 0
            self.committed(spec.step, spec.record, nbytes=nbytes, kind=spec.kind,
                           snapshot_time=spec.meta.get("snapshot_time"))

    def _record_bytes(self, name: str) -> int:
        """The bytes committed record `name` holds, every rank's (its manifest's count; 0 unread)."""
        try:
            return self.state.store.manifest(name).bytes
        except (OSError, CorruptCheckpoint):
            return 0

    def _adopt_commits(self) -> None:
        """--node-local-dir, other ranks: publish in this node's --dir the manifest rank 0
        announced for each pending record (it pins the part written here), then acknowledge the
        newest; a record rank 0 gave up goes here too. Retention on this node follows (its
        local rank 0's engine)."""
        state = self.state
        board, store, newest = state.board, state.store, None
        with self._lock:
            for name, spec in sorted(self.pending.items(), key=lambda kv: kv[1].step):
                try:
                    raw = board.announced(name)
                    if raw is None:
                        if reason := board.failed(name):
                            store.abandon(name)
                            del self.pending[name]
                            state.save_error(spec.step, name, f"not committed: {reason}")
                        continue
                    newest = store.adopt_manifest(name, raw, [state.rank]).step
                except CorruptCheckpoint as e:  # never: rank 0 commits what this engine reported
                    store.abandon(name)
                    del self.pending[name]
                    state.save_error(spec.step, name, f"not committed here: {e}")
                except OSError:
                    continue  # its part is gone here (swept, set aside): `watch_commits` drops it
        if newest is not None:
            self.board_link.tell(lambda b: b.ack(state.rank, newest))
            if state.local_rank == 0:
                retain(state)

    # ---- 4. retry, abandon, failure ----------------------------------------------------------
    def _commit_failed(self, spec: RecordSpec, err: Exception) -> None:
        """Try again after a back-off that doubles; abandon after COMMIT_TRIES (lock held)."""
        state, name = self.state, spec.record
        tries = self._retries.get(name, (0, 0.0))[0] + 1
        state.log.emit(type="commit_retry", rank=state.rank, step=spec.step, record=name, tries=tries,
                       error=str(err))
        if tries >= COMMIT_TRIES:
            self._abandon(spec, f"commit failed {tries} times ({err})")
            return
        delay = COMMIT_BACKOFF_S * 2 ** (tries - 1)
        self._retries[name] = (tries, time.monotonic() + delay)
        state.save_error(spec.step, name, f"commit failed ({err}); retrying in {delay:.1f} s "
                                          f"(try {tries} of {COMMIT_TRIES})")

    def _retry_due(self, name: str) -> bool:
        return time.monotonic() >= self._retries.get(name, (0, 0.0))[1]

    def _write_failed(self, spec: RecordSpec, err: Exception) -> None:
        """This rank could not write its part: the record never commits. Rank 0 (the committer)
        removes it now; another rank marks its part failed, in --dir and on the board."""
        state, name = self.state, spec.record
        with self._lock:
            self._mark_failed(name, f"rank {state.rank} failed to write it ({err})")
        if state.rank == 0:
            state.store.abandon(name)
        else:
            state.store.mark_failed(name, state.rank)
            self.board_link.tell(lambda b: b.fail(name, f"rank {state.rank} failed to write it"))
        state.save_error(spec.step, name, f"write: {err}")

    def _failure(self, name: str, depends_on: list[str]) -> str | None:
        """Why record `name` can never commit, if it cannot (lock held)."""
        state = self.state
        if name in self.failed:
            return self.failed[name]
        ranks = state.store.failed_ranks(name)
        if ranks:
            return f"rank {ranks[0]} failed to write it"
        if state.board is not None and (reason := state.board.failed(name)):
            return reason
        bad = next((d for d in depends_on if d in self.failed), None)
        return f"it depends on {bad}, which was not saved" if bad else None

    def _mark_failed(self, name: str, reason: str) -> None:
        """Remember that `name` will never commit (its dependents are abandoned too); only the
        newest FAILED_KEPT, since a dependent is always recent (bounded memory in a long run)."""
        self.failed[name] = reason
        while len(self.failed) > FAILED_KEPT:
            del self.failed[next(iter(self.failed))]

    def _abandon(self, spec: RecordSpec, reason: str) -> None:
        """`spec` never commits: its files removed, the board and the worker told (lock held)."""
        name = spec.record
        self._mark_failed(name, reason)
        del self.pending[name]
        self._retries.pop(name, None)
        self.state.store.abandon(name)
        self.board_link.tell(lambda b: b.fail(name, reason))
        self.state.save_error(spec.step, name, f"not committed: {reason}")

    def forget_pending(self) -> None:
        """A new round of the board: what the old one left uncommitted is no longer waited for."""
        with self._lock:
            self.pending.clear()
            self._retries.clear()
