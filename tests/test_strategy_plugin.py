"""A strategy outside the package registers through an entry point (ckptrun.strategies.GROUP) and
runs end to end: the toy strategy of docs/architecture.md ("Adding a strategy"), its code and its
entry point taken from the docs themselves so that the two cannot drift, installed as a
`*.dist-info` folder on the PYTHONPATH of one `ckptrun` launch (workers inherit it), restores
the script's own final state. Only that launch sees it: this process's REGISTRY, which the
registry-wide tests iterate, does not."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest
from conftest import REPO, SCRIPTS, STEPS, assert_same, ckptrun, load, logged, ok, restore
from rich.console import Console

from ckptrun.storage.store import Store
from ckptrun.strategies import BUILTIN, GROUP, REGISTRY, registry
from ckptrun.tuning import plan as plan_mod
from ckptrun.tuning.intervals import daly_interval
from ckptrun.tuning.levels import Layout, failure_rates
from ckptrun.tuning.model import Inputs
from ckptrun.tuning.plan import make_plan, tier_plan
from ckptrun.tuning.profile import Costs, Profile, Slowdown, StrategyCosts
from ckptrun.tuning.report import print_report, to_json
from ckptrun.tuning.tune import TuneResult

DOCS = REPO / "docs" / "architecture.md"


def docs_block(lang: str, first_line: str) -> str:
    """The one fenced `lang` code block of the docs that starts with `first_line`."""
    blocks = re.findall(rf"^```{lang}\n(.*?)^```$", DOCS.read_text(), flags=re.MULTILINE | re.DOTALL)
    (block,) = [b for b in blocks if b.startswith(first_line)]
    return block


def install_toy(root: Path) -> None:
    """The docs' toy module and a distribution declaring the docs' entry points, under `root`."""
    code = docs_block("python", "# toy_strategy.py")
    (root / code.splitlines()[0].removeprefix("# ")).write_text(code)
    pyproject = docs_block("toml", "# pyproject.toml")  # no tomllib before Python 3.11
    assert f'[project.entry-points."{GROUP}"]' in pyproject.splitlines()
    declared = dict(re.findall(r'^([\w.-]+) = "([^"]+)"$', pyproject, flags=re.MULTILINE))
    assert declared
    install_dist(root, declared)


def install_dist(root: Path, declared: dict[str, str]) -> None:
    """A distribution under `root` declaring the strategies `declared` (name -> "module:attribute")."""
    dist = root / "ckptrun_plugin-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ckptrun-plugin\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[{GROUP}]\n" + "".join(f"{k} = {v}\n" for k, v in declared.items()))


def test_the_docs_toy_strategy_runs_from_an_entry_point(tmp_path, monkeypatch):
    plugin, run = tmp_path / "plugin", tmp_path / "run"
    plugin.mkdir()
    run.mkdir()
    install_toy(plugin)
    path = [str(plugin), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    with monkeypatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join(path))
        ok(ckptrun(run, "--strategy", "toy", "--dir", "ckpts", "--every", "4", SCRIPTS / "tracked_ema.py",
                   "--steps", STEPS, "--save-at", STEPS, "--save-path", "final.pt"))
    # 4, 8 and 12 were due (--keep 2): 12's tracked EMA is sealed after the script's update that followed the step
    assert [(m.step, m.meta["strategy"]) for m in Store(run / "ckpts").manifests()] == [(8, "toy"), (STEPS, "toy")]
    restored, _ = restore(run, run / "ckpts", STEPS)  # without the toy on the path: restore imports no strategy
    truth = load(run / "final.pt")
    assert_same({k: restored[k] for k in ("model", "optimizer")}, {k: truth[k] for k in ("model", "optimizer")})
    assert_same(restored["extra"], {"ema": truth["ema"], "data": truth["data"]})
    assert "toy" not in REGISTRY


def test_an_entry_point_that_does_not_fit_is_left_out_with_a_warning(tmp_path, monkeypatch):
    """Registered: an `Entry` under a new name. Left out, each said once: a built-in name, an
    object that is not an `Entry`, a module that does not import. (Read uncached, in-process.)"""
    (tmp_path / "plugin_entries.py").write_text("from ckptrun.strategies import Entry\n"
                                                "GOOD = Entry('plugin_entries:Nothing', 'registered')\n"
                                                "NOT_AN_ENTRY = object()\n")
    install_dist(tmp_path, {"extra": "plugin_entries:GOOD", "sync": "plugin_entries:GOOD",
                            "odd": "plugin_entries:NOT_AN_ENTRY", "broken": "no_such_module:ENTRY"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with logged() as lines:
        found = registry.__wrapped__()
    assert list(found) == [*BUILTIN, "extra"] and found["sync"] is BUILTIN["sync"]
    assert found["extra"].summary == "registered"
    assert sorted(lines) == [
        "ckptrun: warning: strategy 'broken' (no_such_module:ENTRY) left out: ModuleNotFoundError: "
        "No module named 'no_such_module'",
        "ckptrun: warning: strategy 'odd' left out: plugin_entries:NOT_AN_ENTRY is not a ckptrun.strategies.Entry",
        "ckptrun: warning: strategy 'sync' left out: the name is taken",
    ]


TUNED = '''
from dataclasses import dataclass, replace

from ckptrun.strategies import Entry
from ckptrun.tuning.model import TuningModel


@dataclass(frozen=True)
class Answer:
    every: int


class Model(TuningModel):
    def evaluate(self, inputs):
        return Answer(every=round(inputs.mtbf_s / inputs.costs.step_s / 1000))

    def settle(self, sp, sc, inputs, answer):
        return replace(sp, settings={"every": answer.every}, rule="the plug-in's own model")

    def report(self, answer):
        return f"plug-in model: a checkpoint every {answer.every} steps"


MODEL = Model()
ENTRY = Entry("plugin_tuned:Nothing", "a plug-in with a tuning model", tuning="plugin_tuned:MODEL")
'''


def test_a_plug_in_strategys_tuning_model_gets_a_row_and_a_line_like_the_built_in_ones(tmp_path, monkeypatch):
    """`ckptrun tune` learns tuning models from the registry: a plug-in's model is evaluated, its
    answer reported under the table after the built-in models' and kept in the JSON, and it
    settles the plug-in's row (which starts from the same interval plan as any other)."""
    (tmp_path / "plugin_tuned.py").write_text(TUNED)
    install_dist(tmp_path, {"tuned": "plugin_tuned:ENTRY"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plan_mod, "REGISTRY", registry.__wrapped__())
    costs = Costs(step_s=0.05, optim_s=0.004, ckpt_bytes=6 * 10**7, diff_bytes=2 * 10**7, write_Bps=4e8, load_s=0.3,
                  replay_s=0.006, record_s=0.02, free_bytes=10**11, write_s_by_inflight={1: 0.2, 2: 0.32})
    measured = [StrategyCosts(name, 0.06, delta, 0.004, Slowdown(0.002, 0.001, 0.003, 0.001, 1), 0.0, 0.2, 3)
                for name, delta in (("sync", 0.05), ("tuned", 0.004))]
    prof = Profile("train.py", [], "ck", 8, costs, measured)
    rates = failure_rates(7200.0, {})
    plan = make_plan(prof, rates, 0.05)
    result = TuneResult(prof, plan, tier_plan(prof, plan, Layout(), 0.0, None))

    sync, tuned = result.plan.strategies
    assert tuned.settings == {"every": 144} and tuned.rule == "the plug-in's own model"
    assert tuned.daly_s == pytest.approx(daly_interval(0.004, 7200.0)) and sync.settings == {"every": sync.daly_steps}
    assert result.plan.notes[-1] == "plug-in model: a checkpoint every 144 steps"
    assert len(result.plan.notes) == 1 + sum(1 for e in BUILTIN.values() if e.tuning and e.load_tuning().report(
        e.load_tuning().evaluate(Inputs(costs, {sc.name: sc for sc in measured}, 7200.0, 0.05, rates))))
    assert to_json(result)["plan"]["models"]["tuned"] == {"every": 144}
    out = io.StringIO()
    print_report(Console(file=out, width=80, color_system=None), result)  # a pipe: the table is not squeezed
    lines = out.getvalue().splitlines()
    assert [line.split("│")[1].strip("→ ") for line in lines if line.startswith("│")] == ["sync", "tuned"]
    said = lines.index(next(line for line in lines if line.startswith("recommendation: ")))
    assert lines[said - 1] == "plug-in model: a checkpoint every 144 steps"
    assert lines[said + 1].startswith(f"tiers of {plan.recommended}: ")  # its tiers: one, by default
    assert all(len(line) <= 80 for line in lines[said + 1:]), lines[said + 1:]
