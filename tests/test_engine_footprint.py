"""The checkpoint engine only moves bytes: it must not import torch (a second of start-up and
~190 MB per engine), except for the engine-side handlers that step an optimizer themselves; and
its threads share one malloc arena (ckptrun/engine/arena.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import FULL, SCRIPTS, ckptrun, ok, pack

from ckptrun.storage.store import Store, full_name
from ckptrun.strategies import REGISTRY

# Engine-side handlers that run an optimizer (lowdiff+'s replica, gockpt's roll-forward): torch is theirs.
STEPS_AN_OPTIMIZER = {"lowdiff+", "gockpt"}


def test_engine_modules_import_no_torch():
    modules = ["ckptrun.engine.server", "ckptrun.engine.region_handler"] + [
        e.engine_handler.partition(":")[0] for name, e in REGISTRY.items()
        if e.engine_handler and name not in STEPS_AN_OPTIMIZER]
    code = "import importlib, sys\n" + "".join(
        f"importlib.import_module({m!r}); assert 'torch' not in sys.modules, {m!r}\n" for m in modules)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_each_engine_imports_ahead_what_its_workers_hello_will_import():
    """The launcher starts each engine with the modules its worker's Hello will make it import
    (engine_imports): its strategy's handler, and torch.distributed only where the engine
    meets its round (--replicas, --node-local-dir). A handler that imports torch (gockpt's,
    lowdiff+'s) kept every new worker waiting for its Hello 1.6 s; a torch-free one stays so."""
    from ckptrun.config import RunConfig
    from ckptrun.launcher.run import engine_imports

    for name, e in REGISTRY.items():
        handler = [e.engine_handler.partition(":")[0]] if e.engine_handler else []
        assert engine_imports(RunConfig(strategy=name)) == tuple(handler), name
        for flags in ({"replicas": 2}, {"node_local_dir": True}):
            assert engine_imports(RunConfig(strategy=name, **flags)) == (*handler, "torch.distributed"), name


def test_reading_a_committed_part_imports_no_torch(tmp_path):
    """What a --durable upload and a partner's copy do in the engine: open a rank's part of a
    committed record through the reader's checks (the index's skeleton included). That once
    imported torch into the engine (1.3 s of CPU at the first upload, the trainer stalled)."""
    store = Store(tmp_path / "ckpts")
    store.ensure_writable()
    state = {"model": {"w": torch.ones(3, 4), "b": torch.zeros(2).bfloat16()}, "step": (1, {2: None})}
    skeleton, data, specs = pack(state)
    store.write_rank(full_name(1), 0, memoryview(data), specs, skeleton, {"step": 1})
    assert store.try_commit(full_name(1), kind="full", step=1, first_step=1, world_size=1)
    code = ("import sys\nfrom ckptrun.storage.store import Store\n"
            "from ckptrun.storage.tiers.parts import record_parts\n"
            f"store = Store({str(tmp_path / 'ckpts')!r})\n"
            "with record_parts(store, store.manifests()[-1], [0]) as (parts, manifest):\n"
            "    assert parts and manifest\n"
            "assert 'torch' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


# lowdiff's engine writes, commits and prunes records through the engine's own code, as checkfreq's
# does, and adds its diff batches: checkfreq under --full.
@pytest.mark.parametrize("strategy", [pytest.param("checkfreq", marks=FULL), "lowdiff"])
def test_a_running_engine_has_no_torch(strategy, tmp_path):
    """While it writes, commits and prunes records (what could import torch lazily)."""
    ok(ckptrun(tmp_path, "--strategy", strategy, "--every", "1", "--dir", "ckpts", SCRIPTS / "engine_footprint.py",
               tmp_path / "out.json"))
    out = json.loads((tmp_path / "out.json").read_text())
    engines = out["engines_with_torch"]
    assert len(engines) == 1 and not any(engines.values()), engines
    # One malloc arena (engine/arena.py): thread arenas each kept a freed table, the RSS rose.
    assert not any(out["thread_arenas"].values()), out["thread_arenas"]
