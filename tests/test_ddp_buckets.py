"""DDP on 3 ranks, each with its own batches: the all-reduce's summation order depends on DDP's
bucket layout, which DDP rebuilds after its first iteration; a resumed process gets the rebuilt
layout back (worker/ddp_buckets.py), so a rank killed mid-run resumes bit-exact against plain
torchrun. (With 2 ranks any layout sums the same: tests/test_writeonce.py covers those.)"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import (
    EXAMPLE,
    TINY,
    assert_same,
    ckptrun,
    load,
    ok,
    restore,
    run_cmd,
    run_events,
    strategy_params,
)

from ckptrun.worker.ddp_buckets import DDP_BUCKETS

RANKS, STEPS = 3, 10
ARGS = [a if a != "12" else str(STEPS) for a in TINY]


@pytest.fixture(scope="module")
def truth(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("ddp3")
    ok(run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", RANKS, EXAMPLE, *ARGS,
                "--save-at", STEPS, "--save-path", "truth-{rank}.pt"], cwd))
    return cwd


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> Callable[[str], Path]:
    """The folder of a ckptrun run on RANKS ranks whose rank 1 is killed mid-step 5 and restarted,
    each rank saving its final state as out-{rank}.pt, by strategy (cached for the module)."""
    runs: dict[str, Path] = {}

    def get(strategy: str) -> Path:
        if strategy not in runs:
            cwd = tmp_path_factory.mktemp(f"killed-{strategy}")
            ok(ckptrun(cwd, "--nproc-per-node", RANKS, "--max-restarts", "1", "--strategy", strategy, "--every", "1",
                       "--dir", "ckpts", "--metrics-dir", "metrics", EXAMPLE, *ARGS, "--save-at", STEPS,
                       "--save-path", "out-{rank}.pt", fault="kill:step=5:rank=1"))
            runs[strategy] = cwd
        return runs[strategy]

    return get


# The layout is saved and given back the same way under every strategy (tracked state, like the
# scripts' own objects): the default by default, every strategy under --full.
@pytest.mark.parametrize("strategy", strategy_params(["checkfreq"]))
def test_rank_killed_on_three_ranks_resumes_bit_exact(strategy, truth, killed_run):
    run = killed_run(strategy)
    assert [e["restart_count"] for e in run_events(run / "metrics", 1)] == [0, 1], "the fault did not fire"
    for rank in range(RANKS):
        assert_same(load(run / f"out-{rank}.pt"), load(truth / f"truth-{rank}.pt"))


def test_the_rebuilt_layout_is_in_the_state(killed_run, tmp_path):
    """Each DDP wrapper's layout (every parameter index once) is tracked under DDP_BUCKETS (in
    the checkfreq run above: saved again after the restart)."""
    layout = restore(tmp_path, killed_run("checkfreq") / "ckpts", STEPS)[0]["extra"][f"{DDP_BUCKETS}0"]
    params = sorted(i for bucket in layout["buckets"] for i in bucket)
    assert params == list(range(len(params))) and len(params) > 1, layout


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_given_layout_is_the_reducers_and_a_foreign_one_is_ignored(one_rank_group):
    """Loading a layout builds the reducer with exactly those buckets; gradients are unchanged.
    A layout that does not name each of this model's parameters once leaves DDP as it was."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ckptrun.worker.ddp_buckets import BucketLayout

    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))
    layout = BucketLayout(ddp)
    before = layout._read()
    assert before is not None and sorted(sum(before, [])) == list(range(6))
    layout.load_state_dict({"buckets": [[0, 5], [3], [1, 2]]})  # index 4 missing: another model
    assert layout._read() == before and layout.state_dict() == {"buckets": []}
    given = [[5, 4], [3, 2, 1], [0]]
    layout.load_state_dict({"buckets": given})
    assert layout._read() == given and layout.state_dict() == {"buckets": given}
    x = torch.randn(3, 4)
    ddp(x).sum().backward()
    plain = [p.detach().clone().requires_grad_() for p in ddp.module.parameters()]
    out = x
    for i in range(3):
        out = torch.nn.functional.linear(out, plain[2 * i], plain[2 * i + 1])
    out.sum().backward()
    for p, q in zip(ddp.module.parameters(), plain, strict=True):
        assert torch.equal(p.grad, q.grad)
