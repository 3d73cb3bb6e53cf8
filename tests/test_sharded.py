"""Sharded state (DTensor: FSDP2's fully_shard) on CPU/gloo: captured as each rank's shards,
restored whole, resumed bit-exact at the same world size and resharded at another.

The script (tests/scripts/dp_mlp.py) trains every rank on the same batch, so its 2-rank
FSDP2 run computes exactly what the unsharded model does in one process: the plain run is the
reference, bit for bit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import (
    FULL,
    REPRESENTATIVES,
    SCRIPTS,
    STRATEGIES,
    assert_training_state,
    ckptrun,
    cli,
    copy_dir,
    error_line,
    load,
    ok,
    restore,
    run_events,
    run_in_process,
    verify,
)
from test_untrusted_dir import reseal

from ckptrun.storage.sharding import Sharded, assemble, local_box, shard_of
from ckptrun.storage.store import Store, full_name, rank_files
from ckptrun.strategies import REGISTRY

SCRIPT = SCRIPTS / "dp_mlp.py"
STEPS, EARLY = 8, 4


@pytest.mark.parametrize("shape, mesh, placements", [
    ((7, 3), (2,), ("S0",)), ((7, 3), (4,), ("S0",)), ((3, 5), (4,), ("S1",)), ((7, 5), (2, 3), ("S0", "S1")),
    ((9,), (2, 2), ("S0", "S0")), ((6, 4), (2, 2), ("R", "S0")), ((2,), (3,), ("S0",)),
])
def test_placement_rule_is_dtensors(shape, mesh, placements):
    """The shard boxes are those DTensor computes, and shards assemble back into the tensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    objs = [Replicate() if p == "R" else Shard(int(p[1:])) for p in placements]
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    pieces = []
    for coord in torch.cartesian_prod(*[torch.arange(k) for k in mesh]).reshape(-1, len(mesh)).tolist():
        offset, size = local_box(shape, mesh, tuple(coord), placements)
        local_shape, global_offset = _compute_local_shape_and_global_offset(shape, mesh, coord, objs)
        assert size == tuple(local_shape)
        if all(size):
            assert offset == tuple(global_offset)
        pieces.append(Sharded(shape, mesh, tuple(coord), placements, shard_of(full, mesh, tuple(coord), placements),
                              "k"))
    assert torch.equal(assemble(pieces, "k"), full)


def test_assemble_refuses_shards_that_do_not_make_a_tensor():
    full = torch.arange(8.0)
    half = [Sharded((8,), (2,), (c,), ("S0",), shard_of(full, (2,), (c,), ("S0",)), "k") for c in (0, 1)]
    with pytest.raises(ValueError, match=re.escape("no rank holds mesh coordinate [1]")):
        assemble([half[0], half[0]], "k")
    other = Sharded((8,), (2,), (1,), ("S0",), half[1].local.double(), "k")
    with pytest.raises(ValueError, match="disagree"):
        assemble([half[0], other], "k")


FSDP_RUN = "checkfreq"  # the strategy of the module's FSDP2 run (`fsdp_run`)


def killed_run(cwd: Path, strategy: str, *extra: str) -> None:
    """A 2-rank FSDP2 run of `strategy` into cwd/ckpts whose rank 1 is killed mid-step 5 and
    restarted; the script saves its final state (full-STEPS.pt)."""
    ok(ckptrun(cwd, "--nproc-per-node", "2", "--strategy", strategy, *REGISTRY[strategy].short_run_flags,
               "--dir", "ckpts", *extra, "--max-restarts", "1", "--metrics-dir", "metrics", SCRIPT, "--steps", STEPS,
               "--save-at", STEPS, fault="kill:step=5:rank=1"))


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    """The unsharded reference (plain/full-N.pt) and FSDP_RUN's killed 2-rank FSDP2 run keeping
    every step (ckpts): what the restore and resharding tests read, and FSDP_RUN's case below."""
    cwd = tmp_path_factory.mktemp("fsdp")
    (cwd / "plain").mkdir()
    run_in_process(cwd / "plain", SCRIPT, "--wrap", "plain", "--steps", STEPS, "--save-at", f"{EARLY},{STEPS}")
    killed_run(cwd, FSDP_RUN, "--keep", "0")
    return cwd


def truth(fsdp_run: Path, step: int) -> dict:
    return load(fsdp_run / "plain" / f"full-{step}.pt")


def test_consolidated_restore_equals_the_unsharded_run(fsdp_run, tmp_path):
    m = Store(fsdp_run / "ckpts").manifests()[-1]
    assert (m.step, m.world_size) == (STEPS, 2)
    for step in (EARLY, STEPS):
        state, _ = restore(tmp_path, fsdp_run / "ckpts", step)
        assert_training_state(state, truth(fsdp_run, step))
    from safetensors.torch import load_file

    ok(cli(tmp_path, "restore", "--dir", fsdp_run / "ckpts", "--step", STEPS, "--format", "safetensors",
           "--out", "s.safetensors"))
    tensors = load_file(tmp_path / "s.safetensors")
    for key, t in truth(fsdp_run, STEPS)["model"].items():
        assert torch.equal(tensors[f"model/{key}"], t), key


@pytest.mark.parametrize("ranks", [1, 4])
def test_resume_at_another_world_size_reshards(fsdp_run, tmp_path, ranks):
    """Saved on 2 ranks, resumed on 1 or 4: the state the script resumes with is the consolidated
    checkpoint, and training goes on, checkpointed at the new world size."""
    ckpt = copy_dir(fsdp_run / "ckpts", tmp_path / "ckpts", up_to=EARLY)
    proc = ok(ckptrun(tmp_path, "--nproc-per-node", ranks, "--strategy", "checkfreq", "--dir", ckpt, SCRIPT,
                      "--steps", STEPS + 2, "--resumed-out", "resumed.pt"))
    assert f"resharding step {EARLY} from 2 to {ranks} ranks" in proc.stderr
    assert_training_state(load(tmp_path / "resumed.pt"), truth(fsdp_run, EARLY))
    m = Store(ckpt).manifests()[-1]
    assert (m.step, m.world_size) == (STEPS + 2, ranks)
    restore(tmp_path, ckpt, STEPS + 2)


@pytest.mark.parametrize("strategy, says", [("checkfreq", "no sharded (DTensor) or DDP-replicated state"),
                                             ("lowdiff", "is a replay chain written by 1 ranks")])
def test_unsharded_state_and_replay_chains_are_not_resharded(tmp_path, strategy, says):
    flags = ["--strategy", strategy, *REGISTRY[strategy].short_run_flags, "--dir", "ckpts", SCRIPT, "--wrap", "plain"]
    ok(ckptrun(tmp_path, *flags, "--steps", 2))
    line = error_line(ckptrun(tmp_path, "--nproc-per-node", "2", *flags, "--steps", 4))
    assert says in line and "this run has 2" in line and "launch 1 ranks" in line, line


# The killed 2-rank runs for the representatives that support sharded state, and one strategy's
# refusal (the check is one for every strategy: worker/runtime.py, on the registry's `sharded`);
# every strategy under --full.
REFUSAL = "lowdiff"
assert not REGISTRY[REFUSAL].sharded


@pytest.mark.parametrize("strategy", [
    pytest.param(s, marks=() if s == REFUSAL or (s in REPRESENTATIVES and REGISTRY[s].sharded) else FULL)
    for s in STRATEGIES])
def test_every_strategy_resumes_sharded_state_exactly_or_refuses_it(strategy, fsdp_run, tmp_path):
    """A strategy that supports sharded state: rank 1 killed mid-run resumes at 2 ranks bit-exact,
    and restore of the last step is the unsharded run's; one that does not refuses at start."""
    if not REGISTRY[strategy].sharded:
        line = error_line(ckptrun(tmp_path, "--nproc-per-node", "2", "--strategy", strategy, "--dir", "ckpts",
                                  SCRIPT, "--steps", STEPS))
        assert f"--strategy {strategy} cannot checkpoint sharded parameters" in line, line
        return
    run = fsdp_run if strategy == FSDP_RUN else tmp_path
    if strategy != FSDP_RUN:
        killed_run(run, strategy)
    assert [e["restart_count"] for e in run_events(run / "metrics", 1)] == [0, 1], "the fault did not fire"
    assert_training_state(load(run / f"full-{STEPS}.pt"), truth(fsdp_run, STEPS))
    state, _ = restore(tmp_path, run / "ckpts", STEPS)
    assert_training_state(state, truth(fsdp_run, STEPS))


def test_shards_that_do_not_make_a_tensor_fail_verify_and_restore(fsdp_run, tmp_path):
    """Rank 1's index, consistent on its own (a replicated [3, 6] tensor), disagrees with rank 0's
    shard of [7, 6]: verify reports it, restore and resume fall back to the step before."""
    ckpt = copy_dir(fsdp_run / "ckpts", tmp_path / "ckpts", up_to=EARLY)
    record = full_name(EARLY)
    path = ckpt / record / rank_files(1)[1]
    index = json.loads(path.read_text())
    node = index["skeleton"]["models"]["model"]["0.weight"]["__dtensor__"]
    node.update(shape=[3, 6], placements=["R"])
    path.write_text(json.dumps(index))
    reseal(ckpt, record)
    proc = verify(tmp_path, ckpt)
    assert proc.returncode == 1 and "ranks disagree on its global shape" in proc.stdout, proc.stdout
    state, stderr = restore(tmp_path, ckpt, "latest")
    assert state["step"] == EARLY - 1 and f"step {EARLY} is damaged" in stderr
