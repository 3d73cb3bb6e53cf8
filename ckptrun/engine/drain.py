"""The background drain of committed steps from --dir to the durable tier (`--durable`).

Every rank's engine runs one, in a thread (the trainer never waits on it), and uploads its own
rank's part of a step only: the files its node holds, so no engine reads another node's files
and the upload bandwidth grows with the nodes. Global rank 0's engine leads. Each round it takes
a committed step, with every record it depends on that the tier lacks: given
`--durable-every N`, the newest multiple of N past the newest remote step (`durable_due`: as
--every N for --dir; where the uploads fall behind, older multiples are skipped, said once);
auto, the newest step once it is the interval past the newest remote one (the tiers' interval
model on the measured upload bandwidth, step time and failure rate, see `auto_every`); at close,
the newest. For each, oldest first, uploads its own part; the other engines see rank 0's part of
a record without a commit object in the tier's listing and upload theirs. Once the listing shows
every rank's part, and each index read back is the one its manifest names (a step run again
after a restart has another: `durable_check`), the leader uploads the commit object, last: a kill
at any moment leaves the previous remote step restorable. The listing is the coordination
because it is what every node sees and what a reader will find; the job's c10d store is the
workers', made again at each rendezvous round, which the engines outlive. A part that is not up
PART_WAIT_S (or twice the leader's own upload time) after the last one came is uploaded by the
leader itself where --dir is shared, else the round fails and is retried. With --node-local-dir
(no other node's part can come from here), the leader says on the round's board, in advance, the
first step its next round takes (`_say_next`), and every engine keeps its record of that step
until then: a node would otherwise prune its part before its next poll of the listing. At start
the leader aborts the partial uploads of a dead engine; after each remote commit it removes the
records left without one and applies `--durable-keep`. Each part is a `durable_part` event, each
upload a `durable` event in the metrics (step, bytes, seconds, lag), each failure a
`durable_error` (retried with back-off; the previous remote step stays restorable).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ENV, RunConfig
from ..errors import CorruptCheckpoint
from ..ipc.events import EventLog
from ..log import log
from ..storage.schema import Manifest
from ..storage.store import Store, retained
from ..storage.tiers import Tier, open_tier
from ..storage.tiers.base import MANIFEST, UploadFault
from ..storage.tiers.parts import Part, record_parts
from ..tuning.intervals import DEFAULT_MTBF_S
from ..tuning.levels import FailureRates, Layout, durable_every, rates_for
from .durable_check import check_parts
from .durable_due import Due, due, held_for_due, needed, next_multiple, records_for

if TYPE_CHECKING:
    from .nodecommit import Board

POLL_S = 0.1  # the leader's rounds (a local check first)
FOLLOW_POLL_S = 1.0  # the other engines' polls of the listing (one LIST request each)
PARTS_POLL_S = 0.25  # the leader's polls of the listing while it waits for the other ranks' parts
PART_WAIT_S = 30.0
TIMED_COMMITS = 8  # auto: the step time is measured over this many newest commits
BACKOFF_MAX_S = 30.0
SAID_CHANGE = 0.25  # a `durable_interval` event when auto's interval moves by more than this fraction


class _Stopping(Exception):
    """The thread is asked to stop in the middle of a round (the final round takes over)."""


class Drain:
    """Copies `store`'s committed steps to `tier` (see the module docstring); `rank`: the
    engine's global rank now (0 leads)."""

    def __init__(self, store: Store, tier: Tier, every: int, keep: int, log: EventLog,
                 fault: Callable[[int], UploadFault], rank: int = 0, rates: FailureRates | None = None,
                 layout: Layout = Layout()) -> None:
        self.store, self.tier, self.every, self.keep, self.log, self.fault = store, tier, every, keep, log, fault
        self.rank, self.layout = rank, layout
        self.rates = rates or rates_for(0.0, {}, DEFAULT_MTBF_S)
        self.upload_Bps: float | None = None  # measured by the last round (all ranks' bytes / its time)
        self._auto: int | None = None  # the interval auto said last (a `durable_interval` event)
        self._part_s = 0.0  # how long the last part this engine uploaded took
        self.remote: dict[str, Manifest] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptrun-durable", daemon=True)
        self._lock = threading.Lock()  # one round at a time (the thread's, or the final one)
        self._adopted = False  # the tier's earlier records read, its dead uploads swept
        self.busy: frozenset[str] = frozenset()  # the records of the round under way: local retention keeps them
        self._held: frozenset[str] = frozenset()  # what the last `retain_local` said it held
        self._said_behind = False  # a round that skipped older multiples of --durable-every was said
        # --node-local-dir: the round's commit keys (set by the server at each round), where the
        # leader says which step it takes next (`_say_next`)
        self.board: Board | None = None

    def start(self) -> Drain:
        self._thread.start()
        return self

    def _run(self) -> None:
        delay = 0.0
        while not self._stop.wait(delay or (POLL_S if self.rank == 0 else FOLLOW_POLL_S)):
            try:
                with self._lock:
                    self.round()
                delay = 0.0
            except _Stopping:
                return
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
        return max((m.step for m in list(self.remote.values())), default=-1)  # (read by retention too)

    def round(self, *, final: bool = False) -> None:
        """The leader: upload the newest committed step if it is due (`final`: whatever the
        interval; with --node-local-dir, the step it said on the board in advance). The others:
        upload their part of each record the leader has begun."""
        if self.rank != 0:
            self._follow()
            return
        self.store.check_owned()  # (never another run's records, in a --dir made again since)
        if not self._adopted:
            self._adopt()
        ms = self.store.manifests(warn=False)
        if not ms:
            return
        newest, last = ms[-1], self.newest_remote()
        every = self.every or self.auto_every(ms)
        board = None if final else self.board
        if board is not None:  # the step said in advance (`_say_next`), which every node kept
            start = board.taken_from()
            newest = None if start is None else next((m for m in ms if m.step >= start), None)
            if newest is None or newest.step <= last:
                if start is None or newest is not None:
                    self._say_next(board, ms[-1].step, last, every)
                return
        elif self.every and not final:
            pick = due([m.step for m in ms], last, self.every)
            if pick is None:
                return
            newest = [m for m in ms if m.step == pick.step][-1]
            self._say_skipped(pick)
        elif newest.step <= last or (not final and last >= 0 and (every is None or newest.step < last + every)):
            return
        local = {m.name: m for m in ms}
        todo = needed(newest.name, local, self.remote)
        if todo is None:  # a dependency neither here nor there: this step cannot be restorable there
            if board is not None:
                self._say_next(board, ms[-1].step, last, every)
            return
        t0, nbytes = time.time(), 0
        self.busy = frozenset(todo)
        try:
            for m in sorted((local[n] for n in todo), key=lambda m: (m.step, m.kind != "full")):
                try:
                    nbytes += self._upload(m, final)
                except CorruptCheckpoint:
                    if m.name in {x.name for x in self.store.manifests(warn=False)}:
                        raise
                    return  # removed before it was protected: the next round takes a newer step
        finally:
            self.busy = frozenset()
            if board is not None:
                now = self.store.manifests(warn=False)
                self._say_next(board, now[-1].step if now else newest.step, self.newest_remote(), every)
        took = time.time() - t0
        if nbytes and took > 0:
            self.upload_Bps = nbytes / took
        newest_now = self.store.manifests(warn=False)
        self.log.emit(type="durable", step=newest.step, record=newest.name, bytes=nbytes, upload_s=took,
                      lag_steps=(newest_now[-1].step if newest_now else newest.step) - newest.step,
                      lag_s=time.time() - (newest.committed_at or t0))
        self._tidy()

    def _say_skipped(self, pick: Due) -> None:
        """Once a run: the uploads fell behind --durable-every N, and older multiples were
        skipped for the newest one (a `durable_skip` event and a warning)."""
        if not pick.skipped or self._said_behind:
            return
        self._said_behind = True
        skipped = ", ".join(map(str, pick.skipped))
        self.log.emit(type="durable_skip", step=pick.step, skipped=list(pick.skipped), every=self.every)
        log.warning(f"--durable-every {self.every}: the uploads to {self.tier.url} fall behind the commits; "
                    f"copying step {pick.step}, the newest multiple, and skipping step(s) {skipped} (said once)")

    def _say_next(self, board: Board, newest: int, last: int, every: int | None) -> None:
        """--node-local-dir: say on the board the first step the next round takes (past every step
        committed now: the next multiple of --durable-every N, or, auto, the interval past the
        newest remote one). A node commits a step only after rank 0's engine, so none has
        committed it yet: each keeps its record of the first step committed from there
        (`retain_local`), and has its part when the round comes; a step taken only once it is
        committed could be gone from a node that pruned it first."""
        if self.every:
            board.take_from(next_multiple(max(newest, last), self.every))
        elif every is not None:
            board.take_from(max(newest + 1, last + every if last >= 0 else 0))

    def _awaited(self, ms: list[Manifest]) -> frozenset[str]:
        """The records the board says the next round takes: the first step committed at or after
        its `from`, with the records it depends on that the tier lacks."""
        start = self.board.taken_from() if self.board is not None and ms else None
        first = None if start is None else next((m for m in ms if m.step >= start), None)
        return records_for(first.name, ms, self.remote) if first else frozenset()

    def auto_every(self, ms: list[Manifest]) -> int | None:
        """--durable-every auto: `levels.durable_every` (the tiers' model, as `ckptrun tune`
        prints it) for an upload of the newest step at the measured bandwidth, the step time of
        the newest commits and the failure rates; 1 (as soon as the last upload is done) until
        both are measured; None where no failure resumes from the remote tier (the final round
        only). A change of more than SAID_CHANGE since the last one said is a `durable_interval`
        event (the step time moves a little every round)."""
        timed = [m for m in ms[-TIMED_COMMITS:] if m.committed_at]
        if self.upload_Bps is None or len(timed) < 2 or timed[-1].committed_at <= timed[0].committed_at:
            return 1
        step_s = (timed[-1].committed_at - timed[0].committed_at) / (timed[-1].step - timed[0].step)
        upload_s = max(ms[-1].bytes / self.upload_Bps, 1e-3)
        every, why = durable_every(upload_s, step_s, self.rates, self.layout)
        said = self._auto
        if (every is None) != (said is None) or every is not None and abs(every - said) > SAID_CHANGE * said:
            self._auto = every
            self.log.emit(type="durable_interval", every=every, reason=why, upload_s=upload_s, step_s=step_s)
        return every

    def _upload(self, m: Manifest, final: bool) -> int:
        """Record `m`: rank 0's part from here, the others' from their engines, then the commit
        object. Parts a dead attempt left are removed first, so every part listed is this one's."""
        fault = self.fault(m.step)
        with record_parts(self.store, m, [0]) as (parts, manifest):
            if m.world_size > 1:
                left = self.tier.listing()[0].get(m.name, {})
                if left and MANIFEST not in left:
                    self.tier.remove_record(m.name, list(left))
            took = self._put_part(m, 0, parts[0], fault)
            if m.world_size > 1:
                mine = {0, *self._await_parts(m, max(PART_WAIT_S, 2 * took), fault, final)}
                check_parts(self.tier, self.store, m, mine)
            self.tier.publish_commit(m.name, manifest, fault)
        self.remote[m.name] = m
        return m.bytes

    def _put_part(self, m: Manifest, rank: int, part: Part, fault: UploadFault) -> float:
        """Upload rank `rank`'s part of `m` (a `durable_part` event); returns the seconds taken."""
        t0 = time.time()
        self.tier.put_part(m.name, part, fault)
        took = self._part_s = time.time() - t0
        self.log.emit(type="durable_part", rank=rank, by=self.rank, step=m.step, record=m.name,
                      bytes=m.rank_bytes[rank] if m.rank_bytes else None, upload_s=took)
        return took

    def _await_parts(self, m: Manifest, wait_s: float, fault: UploadFault, final: bool) -> list[int]:
        """Return once the listing shows every rank's part of `m`: the ranks whose part went from
        here (one that has not come `wait_s` after the last did, its engine gone, if --dir holds it)."""
        seen, since = set(), time.monotonic()
        while True:
            up = self.tier.ranks_up(self.tier.listing()[0].get(m.name, {}))
            missing = [r for r in range(m.world_size) if r not in up]
            if not missing:
                return []
            if up != seen:
                seen, since = up, time.monotonic()
            elif time.monotonic() - since > wait_s:
                break
            if self._stop.wait(PARTS_POLL_S) and not final:
                raise _Stopping
        try:
            with record_parts(self.store, m, missing) as (parts, _):
                for rank, part in zip(missing, parts, strict=True):
                    self._put_part(m, rank, part, fault)
        except (CorruptCheckpoint, OSError) as e:
            raise RuntimeError(f"{m.name}: rank {missing[0]}'s part did not reach {self.tier.url} in "
                               f"{wait_s:.0f} s, and {self.store.root} cannot give it ({e})") from None
        return missing

    def _follow(self) -> dict[str, dict[str, int]]:
        """Upload this rank's part of every record the leader has begun and it has committed;
        returns the listing it acted on."""
        self.store.check_owned()
        records, _ = self.tier.listing()
        begun = sorted(name for name, files in records.items() if MANIFEST not in files
                       and 0 in (up := self.tier.ranks_up(files)) and self.rank not in up)
        local = {m.name: m for m in self.store.manifests(warn=False)} if begun else {}
        for name in begun:
            m = local.get(name)
            if m is None or self.rank >= m.world_size:
                continue
            with record_parts(self.store, m, [self.rank]) as (parts, _):
                self._put_part(m, self.rank, parts[0], self.fault(m.step))
        return records

    def _follow_to_the_end(self) -> None:
        """At close (not leading): follow until the tier has committed this engine's newest
        step, or until the listing has not changed for PART_WAIT_S (or twice this engine's
        last part's upload time): the leader gone, or failing."""
        wait_s, seen, since = max(PART_WAIT_S, 2 * self._part_s), None, time.monotonic()
        while time.monotonic() - since < wait_s:
            records = self._follow()
            ms = self.store.manifests(warn=False)
            if not ms or MANIFEST in records.get(ms[-1].name, {}):
                return
            listed = {(name, f, size) for name, files in records.items() for f, size in files.items()}
            if listed != seen:
                seen, since = listed, time.monotonic()
            time.sleep(FOLLOW_POLL_S)

    def _tidy(self) -> None:
        """After a remote commit, with no record under way: remove the records left without a
        commit object (a round stopped, a part of a dead engine) and apply --durable-keep, which
        keeps the newest remote commit."""
        records, _ = self.tier.listing()
        torn = sorted(name for name, files in records.items() if MANIFEST not in files)
        for name in torn:
            self.tier.remove_record(name, list(records[name]))
        if torn:
            self.log.emit(type="durable_sweep", aborted=0, records=torn)
        if self.keep <= 0 or not self.remote:
            return
        ms = sorted(self.remote.values(), key=lambda m: (m.step, m.kind != "full"))
        gone = [m.name for m in ms if m.name not in retained(ms, self.keep)]
        if gone:
            for name in gone:
                self.tier.remove_record(name, list(records.get(name, {})))
                del self.remote[name]
            self.log.emit(type="durable_prune", records=gone)

    def retain_local(self, keep: int, *, protect: frozenset[str] = frozenset(), upto: int | None = None
                     ) -> list[str]:
        """--keep on --dir (`Store.prune`'s `protect` and `upto`), holding the records the upload
        under way reads until the tier has them (at most one step's records beyond --keep: the
        hold ends with the round, and a failed round's step may then go). A hold that keeps what
        --keep would remove is said once, as a `durable_hold` event and a warning."""
        ms, busy = self.store.manifests(warn=False) if keep > 0 else [], self.busy
        held = frozenset(m.name for m in ms if m.name in busy - retained(ms, keep) and m.layout != "region") if ms \
            else frozenset()
        if self.every and self.rank == 0 and self.board is None:  # (the multiple due: `held_for_due`)
            protect |= held_for_due(ms, self.newest_remote(), self.every, self.remote)
        removed = self.store.prune(keep, protect=protect | busy | self._awaited(ms), upto=upto)
        if held and held != self._held:
            self.log.emit(type="durable_hold", records=sorted(held), keep=keep)
            log.warning(f"--keep {keep}: {len(held)} record(s) kept in {self.store.root} until {self.tier.url} "
                        f"has them ({', '.join(sorted(held))})")
        self._held = held
        return removed

    def close(self) -> None:
        """Stop the thread and upload the run's newest committed step (the run is ending)."""
        self._stop.set()
        self._thread.join()
        try:
            with self._lock:
                if self.rank == 0:
                    self.round(final=True)
                else:
                    self._follow_to_the_end()
        except Exception as e:  # noqa: BLE001 - reported; the previous remote step stays
            self.log.emit(type="durable_error", error=f"{type(e).__name__}: {e}", retry_s=None)


def from_config(store: Store, log: EventLog, fault: Callable[[int], UploadFault], rank: int) -> Drain | None:
    """The drain the run's configuration (--durable ...) asks for, started; None without --durable."""
    cfg = RunConfig.from_env() if ENV in os.environ else None
    if cfg is None or not cfg.durable:
        return None
    tier = open_tier(cfg.durable, cfg.durable_endpoint or None)
    return Drain(store, tier, cfg.durable_every, cfg.durable_keep, log, fault, rank,
                 rates_for(cfg.mtbf, cfg.mtbf_kinds, DEFAULT_MTBF_S), Layout(cfg.replicas, cfg.node_local_dir)).start()
