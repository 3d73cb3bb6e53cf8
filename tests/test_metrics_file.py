"""The metrics a real run emits: one line per step per rank, commits, and a durable step that
never runs ahead of what `ckptrun ls` shows as committed; line-based output off a terminal."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import EXAMPLE, TINY, ckptrun, cli, ok

from ckptrun.ipc.events import STALL_CAUSES
from ckptrun.launcher.console.metrics_state import MetricsState
from ckptrun.restore.recovery import restorable
from ckptrun.storage.store import Store

STEP_FIELDS = {"t", "rank", "step", "step_s", "stall_s", "bytes", "inflight", "last_snapshot_step",
               "last_durable_step"}


@pytest.fixture(scope="module")
def lowdiff_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], str]:
    cwd = tmp_path_factory.mktemp("metrics")
    proc = ok(ckptrun(cwd, "--strategy", "lowdiff", "--full-every", "4", "--batch", "3", "--keep", "0",
                      "--nproc-per-node", "2", "--metrics-file", "m.jsonl", "--dir", "ck", "--no-dashboard",
                      "--log-interval", "0.5", EXAMPLE, *TINY))
    events = [json.loads(line) for line in (cwd / "m.jsonl").read_text().splitlines()]
    return cwd, events, proc.stderr


def test_one_valid_step_line_per_step_and_rank(lowdiff_run) -> None:
    _, events, _ = lowdiff_run
    steps = [e for e in events if e["type"] == "step"]
    for rank in (0, 1):
        mine = [e for e in steps if e["rank"] == rank]
        assert [e["step"] for e in mine] == list(range(1, int(TINY[TINY.index("--steps") + 1]) + 1))
        for e in mine:
            assert STEP_FIELDS <= set(e), STEP_FIELDS - set(e)
            assert set(STALL_CAUSES) <= set(e["stall_s"]) <= {*STALL_CAUSES, "setup"}  # (setup: a first wait)
            assert e["step_s"] > 0 and e["bytes"] >= 0
    commits = [e for e in events if e["type"] == "commit"]
    assert {e["kind"] for e in commits} == {"full", "diff"} and all(e["ranks"] == 2 for e in commits)


def test_durable_step_never_ahead_of_committed(lowdiff_run) -> None:
    cwd, events, _ = lowdiff_run
    committed = set(restorable(Store(cwd / "ck")))
    listed = json.loads(ok(cli(cwd, "ls", "--dir", "ck", "--json")).stdout)
    assert max(committed) == max(r["step"] for r in listed)
    durable = [e["last_durable_step"] for e in events if e["type"] == "step" and e["last_durable_step"] is not None]
    assert durable, "no step ever reported a durable step"
    assert all(d in committed for d in durable), sorted(set(durable) - committed)


def test_batch_log_has_progress_lines_and_the_exit_summary(lowdiff_run) -> None:
    """--no-dashboard (or no terminal): the log, through logging on stderr, has the progress lines
    (step, durable step, work at risk, stall, bandwidth) and the exit summary, last."""
    _, _, stderr = lowdiff_run
    assert "\x1b[" not in stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("ckptrun: ")]
    assert re.search(r"^ckptrun: step \d+ \| .* \| durable .* \| at risk .* \| stall .* MB/s", stderr, re.M), stderr
    assert lines[-1].startswith("ckptrun: summary: steps 12 ") and "checkpoints committed" in lines[-1]


def test_header_follows_settings_chosen_at_run_time() -> None:
    state = MetricsState()
    state.apply({"type": "run", "t": 1.0, "rank": 0, "strategy": "lowdiff", "settings": {"full_every": 50,
                                                                                         "batch": 4}})
    state.apply({"type": "interval", "t": 2.0, "rank": 0, "step": 25, "strategy": "lowdiff", "full_every": 531,
                 "batch": 6, "reason": "measured"})
    assert state.settings == {"full_every": 531, "batch": 6}
