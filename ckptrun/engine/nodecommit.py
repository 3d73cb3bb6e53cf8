"""--node-local-dir: steps commit across nodes whose --dir are their own, through the job store.

Each engine writes its rank's part into its own node's --dir (data and index fsynced), then
reports it in the attempt's c10d job store (`part/<record>/<rank>`: the index checksum and the
data bytes the manifest pins). Global rank 0's engine commits once every rank has reported: it
publishes the manifest in its own --dir, then announces that manifest (`commit/<record>`); each
other engine publishes the same bytes in its own --dir, once it pins the part written there, and
says so (`acked/<rank>`: its newest such step). A kill before the announcement leaves no
manifest on any node, so the previous step stands everywhere; a kill after it may leave the step
on some nodes only, and the resume takes the newest step every rank has (worker/bootstrap.py).
Retention on a node counts only the steps every rank has acknowledged (`safe_step`) and, with
--replicas, that every engine holds its partners' copies of (`held/<rank>`), so no node deletes
the step another node still resumes from, from its own --dir or from a partner's copy.

The store is the round's (the workers'), so the engines meet where they already meet for
--replicas; a new round starts with nothing reported, and the re-run writes its steps again.
torch (for the store's client) is imported only with --node-local-dir.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

TIMEOUT_S = 10.0  # one store operation; the store is rank 0's worker's, gone with its round


class Board:
    """One round's keys in the job store (see the module docstring). A store that is gone (its
    host, rank 0's worker, ended the round) reads as holding nothing, so nothing commits and
    nothing is pruned; a write to it raises RuntimeError, which the caller reports."""

    def __init__(self, kv: Any, key: str = "") -> None:
        self.kv, self.key = kv, key
        self._lock = threading.Lock()  # one client, used from the writer threads and the commit loop
        self._acked = -1  # the newest step this engine acknowledged in this round

    @classmethod
    def connect(cls, spec: dict) -> Board:
        """The board of the round whose store is at `spec` (addr, port, prefix)."""
        import torch.distributed as dist

        tcp = dist.TCPStore(spec["addr"], spec["port"], is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        return cls(dist.PrefixStore(f"{spec['prefix']}/commits", tcp), spec["prefix"])

    def _get(self, key: str) -> bytes | None:
        got = self._get_all([key])
        return None if got is None else got[0]

    def _get_all(self, keys: list[str]) -> list[bytes] | None:
        """Every key's value, or None while one is missing (two round trips, whatever the count)."""
        with self._lock:
            try:
                return self.kv.multi_get(keys) if self.kv.check(keys) else None
            except RuntimeError:  # (torch's DistNetworkError / DistStoreError)
                return None

    def _set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self.kv.set(key, value)

    def report(self, name: str, rank: int, summary: tuple[str, int]) -> None:
        """Rank `rank`'s part of `name` is written and fsynced: (index checksum, data bytes)."""
        self._set(f"part/{name}/{rank}", json.dumps(list(summary)))

    def reported(self, name: str, world_size: int) -> dict[int, tuple[str, int]] | None:
        """Every rank's report of `name`, or None while one is missing."""
        raw = self._get_all([f"part/{name}/{r}" for r in range(world_size)])
        if raw is None:
            return None
        return {r: (str(sum_), int(nbytes)) for r, (sum_, nbytes) in enumerate(map(json.loads, raw))}

    def fail(self, name: str, reason: str) -> None:
        """`name` will never commit (a rank failed to write it, or rank 0 abandoned it)."""
        self._set(f"failed/{name}", reason)

    def failed(self, name: str) -> str | None:
        raw = self._get(f"failed/{name}")
        return None if raw is None else raw.decode()

    def announce(self, name: str, manifest: bytes) -> None:
        """Rank 0 committed `name` in its own --dir with `manifest` (its JSON)."""
        self._set(f"commit/{name}", manifest)

    def announced(self, name: str) -> bytes | None:
        return self._get(f"commit/{name}")

    def ack(self, rank: int, step: int) -> None:
        """Rank `rank`'s --dir holds the manifest of `step` (and of every step before it it wrote);
        never a step older than one acknowledged before."""
        if step > self._acked:
            self._set(f"acked/{rank}", str(step))
            self._acked = step

    def hold(self, rank: int, step: int) -> None:
        """Rank `rank`'s engine holds its partners' copies of `step` or newer (--replicas)."""
        self._set(f"held/{rank}", str(step))

    def take_from(self, step: int) -> None:
        """--durable: the leader's drain uploads the first step committed at or after `step` next
        (engine/drain.py); every node keeps its record of that step until then."""
        self._set("durable/from", str(step))

    def taken_from(self) -> int | None:
        raw = self._get("durable/from")
        return None if raw is None else int(raw)

    def safe_step(self, world_size: int, *, replicated: bool = False) -> int:
        """The newest step every rank's --dir has committed and, when `replicated`, every engine
        holds its partners' copies of (-1 while a rank has said none)."""
        kinds = ("acked", "held") if replicated else ("acked",)
        steps = self._get_all([f"{kind}/{r}" for kind in kinds for r in range(world_size)])
        return -1 if steps is None else min(int(s) for s in steps)
