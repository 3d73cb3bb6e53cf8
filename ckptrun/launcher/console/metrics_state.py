"""Fold the metrics feed's events into what the live view and the exit summary show.

:class:`MetricsState` dispatches each event by its type: a rank's own figures go to its
:class:`~ckptrun.launcher.console.rank_stats.RankStats`, commits to the
:class:`~ckptrun.launcher.console.commits.CommitLedger`, and the run's header, totals and
errors stay here. The derived views (freshness, overhead, the overview and the summary) are
computed on demand by the modules named after them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from . import freshness, run_figures
from .commits import CommitLedger
from .overhead import Budgeted, budgeted
from .rank_stats import RankStats
from .run_figures import Overview, RunSummary

Handler = Callable[["MetricsState", dict[str, Any], float], None]


def _per_rank(fold: Callable[[RankStats, dict[str, Any], float], None]) -> Handler:
    """A handler for an event that concerns its rank alone."""
    def handler(state: MetricsState, e: dict[str, Any], t: float) -> None:
        fold(state._rank(e["rank"]), e, t)
    return handler


class MetricsState:
    """Fold events into per-rank and run-level state.

    ``apply`` never raises on a malformed event (it is counted in ``bad_events``): the
    dashboard must keep going whatever a worker writes.
    """

    def __init__(self) -> None:
        self.ranks: dict[int, RankStats] = {}
        self.commits = CommitLedger()
        self.strategy: str | None = None
        self.settings: dict[str, Any] = {}
        self.ckpt_dir: str | None = None
        self.world_size: int | None = None
        self.engine_pids: dict[int, int] = {}
        self.io_engine: str | None = None  # the engines' file writer: native or python (storage/iowriter.py)
        self.bytes_written = 0
        self.write_s_total = 0.0
        self.recoveries: dict[int, float] = {}  # restart_count -> slowest rank's recovery_s
        self.errors: deque[dict[str, Any]] = deque(maxlen=20)
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.events = 0
        self.bad_events = 0

    # ---- folding

    def apply(self, event: dict[str, Any]) -> None:
        """Fold one event in; unknown types are ignored, malformed ones counted."""
        handler = self._handlers.get(event.get("type")) if isinstance(event, dict) else None
        if handler is None:
            return
        try:
            t = float(event["t"])
            handler(self, event, t)
        except (KeyError, TypeError, ValueError, AttributeError):
            self.bad_events += 1
            return
        self.events += 1
        self.first_t = t if self.first_t is None else min(self.first_t, t)
        self.last_t = t if self.last_t is None else max(self.last_t, t)

    def apply_all(self, events: Iterable[dict[str, Any]]) -> None:
        for event in events:
            self.apply(event)

    def _rank(self, rank: Any) -> RankStats:
        r = int(rank)
        rs = self.ranks.get(r)
        if rs is None:
            rs = self.ranks[r] = RankStats(rank=r)
        return rs

    def _on_run(self, e: dict[str, Any], t: float) -> None:
        self._rank(e["rank"]).on_run(e, t)
        if e.get("strategy") is not None:
            self.strategy = str(e["strategy"])
        if isinstance(e.get("settings"), dict):
            self.settings = dict(e["settings"])
        if e.get("dir") is not None:
            self.ckpt_dir = str(e["dir"])
        if e.get("world_size") is not None:
            self.world_size = int(e["world_size"])

    def _on_interval(self, e: dict[str, Any], t: float) -> None:
        """Settings chosen at run time (`--every auto`, lowdiff's auto F/B) replace the header's."""
        skip = {"type", "t", "rank", "step", "reason", "strategy"}
        self.settings.update({k: v for k, v in e.items() if k not in skip})

    def _on_engine(self, e: dict[str, Any], t: float) -> None:
        if e.get("pid") is not None:
            self.engine_pids[int(e["local_rank"])] = int(e["pid"])

    def _on_io_engine(self, e: dict[str, Any], t: float) -> None:
        self.io_engine = str(e["engine"])

    def _on_restart(self, e: dict[str, Any], t: float) -> None:
        rs = self._rank(e["rank"])
        count, recovery = rs.restarted(e)
        self.recoveries[count] = max(self.recoveries.get(count, 0.0), recovery)
        rs.resumed(e, t)

    def _on_write(self, e: dict[str, Any], t: float) -> None:
        rs = self._rank(e["rank"])
        nbytes = int(e.get("bytes") or 0)
        write_s = float(e.get("write_s") or 0.0)
        rs.wrote(nbytes, write_s)
        self.bytes_written += nbytes
        self.write_s_total += write_s
        if e.get("queue_depth") is not None:
            rs.queue_depth = int(e["queue_depth"])

    def _on_commit(self, e: dict[str, Any], t: float) -> None:
        if self.commits.on_commit(e, t):
            for rs in self.ranks.values():
                rs.forget_before(int(e["step"]))

    def _on_save_error(self, e: dict[str, Any], t: float) -> None:
        rs = self._rank(e["rank"])
        rs.on_save_error(e, t)
        self.errors.append({"t": t, "rank": rs.rank, "step": e.get("step"), "error": rs.last_error})

    def _on_durable(self, e: dict[str, Any], t: float) -> None:
        self.commits.on_durable(e, t)

    def _on_durable_error(self, e: dict[str, Any], t: float) -> None:
        self.errors.append({"t": t, "rank": 0, "step": None, "error": f"--durable: {e['error']}"})

    def _on_budget(self, e: dict[str, Any], t: float) -> None:
        if e.get("verdict") == "over":  # only then is the rank known to the view
            self._rank(e["rank"]).over_budget = True

    _handlers: dict[Any, Handler] = {
        "interval": _on_interval,
        "overhead": _per_rank(RankStats.on_overhead),
        "budget": _on_budget,
        "skipped": _per_rank(RankStats.on_skipped),
        "run": _on_run,
        "step": _per_rank(RankStats.on_step),
        "restart": _on_restart,
        "engine": _on_engine,
        "io_engine": _on_io_engine,
        "write": _on_write,
        "commit": _on_commit,
        "save_error": _on_save_error,
        "durable": _on_durable,
        "durable_error": _on_durable_error,
        "in_memory": _per_rank(RankStats.on_in_memory),
        "replica_sent": _per_rank(RankStats.on_replica_sent),
        "host_memory": _per_rank(RankStats.on_host_memory),
    }

    # ---- derived views

    def durable(self, rank: int) -> tuple[int | None, float | None]:
        """Last durable step of ``rank`` and when it became durable (freshness.durable)."""
        return freshness.durable(self.commits, self.ranks[rank])

    def durable_age(self, rank: int, now: float) -> float | None:
        """Seconds since ``rank``'s last durable step became durable."""
        return freshness.durable_age(self.commits, self.ranks[rank], now)

    def at_risk(self, rank: int, *, memory: bool = False) -> tuple[int | None, float | None]:
        """Work one failure of ``rank`` loses now (freshness.at_risk)."""
        return freshness.at_risk(self.commits, self.ranks[rank], memory=memory)

    def budgeted(self) -> Budgeted | None:
        """The worst rank's latest overhead against its budget; None before one was measured."""
        return budgeted(self.ranks.values())

    def pids(self) -> dict[str, int]:
        """Processes whose memory the host line shows: ``rankN`` trainers and ``engineN`` engines."""
        out = {f"rank{r}": rs.pid for r, rs in sorted(self.ranks.items()) if rs.pid is not None}
        out.update({f"engine{lr}": pid for lr, pid in sorted(self.engine_pids.items())})
        return out

    @property
    def restarts(self) -> int:
        return max([len(self.recoveries)] + [rs.restarts for rs in self.ranks.values()])

    def overview(self, now: float) -> Overview:
        """Job-level numbers (slowest rank for progress, worst rank for tails)."""
        return run_figures.overview(self.ranks, self.commits, now, restarts=self.restarts)

    def summary(self) -> RunSummary:
        """Totals for the end of the run."""
        wall_s = self.last_t - self.first_t if self.first_t is not None and self.last_t is not None else None
        recovery_s = [self.recoveries[k] for k in sorted(self.recoveries)]
        return run_figures.summary(list(self.ranks.values()), self.commits, restarts=self.restarts,
                                   recovery_s=recovery_s, wall_s=wall_s, bytes_written=self.bytes_written,
                                   write_s=self.write_s_total)
