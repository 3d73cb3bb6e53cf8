"""A pytest plugin for the check's test parts: of the tests selected, keep only those the last
device runs did not pass (GPUCHECK_KEEP=owed: failed, not reached, or new) or only those they
passed (GPUCHECK_KEEP=passed), by the list of passed tests in GPUCHECK_LAST (plan.py); any
other GPUCHECK_KEEP keeps them all."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

KEEP, LAST = "GPUCHECK_KEEP", "GPUCHECK_LAST"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep = os.environ.get(KEEP)
    if keep not in ("owed", "passed"):
        return
    passed = set(json.loads(Path(os.environ[LAST]).read_text())["passed"])
    chosen = [item for item in items if (item.nodeid in passed) == (keep == "passed")]
    dropped = [item for item in items if item not in chosen]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = chosen
