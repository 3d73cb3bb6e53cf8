"""A pytest plugin for the check's test parts: each failure's traceback printed as it happens,
so a part stopped at its budget still shows why its earlier tests failed."""
from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        print(f"\n---- {report.nodeid} failed in {report.when}:\n{report.longreprtext}\n", flush=True)
