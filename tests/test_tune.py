"""`ckptrun tune`, recipes, `--every auto` and `--max-steps`: tune profiles the tiny example within a
minute and writes a recipe the run command runs as is; every shipped recipe is accepted; bad input
is a one-line error; the online interval follows the measured costs and says why."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from conftest import EXAMPLE, REPO, TINY, assert_training_state, ckptrun, error_line, ok, restore

from ckptrun import cli
from ckptrun.launcher import run as launcher
from ckptrun.storage.store import Store
from ckptrun.strategies import REGISTRY
from ckptrun.tuning.intervals import daly_interval, young_interval
from ckptrun.worker.decisions import FIRST_EVAL, DalyInterval, Decision, PersistBound, Retuner

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
SMALL = ["--layers", "1", "--d-model", "32", "--threads", "1"]


def committed(ckpt_dir: Path) -> list[int]:
    return [m.step for m in Store(ckpt_dir).manifests()]


def events(metrics_dir: Path, kind: str) -> list[dict]:
    lines = (metrics_dir / "worker-0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("type") == kind]


# ---- tune end to end ----------------------------------------------------------------------------


def test_tune_tiny_example_within_a_minute_writes_a_recipe_that_runs(tmp_path):
    log = tmp_path / "failures.log"  # three failures two hours apart: MTBF 2h
    log.write_text("# past failures\n2024-05-01T00:00:00Z\n2024-05-01T02:00:00Z\n2024-05-01T04:00:00Z\n")
    t0 = time.monotonic()
    proc = ok(ckptrun(tmp_path, "tune", "--strategies", "sync,checkfreq", "--profile-steps", "8",
                      "--failure-log", log, "--dir", "ck", "--write", "tuned.yaml", "--json", "tune.json",
                      EXAMPLE, *TINY))
    elapsed = time.monotonic() - t0
    assert elapsed < 60, f"tune took {elapsed:.0f} s"
    assert "recommendation: " in proc.stdout
    result = json.loads((tmp_path / "tune.json").read_text())
    plan, costs = result["plan"], result["profile"]["costs"]
    assert plan["mtbf_s"] == 7200.0 and "failures.log" in plan["mtbf_source"]
    for key in ("step_s", "ckpt_bytes", "diff_bytes", "write_Bps", "load_s", "replay_s"):
        assert costs[key] > 0, key
    assert [s["name"] for s in plan["strategies"]] == ["sync", "checkfreq"]
    for s in plan["strategies"]:
        assert s["young_s"] == pytest.approx(young_interval(s["delta_s"], 7200.0))
        assert s["daly_s"] == pytest.approx(daly_interval(s["delta_s"], 7200.0))
        assert s["settings"]["every"] == max(s["daly_steps"], s["checkfreq_min_steps"], s["budget_min_steps"])
        assert 0 < s["prediction"]["waste"] < 1
    assert plan["lowdiff"]["agrees"] and tuple(plan["lowdiff"]["numeric"]) == (plan["lowdiff"]["full_every"],
                                                                               plan["lowdiff"]["batch"])
    best = result["recommendation"]
    assert best["strategy"] == min(plan["strategies"], key=lambda s: s["prediction"]["waste"])["name"]
    assert not (tmp_path / "ck").exists()  # the scratch folder is gone (and --dir, which tune created)

    recipe = yaml.safe_load((tmp_path / "tuned.yaml").read_text())
    assert recipe == {"strategy": best["strategy"], **best["settings"], "mtbf": "2h", "dir": "ck"}
    ok(ckptrun(tmp_path, "--recipe", "tuned.yaml", EXAMPLE, *SMALL, "--steps", "4"))
    assert committed(tmp_path / "ck")[-1] == 4


def test_script_failing_during_profiling_is_a_one_line_error(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("import torch\nm = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "for i in range(5):\n    m(torch.ones(1, 2)).sum().backward()\n    opt.step()\n"
                      "    if i == 1:\n        raise ValueError('boom in step 2')\n")
    proc = ckptrun(tmp_path, "tune", "--strategies", "checkfreq", "--dir", "ck", script)
    line = error_line(proc)
    assert proc.returncode == 1
    assert "profiling run 'sync' failed" in line and "ValueError: boom in step 2" in line
    assert not (tmp_path / "ck").exists()


def test_mtbf_shorter_than_one_step_is_refused(tmp_path):
    proc = ckptrun(tmp_path, "tune", "--strategies", "checkfreq", "--profile-steps", "2", "--mtbf", "1ms",
                   "--dir", "ck", EXAMPLE, *TINY)
    assert proc.returncode == 2
    assert "shorter than one training step" in error_line(proc)


@pytest.mark.parametrize("args,message", [
    (["tune", "--mtbf", "-30m"], "--mtbf: invalid duration '-30m': it is negative"),
    (["tune", "--mtbf", "soon"], "--mtbf: invalid duration 'soon'"),
    (["tune", "--mtbf", "0s"], "--mtbf: invalid duration '0s': it is zero"),
    (["tune", "--mtbf", "1h", "--failure-log", "f.log"], "either --mtbf or --failure-log"),
    (["tune", "--failure-log", "f.log"], "need at least two failure timestamps"),
    (["tune", "--max-overhead", "abc"], "--max-overhead must be a percentage"),
    (["tune", "--strategies", "sync,nope"], "unknown strategy 'nope'"),
    (["tune", "--dir", "f.log/sub"], "cannot write into --dir f.log/sub"),
    (["--every", "auto", "--mtbf", "2 weeks"], "--mtbf: invalid duration"),
    (["--every", "often"], "--every must be a number of steps or auto"),
])
def test_bad_input_is_a_one_line_usage_error(tmp_path, args, message):
    (tmp_path / "f.log").write_text("2024-05-01T00:00:00Z\n")
    proc = ckptrun(tmp_path, *args, EXAMPLE)
    assert proc.returncode == 2
    assert message in error_line(proc)


# ---- recipes ----------------------------------------------------------------------------------


def test_every_strategy_has_a_recipe_and_both_scenarios_exist():
    names = {p.stem for p in RECIPES}
    assert set(REGISTRY) <= names
    assert {"spot-30m", "stable-1d"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_is_accepted_by_the_run_command(recipe, tmp_path, monkeypatch):
    seen = []

    def preflight_only(cfg, opts, script, args, **launch_kwargs):  # the run command's own checks, nothing launched
        launcher.preflight(cfg, script).release()
        seen.append(cfg)
        return 0

    monkeypatch.setattr(launcher, "run", preflight_only)
    assert cli.main(["--recipe", str(recipe), "--dir", str(tmp_path / "ck"), str(EXAMPLE)]) == 0
    values = yaml.safe_load(recipe.read_text())
    cfg = seen[0]
    assert cfg.strategy == values["strategy"] and cfg.dir == str(tmp_path / "ck")
    assert cfg.every_auto == (values.get("every") == "auto")


def test_recipe_unknown_key_and_command_line_override(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(launcher, "run", lambda cfg, opts, script, args, **kw: seen.append((cfg, opts)) or 0)
    bad = tmp_path / "bad.yaml"
    bad.write_text("strategy: sync\nevery_step: 3\n")
    assert cli.main(["--recipe", str(bad), str(EXAMPLE)]) == 2
    good = tmp_path / "good.yaml"
    good.write_text("strategy: sync\nevery: 7\nmtbf: 45m\nmax_restarts: 2\n")
    assert cli.main(["--recipe", str(good), "--every", "3", str(EXAMPLE)]) == 0
    cfg, opts = seen[0]
    assert (cfg.strategy, cfg.every, cfg.mtbf, opts.max_restarts) == ("sync", 3, 2700.0, 2)


def test_stable_cluster_recipe_runs_with_every_auto(tmp_path):
    """The shipped recipe (every: auto, mtbf: 1d) on the example: the interval is set after the
    first estimate, logged with its reason, and the checkpoints follow it."""
    proc = ok(ckptrun(tmp_path, "--recipe", REPO / "recipes" / "stable-1d.yaml", "--dir", "ck", "--keep", "0",
                      "--metrics-dir", "m", EXAMPLE, *TINY))
    changes = events(tmp_path / "m", "interval")
    assert len(changes) == 1 and changes[0]["step"] == FIRST_EVAL
    every = changes[0]["every"]
    assert every > 1 and "Daly interval" in changes[0]["reason"] and "MTBF 1d" in changes[0]["reason"]
    assert f"--every auto: every 1 -> {every} steps" in proc.stderr
    steps = int(TINY[TINY.index("--steps") + 1])
    expected = sorted({1, 2, 3, *range(every, steps + 1, every), steps})
    assert committed(tmp_path / "ck") == expected


def test_max_steps_stops_after_a_complete_step(tmp_path, example_truth):
    """The state of the last step includes what the script updates after optimizer.step()
    (the LR scheduler): equal to the script's own save at that step."""
    proc = ok(ckptrun(tmp_path, "--max-steps", "5", "--dir", "ck", EXAMPLE, *TINY))
    assert "stopped the script after step 5 (--max-steps)" in proc.stderr
    assert committed(tmp_path / "ck")[-1] == 5
    state, _ = restore(tmp_path, tmp_path / "ck", 5)
    assert_training_state(state, example_truth(5))


# ---- the online policy, fed measurements --------------------------------------------------------


class Trainer:
    """Drives `--every auto` as the runtime does: a step takes `step_s` plus `delta_s` when it
    hands a checkpoint over (the step after its capture)."""

    def __init__(self, retuner: Retuner) -> None:
        self.retuner, self.policy, self.step, self.pending = retuner, retuner.policies[0], 0, False

    def run(self, n: int, step_s: float, delta_s: float) -> None:
        for _ in range(n):
            self.step += 1
            stall = delta_s if self.pending else 0.0
            self.pending = self.policy.due(self.step)
            self.retuner.after_step(self.step, {"step_s": step_s + stall, "stall_s": {"snapshot": stall},
                                                "last_snapshot_step": self.step if self.pending else None})


def every_auto(mtbf_s: float = 3600.0) -> tuple[Trainer, list[tuple[int, Decision]]]:
    log: list[tuple[int, Decision]] = []
    retuner = Retuner(mtbf_s, on_change=lambda step, policy, d: log.append((step, d)))
    retuner.add(PersistBound(DalyInterval()))
    return Trainer(retuner), log


def test_every_auto_starts_from_the_first_estimate_and_follows_the_cost():
    trainer, log = every_auto()
    trainer.run(FIRST_EVAL, 0.1, 0.002)  # δ = 2 ms: Daly ≈ sqrt(2·0.002·3600) = 3.8 s = 38 steps
    assert trainer.policy.every == round(daly_interval(0.002, 3600) / 0.1) == 38
    assert log[0][0] == FIRST_EVAL and "every 1 -> 38 steps" in log[0][1].reason
    trainer.run(200, 0.1, 0.002)
    assert len(log) == 1  # unchanged costs: no flapping
    trainer.run(1000, 0.1, 0.032)  # a 16x costlier checkpoint: the interval grows about 4x
    assert trainer.policy.every == round(daly_interval(0.032, 3600) / 0.1) == 152
    step, decision = log[-1]
    assert f"-> 152 steps at step {step}: " in decision.reason and "checkpoint cost 32ms" in decision.reason


def test_every_auto_respects_the_checkfreq_bound_and_ignores_noise():
    trainer, log = every_auto()
    trainer.run(FIRST_EVAL, 0.1, 0.002)
    trainer.retuner.observe_write(10**6, 9.0)  # persisting takes 9 s: at least 90 steps between checkpoints
    trainer.run(50, 0.1, 0.002)
    assert trainer.policy.every == 90 and "CheckFreq bound of 90 steps" in log[-1][1].reason
    trainer, qlog = every_auto()
    trainer.run(FIRST_EVAL, 0.1, 0.002)
    trainer.run(300, 0.1, 0.0024)  # +20% cost moves Daly's interval by ~10%: kept
    assert trainer.policy.every == 38 and len(qlog) == 1


def test_every_auto_adopts_the_shared_decision_of_rank_zero():
    trainer, _ = every_auto()
    trainer.retuner._share = lambda step, mine: [Decision({"every": 7}, "rank 0 says so")]
    trainer.run(FIRST_EVAL, 0.1, 0.002)
    assert trainer.policy.every == 7


def test_decisions_travel_between_ranks_as_json():
    """What rank 0 publishes in the job store is what the other ranks adopt."""
    d = Decision({"full_every": 12, "batch": 3}, "because")
    assert Decision.from_json(json.loads(json.dumps(d.to_json()))) == d
