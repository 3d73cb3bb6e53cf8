"""`ckptrun bench --failures`: the goodput arithmetic on known event logs, the kill schedule (the
same for every configuration of one seed, replayable from its trace), and one short run of the
real thing. Nothing here asserts speed."""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone

import pytest
from conftest import ckptrun, ok

from ckptrun.bench.failures import Schedule
from ckptrun.bench.goodput import Timeline, goodput
from ckptrun.errors import UsageError


def test_goodput_of_a_known_log_is_exact():
    """Launch at 100, end at 130. Steps 1-10 by 110; killed at 111; the next process starts at
    113 from step 7 and finishes 8..15 by 120 (8, 9, 10 redone); killed at 121 and again at 122
    before any step; the last process starts at 124 from step 14 and reaches 18 by 130; a step
    finished after the end does not count."""
    tl = Timeline(launched=100.0, end=130.0, kills=[111.0, 121.0, 122.0])
    tl.starts = [(100.5, 0), (113.0, 7), (121.5, 15), (124.0, 14)]
    tl.steps = [(101.0 + i, i) for i in range(1, 11)]
    tl.steps += [(113.0 + (s - 7), s) for s in range(8, 16)]
    tl.steps += [(125.0 + (s - 15), s) for s in range(15, 19)] + [(131.0, 19)]
    g = goodput(tl)
    assert (g.duration_s, g.useful_steps, g.failures) == (30.0, 18, 3)
    assert g.goodput == 18 / 30
    assert g.kills_at == [11.0, 21.0, 22.0]
    # Reached 10, resumed at 7; reached 15, resumed at 15 (a start between two kills); reached 15, resumed at 14.
    assert g.lost_steps == [3, 0, 1]
    # Kill 1: first step after it at 114; kill 2: none before kill 3 (interrupted); kill 3: step 15 at 125.
    assert g.recovery_s == [3.0, 3.0] and g.interrupted == 1
    assert g.mean_lost == pytest.approx(4 / 3)


def test_a_run_that_starts_over_loses_what_each_process_did():
    """`none` has no checkpoint: each process starts from 0, and a kill loses what that process
    reached, not the run's best."""
    tl = Timeline(launched=0.0, end=30.0, kills=[10.0, 20.0], starts=[(1.0, 0), (11.0, 0), (21.0, 0)])
    tl.steps = [(1.0 + 0.1 * s, s) for s in range(1, 51)]  # 50 steps by 6.0
    tl.steps += [(11.0 + 0.1 * s, s) for s in range(1, 31)]  # 30 by 14.0
    tl.steps += [(21.0 + 0.1 * s, s) for s in range(1, 41)]  # 40 by 25.0
    g = goodput(tl)
    assert (g.lost_steps, g.useful_steps) == ([50, 30], 40)
    tl.kills.append(26.0)  # killed again, not started again by the end: nothing resumable stands
    assert goodput(tl).useful_steps == 0


def test_a_run_that_never_resumed_has_lost_nothing_it_can_show():
    """A kill whose next process does not start before the end: no lost-steps figure for it, and
    the run's useful steps are what a restart would resume from."""
    tl = Timeline(launched=0.0, end=10.0, kills=[5.0], starts=[(0.5, 0)], steps=[(1.0, 1), (2.0, 2)], resumable=1)
    g = goodput(tl)
    assert (g.useful_steps, g.lost_steps, g.recovery_s, g.interrupted) == (1, [], [], 0)


def test_the_schedule_depends_on_the_seed_alone():
    a, b = Schedule.draw(20.0, 300.0, seed=3), Schedule.draw(20.0, 300.0, seed=3)
    assert a == b and a.offsets != Schedule.draw(20.0, 300.0, seed=4).offsets
    rng, t, expected = random.Random(3), 0.0, []
    while (t := t + rng.expovariate(1 / 20.0)) < 300.0:
        expected.append(t)
    assert list(a.offsets) == expected and all(0 < o < 300.0 for o in a.offsets)


def test_a_trace_replays_its_schedule(tmp_path):
    s = Schedule.draw(5.0, 60.0, seed=1)
    s.write_trace(tmp_path / "trace.txt", start=datetime(2026, 1, 1, tzinfo=timezone.utc))
    back = Schedule.replay(tmp_path / "trace.txt", 60.0)
    assert back.offsets == pytest.approx(s.offsets, abs=1e-5)
    assert Schedule.replay(tmp_path / "trace.txt", s.offsets[1]).offsets == pytest.approx(s.offsets[:1], abs=1e-5)


def test_a_foreign_failure_log_starts_one_mean_gap_before_its_first_failure(tmp_path):
    t0 = datetime(2026, 3, 1, 12, 0, 0)
    (tmp_path / "log.txt").write_text("# from the cluster\n" + "\n".join(
        (t0 + timedelta(seconds=s)).isoformat() for s in (0, 10, 40)) + "\n")
    assert Schedule.replay(tmp_path / "log.txt", 100.0).offsets == (20.0, 30.0, 60.0)


@pytest.mark.parametrize(("text", "message"), [
    ("2026-03-01T12:00:00\n", "one failure and no"),
    ("yesterday\n", r"log.txt:1: 'yesterday' is not an ISO-8601 timestamp"),
    ("# ckptrun-bench-start 2026-03-01T12:00:10\n2026-03-01T12:00:00\n", "precedes"),
])
def test_bad_failure_logs_are_usage_errors(tmp_path, text, message):
    (tmp_path / "log.txt").write_text(text)
    with pytest.raises(UsageError, match=message):
        Schedule.replay(tmp_path / "log.txt", 60.0)


def test_bench_failures_runs_every_configuration_under_the_same_kills(tmp_path):
    """A strategy and `none` on the tiny model, killed (worker mode) at the same drawn times:
    every run made the schedule's kills at (or, waiting for a worker to exist, just after) its
    offsets; each row has its goodput and its ratio to `none` without failures; the trace written
    is the schedule."""
    seed, duration = 0, 14.0
    schedule = Schedule.draw(6.0, duration, seed)
    assert 1 <= len(schedule.offsets) <= 3  # (the seed is chosen for that)
    out = tmp_path / "g.json"
    ok(ckptrun(tmp_path, "bench", "--model", "tiny", "--strategies", "checkfreq", "--failures", "worker",
               "--mtbf", "6s", "--duration", f"{duration:g}s", "--seed", seed, "--repeat", 1, "--json", out,
               "--traces", tmp_path / "traces", "--dir", tmp_path / "runs"))
    doc = json.loads(out.read_text())
    assert doc["schedules"] == {"6s": [{"source": f"MTBF 6s, seed {seed}", "offsets": list(schedule.offsets)}]}
    rows = {(r["failures"], r["name"]): r for r in doc["configurations"]}
    assert list(rows) == [("no failures", "none"), ("6s", "none"), ("6s", "checkfreq")]
    free = rows["no failures", "none"]
    assert free["kills"] == 0 and free["goodput"] > 0 and free["ratio"] == 1.0
    for name in ("none", "checkfreq"):
        row = rows["6s", name]
        assert row["errors"] == [] and row["against"] == "none"
        run = row["runs"][0]
        assert len(run["kills_at"]) == len(schedule.offsets)
        for made, planned in zip(run["kills_at"], schedule.offsets, strict=True):
            assert planned <= made < planned + 8.0
        assert row["ratio"] == pytest.approx(row["goodput"] / free["goodput"])
        assert all(lost >= 0 for lost in run["lost_steps"])
    traces = list((tmp_path / "traces").iterdir())
    assert len(traces) == 1 and Schedule.replay(traces[0], duration).offsets == pytest.approx(schedule.offsets,
                                                                                              abs=1e-5)
