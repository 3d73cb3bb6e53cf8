"""What a worker keeps for the one restarted after it, in the run's private folder (the
launcher's, node-local): the budget's no-checkpoint step and the intervals the run decided, so a
recovery neither probes again (a resumed chain cannot skip steps) nor starts over at every step
and pays the first checkpoints' cost a second time. One small JSON file per rank, replaced
atomically, read back as a file anything may have damaged: only sound values come out."""

from __future__ import annotations

import json
import math
import os
from typing import Any


class Kept:
    """One rank's kept values ("" as the path: kept nowhere, as in a test)."""

    def __init__(self, path: str = "") -> None:
        self.path = path
        self._data = self._read()

    def number(self, key: str) -> float | None:
        """A positive finite number kept under `key`, else None."""
        value = self._data.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        return float(value) if ok else None

    def settings(self, key: str) -> dict[str, int] | None:
        """A policy's settings kept under `key` (names to positive whole numbers), else None."""
        value = self._data.get(key)
        if not isinstance(value, dict) or not value:
            return None
        ok = all(isinstance(k, str) and type(v) is int and v > 0 for k, v in value.items())
        return dict(value) if ok else None

    def words(self, key: str) -> list[str]:
        """The strings kept under `key` (a list of them), else none."""
        value = self._data.get(key)
        return [w for w in value if isinstance(w, str)] if isinstance(value, list) else []

    def set(self, key: str, value: Any) -> None:
        self._data[key] = value
        if self.path:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self._data, f)
            os.replace(tmp, self.path)

    def _read(self) -> dict[str, Any]:
        try:
            with open(self.path) as f:
                data = json.load(f) if self.path else {}
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}
