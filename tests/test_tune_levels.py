"""The multi-level interval model (ckptrun/tuning/levels.py) and its place in `ckptrun tune` and
the run: closed-form cases, monotonicity, the failure rates per kind, an explicit interval kept,
and tune's tiers at 80 columns and in --json (profiling replaced by fixed measurements)."""

from __future__ import annotations

import io
import json
import math

import pytest
from conftest import EXAMPLE, cli, error_line

from ckptrun.tuning import tune as tune_mod
from ckptrun.tuning.durations import failure_log_kinds, read_failure_log
from ckptrun.tuning.intervals import daly_interval, young_interval
from ckptrun.tuning.levels import (
    DEFAULT_SHARES,
    HOUR,
    FailureRates,
    Layout,
    Level,
    durable_every,
    failure_rates,
    plan_levels,
    rates_for,
)
from ckptrun.tuning.profile import Costs, Profile, Slowdown, StrategyCosts

H = 3600.0


def rates(process: float, node: float, job: float) -> FailureRates:
    """Rates from MTBFs in hours per kind (0: that kind never happens)."""
    per_s = [1 / (h * H) if h else 0.0 for h in (process, node, job)]
    return FailureRates(*per_s, source="test")


# ---- the model ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cost_s,step_s,mtbf_h", [(1.0, 1.0, 1.0), (0.05, 0.1, 2.0), (30.0, 2.0, 0.5)])
def test_one_level_is_daly_and_near_young(cost_s, step_s, mtbf_h):
    """One tier that every failure resumes from: Daly's interval in steps, within Daly's
    correction of Young's; its waste is the classic first-order one."""
    r = failure_rates(mtbf_h * H, {})
    plan = plan_levels([Level("remote", "--durable-every", cost_s, 0.0)], r, Layout(node_local_dir=True), step_s)
    (lp,) = plan.levels
    assert lp.kinds == ("process", "node", "job") and lp.rate_per_h == pytest.approx(1 / mtbf_h)
    assert lp.every == max(1, round(daly_interval(cost_s, mtbf_h * H) / step_s))
    assert lp.every * step_s == pytest.approx(young_interval(cost_s, mtbf_h * H), rel=0.3)
    t = lp.every * step_s
    assert lp.waste_s_per_h == pytest.approx(H * (cost_s / t + (t / 2) / (mtbf_h * H)))
    assert not plan.uncovered


def test_each_kind_resumes_from_the_fastest_tier_that_survives_it():
    r = rates(2, 5, 50)
    tiers = [Level("memory", "every step", 0.01, 0.0, every=1), Level("disk", "--persist-every", 0.5, 0.5),
             Level("remote", "--durable-every", 5.0, 5.0)]
    kinds = {lay: [lp.kinds for lp in plan_levels(tiers, r, lay, 0.1).levels]
             for lay in (Layout(node_local_dir=True), Layout(replicas=2), Layout())}
    assert kinds[Layout(node_local_dir=True)] == [("process",), (), ("node", "job")]
    assert kinds[Layout()] == [("process",), ("node",), ("job",)]
    # with --replicas a memory tier is copied to partners on other nodes: a lost node resumes there
    assert kinds[Layout(replicas=2)] == [("process", "node"), (), ("job",)]
    # without a remote tier nothing survives a lost job (nor, with --dir lost with its node, a lost node)
    plan = plan_levels(tiers[:2], r, Layout(node_local_dir=True), 0.1)
    assert plan.uncovered == ("node", "job") and plan.uncovered_per_h == pytest.approx(1 / 5 + 1 / 50)


def test_a_tier_no_failure_needs_is_not_copied_more_often_than_needed():
    """Rate zero: no interval at all (the end of the run only), no cost; and as its failures
    grow rarer its interval only grows."""
    step = 0.1
    copy = Level("remote", "--durable-every", 2.0, 2.0)
    disk = Level("disk", "--every", 0.01, 0.01, every=10)
    never = plan_levels([disk, copy], rates(1, 5, 0), Layout(), step).levels[1]
    assert never.every is None and never.waste_s_per_h == 0.0 and "end of the run" in never.why
    intervals = [plan_levels([disk, copy], rates(1, 5, job_h), Layout(), step).levels[1].every
                 for job_h in (1, 10, 100, 1000)]
    assert intervals == sorted(intervals) and intervals[0] < intervals[-1]


@pytest.mark.parametrize("layout", [Layout(node_local_dir=True), Layout(replicas=2)])
def test_intervals_and_waste_grow_with_the_costs(layout):
    r = failure_rates(2 * H, {})
    plans = [plan_levels([Level("disk", "--every", 0.01, 0.01, every=5), Level("remote", "--durable-every", c, c)],
                         r, layout, 0.2).levels[1] for c in (0.1, 1.0, 10.0, 100.0, 1000.0)]
    assert [p.every for p in plans] == sorted(p.every for p in plans)
    assert [p.waste_s_per_h for p in plans] == sorted(p.waste_s_per_h for p in plans)
    assert all(p.every % 5 == 0 for p in plans)  # it copies steps the tier below has
    assert plans[-1].every >= math.ceil(1000.0 / 0.2)  # never more often than its copies drain


def test_an_interval_given_is_kept():
    r = failure_rates(H, {})
    local = Layout(node_local_dir=True)
    auto = plan_levels([Level("remote", "--durable-every", 1.0, 1.0)], r, local, 1.0).levels[0]
    given = plan_levels([Level("remote", "--durable-every", 1.0, 1.0, every=7)], r, local, 1.0).levels[0]
    assert auto.every != 7 and (given.every, given.why) == (7, "given")
    assert given.copies_s_per_h == pytest.approx(H / 7)


def test_durable_every_is_the_remote_tier_of_the_model():
    """The run's --durable-every auto (the engine's drain calls this) is the remote tier that
    plan_levels gives; with --node-local-dir half the failures (node + job) resume from it by
    default, as the fixed share did before the rates per kind; a shared --dir takes node failures."""
    r = failure_rates(H, {})
    assert durable_every(1.0, 1.0, r, Layout(node_local_dir=True))[0] == round(daly_interval(1.0, 2 * H))
    assert durable_every(1.0, 1.0, r, Layout(replicas=2))[0] == round(daly_interval(1.0, 10 * H))
    assert durable_every(1.0, 1.0, rates(1, 1, 0), Layout()) == (
        None, "no failure resumes from it: copied at the end of the run only")


def test_failure_rates_split_and_explicit_kinds():
    split = failure_rates(H, {})
    assert [split.of(k) * H for k in ("process", "node", "job")] == pytest.approx(list(DEFAULT_SHARES.values()))
    assert "split by default: process 50%, node 40%, job 10%" in split.source
    node = failure_rates(H, {"node": 2 * H})  # given: kept; the rest of --mtbf split 5:1
    assert node.node == pytest.approx(1 / (2 * H)) and node.total == pytest.approx(1 / H)
    assert node.process / node.job == pytest.approx(5.0)
    alone = rates_for(0.0, {"node": 2 * H}, H)  # no --mtbf: the others keep their default shares of 1h
    assert alone.node == pytest.approx(1 / (2 * H)) and alone.process == pytest.approx(0.5 / H)
    assert "default MTBF 1h" in alone.source
    with pytest.raises(ValueError, match="fail more often than --mtbf"):
        failure_rates(H, {"node": 0.5 * H})
    with pytest.raises(ValueError, match="disagree with --mtbf"):
        failure_rates(H, {"process": 3 * H, "node": 3 * H, "job": 4 * H})
    agree = failure_rates(H, {"process": 3 * H, "node": 3 * H, "job": 3.001 * H})  # within rounding: the kinds
    assert agree.job == pytest.approx(1 / (3.001 * H), rel=1e-12)


# ---- ckptrun tune: the tiers block and --json ---------------------------------------------------


COSTS = Costs(step_s=0.05, optim_s=0.004, ckpt_bytes=6 * 10**7, diff_bytes=2 * 10**7, write_Bps=4e8, load_s=0.3,
              replay_s=0.006, record_s=0.02, free_bytes=10**11, write_s_by_inflight={1: 0.2})


@pytest.fixture
def measured(monkeypatch):
    """`ckptrun tune` with these measurements instead of profiling runs."""
    strategies = [StrategyCosts(name, 0.06, delta, delta, Slowdown(0.0, 0.0, 0.0, 0.001, 1), 0.0, 0.2, 3)
                  for name, delta in (("sync", 0.05), ("checkfreq", 0.004), ("lowdiff+", 0.002))]

    def fake(script, args, names, steps, ckpt_dir, mtbf_s, progress, repeat_budget_s):
        return Profile(str(script), list(args), ckpt_dir, steps,
                       COSTS, [s for s in strategies if s.name in names])

    monkeypatch.setattr(tune_mod, "profile", fake)


def test_tune_at_an_80_column_terminal_keeps_each_strategy_whole_and_says_what_it_left_out(tmp_path, measured,
                                                                                          monkeypatch):
    """The per-strategy table at a terminal 80 columns wide: every line fits, every strategy's
    name and setting are whole, the columns left out are named in one line; the prose wraps
    between words."""
    from rich.console import Console

    from ckptrun import cli as entry

    screen = io.StringIO()
    monkeypatch.setattr(entry, "out", Console(file=screen, width=80, force_terminal=True, color_system=None))
    proc = cli(tmp_path, "tune", "--strategies", "sync,checkfreq,lowdiff+", "--mtbf", "2h", EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    lines = screen.getvalue().splitlines()
    assert all(len(ln) <= 80 for ln in lines), "\n".join(lines)
    rows = [ln for ln in lines if ln.startswith("│")]
    for name in ("sync", "checkfreq", "lowdiff+"):
        assert any(f" {name} " in row for row in rows), (name, rows)
    assert any("--every" in row for row in rows) and "…" not in "".join(rows)
    text = " ".join(ln.strip() for ln in lines)
    assert sum(ln.startswith("not shown: ") for ln in lines) == 1
    assert "not shown: δ/ckpt, slowdown, persist, Young, Daly, CheckFreq ≥ (a wider terminal or --json" in text
    assert all(not ln.startswith(("2 ", "e ")) for ln in lines)  # no word cut at the edge


def test_tune_prints_every_tier_at_80_columns_and_its_json_has_them(tmp_path, measured):
    proc = cli(tmp_path, "tune", "--strategies", "checkfreq", "--mtbf", "2h", "--mtbf-node", "10h",
               "--upload-mbps", "50", "--node-local-dir", "--json", "t.json", EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    block = lines[next(i for i, ln in enumerate(lines) if ln.startswith("tiers of checkfreq: ")):]
    assert all(len(ln) <= 80 for ln in block), block
    text = " ".join(block)
    assert "(--mtbf-node 10h; the rest of --mtbf 2h split by default: process 83%, job 17%)" in text
    assert "  disk    --every " in text and "  remote  --durable-every " in text and "total waste" in text
    tiers = json.loads((tmp_path / "t.json").read_text())["tiers"]
    assert [lp["level"]["tier"] for lp in tiers["levels"]] == ["disk", "remote"]
    disk, remote = tiers["levels"]
    assert disk["kinds"] == ["process"] and remote["kinds"] == ["node", "job"]  # --dir lost with its node
    upload_s = COSTS.ckpt_bytes / 50e6
    assert remote["level"]["cost_s"] == pytest.approx(upload_s)
    r, lam = tiers["rates"], tiers["rates"]["node"] + tiers["rates"]["job"]
    local = Layout(node_local_dir=True)
    run_every = durable_every(upload_s, COSTS.step_s, FailureRates(**r), local)[0]  # what the run's drain takes
    assert remote["every"] == math.ceil(run_every / disk["every"]) * disk["every"]  # on the steps --dir has
    t = remote["every"] * COSTS.step_s
    assert remote["copies_s_per_h"] == pytest.approx(H * upload_s / t)
    assert remote["failures_s_per_h"] == pytest.approx(H * lam * (t / 2 + upload_s + COSTS.load_s + upload_s))
    assert r["node"] * HOUR == pytest.approx(0.1)


def test_tune_keeps_a_given_durable_every_and_plans_lowdiff_plus_two_local_tiers(tmp_path, measured):
    proc = cli(tmp_path, "tune", "--strategies", "lowdiff+", "--max-overhead", "99", "--upload-mbps", "50",
               "--durable-every", "9", "--json", "t.json", EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    tiers = json.loads((tmp_path / "t.json").read_text())["tiers"]
    assert [(lp["level"]["tier"], lp["kinds"]) for lp in tiers["levels"]] == [
        ("memory", ["process"]), ("disk", ["node"]), ("remote", ["job"])]
    assert (tiers["levels"][2]["every"], tiers["levels"][2]["why"]) == (9, "given")
    assert "  remote  --durable-every 9 (9 steps" in proc.stdout


def test_tune_with_replicas_plans_lowdiff_plus_disk_for_the_failures_partners_do_not_survive(tmp_path, measured):
    """--replicas 2: a lost node's replica comes back from its partners' memory, so the memory
    tier takes node failures too and the replica's disk interval is planned for job failures
    alone (a tenth of them by default, against half without replicas): written less often."""
    every = {}
    for replicas in ("1", "2"):
        proc = cli(tmp_path, "tune", "--strategies", "lowdiff+", "--max-overhead", "99", "--replicas", replicas,
                   "--json", f"t{replicas}.json", EXAMPLE)
        assert proc.returncode == 0, proc.stderr
        result = json.loads((tmp_path / f"t{replicas}.json").read_text())
        tiers = result["tiers"]["levels"]
        every[replicas] = tiers[1]["every"]
        assert [lp["kinds"] for lp in tiers] == ([["process"], ["node"]] if replicas == "1"
                                                 else [["process", "node"], []])
        said = " ".join(proc.stdout.split())
        assert f"({50 if replicas == '1' else 10}% of failures lose the state in memory; the others resume" in said
    assert every["2"] > 2 * every["1"]  # (Young's interval: sqrt(0.5 / 0.1) = 2.2 times longer)


@pytest.mark.parametrize("args,message", [
    (["--mtbf", "1h", "--mtbf-node", "30m"], "--mtbf-node fail more often than --mtbf"),
    (["--mtbf-job", "soon"], "--mtbf-job: invalid duration 'soon'"),
    (["--durable-every", "5"], "--durable-every needs --upload-mbps"),
    (["--durable-every", "often", "--upload-mbps", "5"], "--durable-every must be a number of steps or auto"),
])
def test_tune_bad_rates_are_one_line(tmp_path, measured, args, message):
    proc = cli(tmp_path, "tune", *args, EXAMPLE)
    assert proc.returncode == 2 and message in error_line(proc)


def test_the_run_takes_the_rates_and_refuses_contradicting_ones(tmp_path, monkeypatch):
    """The run's flags reach the configuration the engines' drain reads; a contradiction is one
    line at start, before anything is launched."""
    from ckptrun.launcher import run as launcher

    seen = []
    monkeypatch.setattr(launcher, "run", lambda cfg, *a, **k: seen.append(cfg) or 0)
    proc = cli(tmp_path, "--mtbf", "1h", "--mtbf-process", "2h", "--node-local-dir", "--durable", "r",
               "--durable-every", "12", "--max-steps", "1", EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    cfg = seen[0]
    assert (cfg.mtbf_kinds, cfg.node_local_dir, cfg.durable_every) == ({"process": 2 * H}, True, 12)
    assert cfg.options["memory_lost_share"] == pytest.approx(0.5)  # lowdiff+'s --hw-failure-share auto
    proc = cli(tmp_path, "--mtbf-node", "2h", "--mtbf-job", "20h", "--max-steps", "1", EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    cfg = seen[1]  # the kinds alone: every failure's MTBF for --every auto, the rest at its default share of 1h
    assert cfg.mtbf == pytest.approx(1 / (0.5 / H + 0.55 / H)) and cfg.options["mtbf"] == cfg.mtbf
    assert cfg.options["memory_lost_share"] == pytest.approx(0.55 / 1.05)
    proc = cli(tmp_path, "--strategy", "lowdiff+", "--nnodes", "2", "--replicas", "2", "--mtbf", "1h", "--max-steps",
               "1", EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    assert seen[2].options["memory_lost_share"] == pytest.approx(0.1)  # a lost node resumes from partners' memory
    proc = cli(tmp_path, "--mtbf", "1h", "--mtbf-process", "30m", EXAMPLE)
    assert proc.returncode == 2 and "--mtbf-process fail more often than --mtbf" in error_line(proc)


def test_a_recipe_from_tune_gives_the_run_the_same_rates(tmp_path, measured, monkeypatch):
    """tune --write: the kinds' MTBFs go into the recipe (where they are not --mtbf's default
    split), so the run plans its tiers on the rates tune planned on."""
    from ckptrun.launcher import run as launcher

    proc = cli(tmp_path, "tune", "--strategies", "checkfreq", "--mtbf", "2h", "--mtbf-job", "40h", "--node-local-dir",
               "--write", "r.yaml", "--json", "t.json", EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    tuned = json.loads((tmp_path / "t.json").read_text())["tiers"]["rates"]
    seen = []
    monkeypatch.setattr(launcher, "run", lambda cfg, *a, **k: seen.append(cfg) or 0)
    assert cli(tmp_path, "--recipe", "r.yaml", EXAMPLE).returncode == 0
    cfg = seen[0]
    run = rates_for(cfg.mtbf, cfg.mtbf_kinds, H)
    for kind in ("process", "node", "job"):
        assert run.of(kind) == pytest.approx(tuned[kind], rel=1e-3), kind
    assert "# Tiers planned with --node-local-dir" in (tmp_path / "r.yaml").read_text()
    proc = cli(tmp_path, "tune", "--strategies", "checkfreq", "--mtbf", "2h", "--write", "d.yaml", EXAMPLE)
    assert "mtbf_" not in (tmp_path / "d.yaml").read_text()  # the default split: --mtbf alone says it


LOG = """# 4 failures 2 h apart: an MTBF of 2 h
2024-05-01T00:00:00Z process
2024-05-01T02:00:00Z node   # the machine was taken back
2024-05-01 04:00:00+00:00 process
2024-05-01T06:00:00Z
"""


def test_a_failure_log_with_kinds_splits_its_mtbf_as_logged_and_a_flag_still_wins(tmp_path, measured):
    (tmp_path / "f.log").write_text(LOG)
    assert failure_log_kinds(tmp_path / "f.log") == {"process": 2, "node": 1}
    assert len(read_failure_log(tmp_path / "f.log")) == 4  # an untagged line counts in the MTBF only
    proc = cli(tmp_path, "tune", "--strategies", "checkfreq", "--failure-log", "f.log", "--json", "t.json", EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    r = json.loads((tmp_path / "t.json").read_text())["tiers"]["rates"]
    assert (r["process"] * 2 * H, r["node"] * 2 * H, r["job"]) == pytest.approx((2 / 3, 1 / 3, 0.0))
    assert "estimated from f.log split as logged: process 67%, node 33%, job 0%" in r["source"]
    proc = cli(tmp_path, "tune", "--strategies", "checkfreq", "--failure-log", "f.log", "--mtbf-node", "8h",
               "--json", "t.json", EXAMPLE)
    r = json.loads((tmp_path / "t.json").read_text())["tiers"]["rates"]
    assert r["node"] == pytest.approx(1 / (8 * H)) and r["process"] == pytest.approx(1 / (2 * H) - 1 / (8 * H))
    (tmp_path / "f.log").write_text("2024-05-01T00:00:00Z gpu\n2024-05-01T02:00:00Z\n")
    proc = cli(tmp_path, "tune", "--failure-log", "f.log", EXAMPLE)
    assert proc.returncode == 2 and "optionally followed by a kind: process, node, job" in error_line(proc)


def test_tune_gives_checkfreq_a_memory_first_row_and_its_tiers():
    """checkfreq, which holds its snapshots in memory given --persist-every, gets a second row
    (checkfreq-persist), planned from the same measured costs by the memory tier's model (lowdiff+'s
    replica's too): the trainer pays its checkpoint cost every step, the disk is written every
    P; recommended, its tiers are memory every step and disk every P, a lost node resuming from
    the memory tier with --replicas 2."""
    from dataclasses import replace

    from ckptrun.strategies.memory_first.model import persist_every, waste
    from ckptrun.tuning.plan import make_plan, tier_plan

    measured = [StrategyCosts(name, 0.06, delta, delta, Slowdown(0.0, 0.0, 0.0, 0.001, 1), 0.0, 0.2, 3)
                for name, delta in (("checkfreq", 0.004), ("lowdiff", 0.003))]
    prof = Profile("train.py", [], "ck", 8, COSTS, measured)
    r, layout = failure_rates(2 * H, {}), Layout(replicas=2)
    plan = make_plan(prof, r, 0.05, layout)
    assert [s.row for s in plan.strategies] == ["checkfreq", "checkfreq-persist", "lowdiff"]
    held = plan.strategies[1]
    share = layout.memory_lost_share(r)
    every = persist_every(0.2, COSTS.step_s, 2 * H, share)[0]
    lost, wasted = waste(0.004, 0.2, COSTS.step_s, every, 2 * H, COSTS.load_s, share)
    assert held.settings == {"persist_every": every} and share == pytest.approx(0.1)
    assert (held.prediction.overhead, held.prediction.lost_work_s, held.prediction.waste) == pytest.approx(
        (0.004 / COSTS.step_s, lost, wasted))
    assert "--persist-every auto takes it from the same flags" in held.rule
    tiers = tier_plan(prof, replace(plan, recommended="checkfreq-persist"), layout, 0.0, None)
    assert [(lp.level.tier, lp.level.flag, lp.kinds, lp.every) for lp in tiers.levels] == [
        ("memory", "every step", ("process", "node"), 1), ("disk", f"--persist-every {every}", (), every)]
