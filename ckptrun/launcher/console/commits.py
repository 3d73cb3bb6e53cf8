"""What the engines committed, as the feed reports it: each commit counted once, the newest one
and when, the commits' lag, and the newest upload to --durable."""

from __future__ import annotations

from typing import Any

from .series import Series

_COMMITS_KEPT = 4096  # committed steps remembered to count each once (ranks report it close together)


class CommitLedger:
    """The run's commits, from the engines' `commit` and `durable` events."""

    def __init__(self) -> None:
        self.committed_step: int | None = None
        self.committed_t: float | None = None
        self.last_commit: dict[str, Any] | None = None
        self.commit_lag = Series()
        self.remote: dict[str, Any] | None = None  # the newest --durable upload (engine's `durable` event)
        self.checkpoints_committed = 0
        self.bytes_committed = 0
        self._committed_steps: set[int] = set()

    def on_commit(self, e: dict[str, Any], t: float) -> bool:
        """Count the commit once; True if it is the newest so far."""
        step = int(e["step"])
        if step not in self._committed_steps:  # several engines may report the same commit
            self._committed_steps.add(step)
            if len(self._committed_steps) > _COMMITS_KEPT:  # bounded: a rank's report of an old step
                self._committed_steps = set(sorted(self._committed_steps)[-_COMMITS_KEPT // 2:])  # comes soon
            self.checkpoints_committed += 1
            self.bytes_committed += int(e.get("bytes") or 0)
            if e.get("lag_s") is not None:
                self.commit_lag.add(float(e["lag_s"]))
        if self.committed_step is None or step > self.committed_step:
            self.committed_step = step
            self.committed_t = t
            self.last_commit = dict(e)
            return True
        return False

    def on_durable(self, e: dict[str, Any], t: float) -> None:
        if self.remote is None or int(e["step"]) >= int(self.remote["step"]):
            self.remote = {**e, "t": t}

    def remote_lag(self) -> int | None:
        """Steps the newest commit is ahead of the newest step on --durable (None: none there yet)."""
        if self.remote is None:
            return None
        return max(0, (self.committed_step or 0) - int(self.remote["step"]))
