"""What the engines of a rendezvous round hold of each rank, and who asks whom for it, said
through the round's job store (the exchange in engine/replica_exchange.py).

An engine posts under each rank it holds copies of, and reads only what is posted under its own
rank and the asks addressed to it: a few keys an engine whatever the world size. So a rank takes
its state back from any engine that holds it, a partner in this round or not (a rendezvous that
ranks the nodes anew may leave a rank's copies on nodes outside its new group). Phases are
separated by barriers that every engine of the round passes.

What is read is another process's word: each post is checked (its sender a rank of the round,
its fields of the types the exchange expects) before the exchange uses it.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from ..storage.schema import is_record_name

LIST_FIELDS = ("kept", "whole", "steps")  # lists of steps


class Board:
    """One exchange's keys (`name`) in a round's job store `store`, seen from `rank`."""

    def __init__(self, store: Any, rank: int, world_size: int, name: str, timeout: float) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.name, self.timeout = name, timeout

    def post(self, topic: str, said: dict) -> None:
        """Add `said` (from this rank) to what `topic` holds."""
        self.store.append(f"{self.name}/{topic}", json.dumps({**said, "from": self.rank}) + "\n")

    def read(self, topic: str, needs: tuple[str, ...]) -> list[dict]:
        """What the round's engines posted under `topic` before the last `sync`, checked, each
        with the fields `needs` names."""
        key = f"{self.name}/{topic}"
        if not self.store.check([key]):
            return []
        return [self._checked(line, needs) for line in self.store.get(key).decode().splitlines()]

    def sync(self, phase: str) -> None:
        """Wait until every engine of the round has reached `phase` (RuntimeError past the
        timeout: an engine that never comes leaves the exchange to the records)."""
        done = f"{self.name}/{phase}/all"
        if self.store.add(f"{self.name}/{phase}/count", 1) == self.world_size:
            self.store.set(done, b"1")
        self.store.wait([done], timedelta(seconds=self.timeout))

    def _checked(self, line: str, needs: tuple[str, ...]) -> dict:
        said = json.loads(line)
        ok = isinstance(said, dict) and _rank(said.get("from"), self.world_size) and all(f in said for f in needs) \
            and ("step" not in said or _step(said["step"])) \
            and ("holder" not in said or _rank(said["holder"], self.world_size)) \
            and all(isinstance(said[f], list) and all(map(_step, said[f])) for f in LIST_FIELDS if f in said) \
            and ("record" not in said or (isinstance(said["record"], str) and is_record_name(said["record"])))
        if not ok:
            raise ValueError(f"the job store holds a malformed post of the copies exchange: {line[:200]!r}")
        return said


def _rank(v: object, world_size: int) -> bool:
    return type(v) is int and 0 <= v < world_size


def _step(v: object) -> bool:
    return type(v) is int and v >= 0
