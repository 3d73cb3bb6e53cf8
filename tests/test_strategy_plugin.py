"""A strategy outside the package registers through an entry point (ckptrun.strategies.GROUP) and
runs end to end: the toy strategy of docs/architecture.md ("Adding a strategy"), its code and its
entry point taken from the docs themselves so that the two cannot drift, installed as a
`*.dist-info` folder on the PYTHONPATH of one `ckptrun` launch (workers inherit it), restores
the script's own final state. Only that launch sees it: this process's REGISTRY, which the
registry-wide tests iterate, does not."""

from __future__ import annotations

import os
import re
from pathlib import Path

from conftest import REPO, SCRIPTS, STEPS, assert_same, ckptrun, load, logged, ok, restore

from ckptrun.storage.store import Store
from ckptrun.strategies import BUILTIN, GROUP, REGISTRY, registry

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
