"""--host-memory: one host-memory budget per node that every staging buffer respects
(ckptrun/memory_budget.py). Sizes and the refusal line at unit level; end to end, a run with a
budget just above its strategy's minimum completes and its staging (the shared-memory files its
processes map, sampled from outside) never exceeds the budget; an explicit setting that does not
fit is refused at start (exit 2, one line naming the budget and the setting's need)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import SCRIPTS, ckptrun, error_line, spawn, strategy_params

from ckptrun.bench.procmem import PeakMemory
from ckptrun.memory_budget import Budget, BudgetError, fmt, parse_size
from ckptrun.strategies import REGISTRY

MB = 2**20
WIDTH = "4096"  # the soak script's hidden units: ~1 MB of parameters and Adam state, slots of ~1.3 MB
BUDGET_DEFAULT = ("checkfreq", "lowdiff")


def test_sizes():
    assert parse_size("8G") == 8 << 30 and parse_size("512M") == 512 << 20 and parse_size("1.5GiB") == 3 << 29
    assert parse_size("4096") == 4096 and parse_size("64kb") == 64 << 10
    for bad in ("", "lots", "-1G", "0", "5X"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert fmt(3 << 29) == "1.50 GiB" and fmt(1536) == "1.5 KiB" and fmt(12) == "12 B"


def test_budget_room_and_refusal_line():
    b = Budget(100 * MB, node=200 * MB, nlocal=2, source="--host-memory 200M")
    b.set("staging slots", 60 * MB, least=30 * MB)
    assert b.room("lowdiff batch") == 40 * MB and b.fits("lowdiff batch", 40 * MB)
    with pytest.raises(BudgetError) as e:
        b.claim("lowdiff batch", 50 * MB, "--batch 500")
    line = str(e.value)
    assert "\n" not in line and e.value.exit_code == 2
    assert "--batch 500" in line and "50.0 MiB" in line and "200.0 MiB per node" in line and "100.0 MiB" in line
    b.claim("lowdiff batch", 40 * MB, "--batch 400")
    assert b.used == 100 * MB and b.minimum == 70 * MB and b.report()["host_memory_uses"]["lowdiff batch"] == 40 * MB
    assert Budget(0).room("x") > 1 << 60  # no budget (a configuration from before the flag): nothing refused


def test_a_size_that_is_not_one_is_refused(tmp_path):
    proc = ckptrun(tmp_path, "run", "--host-memory", "lots", SCRIPTS / "soak.py", 10, tmp_path / "p")
    assert proc.returncode == 2 and "--host-memory" in error_line(proc)


def events(path: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e.get("type") == kind]


def run(tmp_path: Path, name: str, strategy: str, budget: str, *flags: str, steps: int = 40) -> tuple[int, float]:
    """A run of the soak script with `budget`; (exit code, peak staging bytes sampled)."""
    args = ["run", "--strategy", strategy, "--dir", f"ckpts-{name}", "--host-memory", budget, "--no-dashboard",
            "--metrics-file", f"{name}.jsonl", *REGISTRY[strategy].short_run_flags, *flags,
            SCRIPTS / "soak.py", steps, tmp_path / f"progress-{name}", WIDTH]
    proc = spawn(tmp_path, *args, log=f"{name}.log")
    peak = PeakMemory(proc.pid, include_root=True, interval_s=0.02).start()
    code = proc.wait(timeout=240)
    return code, peak.stop().staging_MB * MB


@pytest.mark.parametrize("strategy", strategy_params(BUDGET_DEFAULT))
def test_a_budget_just_above_the_minimum_holds(strategy, tmp_path):
    code, staging = run(tmp_path, "probe", strategy, "1G")
    assert code == 0, (tmp_path / "probe.log").read_text()[-3000:]
    reports = events(tmp_path / "probe.jsonl", "host_memory")
    if not reports:  # nothing staged in host memory (lightcheck --copy-to region: a mapped file in --dir)
        assert staging == 0, f"{fmt(staging)} of staging mapped and none reported"
        return
    least = reports[-1]["host_memory_min"]
    budget = math.ceil(least * 1.1 / 1024) * 1024
    code, staging = run(tmp_path, "tight", strategy, f"{budget // 1024}K")
    log = (tmp_path / "tight.log").read_text()
    assert code == 0, log[-3000:]
    assert "host-memory budget:" in log
    reports = events(tmp_path / "tight.jsonl", "host_memory")
    assert reports and all(r["host_memory"] == budget and r["host_memory_peak"] <= budget for r in reports), reports
    assert staging <= budget, f"{fmt(staging)} of staging mapped, budget {fmt(budget)}"
    steps = [e["step"] for e in events(tmp_path / "tight.jsonl", "commit")]
    assert steps and max(steps) == 40, steps


@pytest.mark.parametrize(("strategy", "setting"), [("checkfreq", ("--max-inflight", "8")),
                                                   ("lowdiff", ("--full-every", "8", "--batch", "400"))])
def test_an_explicit_setting_that_does_not_fit_is_refused(strategy, setting, tmp_path):
    args = ["run", "--strategy", strategy, "--dir", "ckpts", "--host-memory", "4M", "--no-dashboard", *setting,
            SCRIPTS / "soak.py", 20, tmp_path / "p", WIDTH]
    proc = ckptrun(tmp_path, *args)
    line = error_line(proc)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{setting[-2]} {setting[-1]} does not fit the host-memory budget" in line and "4.0 MiB" in line, line


class _Ctx:
    """The two things LowDiff's batch choice asks its context for."""

    rank, step = 0, 7

    def __init__(self, budget: Budget) -> None:
        self.host_memory, self.events = budget, []

    def emit(self, **event) -> None:
        self.events.append(event)


def _lowdiff(budget: Budget, batch: str):
    from ckptrun.strategies.lowdiff.policy import FullEveryBatch
    from ckptrun.strategies.lowdiff.trainer import LowDiff

    s = object.__new__(LowDiff)
    s.ctx, s.fb = _Ctx(budget), FullEveryBatch("auto", batch)
    return s


def test_lowdiff_batch_is_chosen_within_the_budget():
    """An auto B the budget cannot hold is lowered to what fits (said once, as the budget's
    decision); an explicit --batch that does not fit is refused; without a budget B stands."""
    budget = Budget(10 * MB, node=10 * MB, source="--host-memory 10M")
    budget.set("staging slots", 4 * MB)
    auto = _lowdiff(budget, "auto")
    auto.fb.batch = 400  # what the cost model asked for
    assert auto._batch_within_budget(MB) == 2  # 6 MB left, 1.125 MB per diff held, twice (one batch written)
    assert budget.used <= budget.total and budget.minimum == 4 * MB + 2 * (MB + MB // 8 + 64)
    assert [e["setting"] for e in auto.ctx.events] == ["batch"] and "budget decided" in auto.ctx.events[0]["reason"]
    assert auto._batch_within_budget(MB) == 2 and len(auto.ctx.events) == 1  # said once
    with pytest.raises(BudgetError, match="--batch 400 does not fit"):
        _lowdiff(budget, "400")._batch_within_budget(MB)
    assert _lowdiff(Budget(0), "400")._batch_within_budget(MB) == 400
