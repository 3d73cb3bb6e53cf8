"""accelerate (issue 11): the loop is the user's own, so ckptrun's contract is that the script starts
it at `ckptrun.resume_step()` (data position by `skip_first_batches`). For each strategy (by default
a representative few, every registered one under `--full`), one run of scripts/accelerate_loop.py
killed mid-epoch and restarted must log the plain run's loss at every step exactly once, end
bit-identical to it (as accelerate's own `load_state` resume does), store the optimizer once, and
`restore --step N` must equal accelerate's own `save_state` at N. Where accelerate's own resume is
not exact (a DataLoader on the global RNG), ckptrun's equals it. Under torchrun's environment
accelerate turns distributed with one process; `--no-dist-env` gives the script plain python's
setup.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import (
    TIMEOUT_S,
    assert_same,
    clean_env,
    kill_tree,
    load,
    restore,
    run_events,
    selected_strategies,
    strategy_params,
)
from safetensors.torch import load_file

from ckptrun.storage.store import Store
from ckptrun.strategies import REGISTRY
from ckptrun.worker.ddp_buckets import DDP_BUCKETS

SCRIPT = Path(__file__).resolve().parent / "scripts" / "accelerate_loop.py"
STEPS, SAVE_EVERY, KILL = 24, 5, 11  # 8 batches an epoch: the restart resumes mid-epoch, at step 10
RESUMED = KILL - 1
COMPARED = (RESUMED, 20)  # accelerate's saves: the step both resumes start from, one after the restart
DIST_STEPS = 10  # the run under torchrun's environment (no kill)
RESTART_WARNING = "does not call ckptrun.resume_step()"
# By default one strategy per framework module, the three taking different ones so that every
# family (full snapshot: the default under accelerate; differential: lowdiff under HF Trainer;
# region: lightcheck under Lightning) runs under some framework (the framework's part is the same
# for every strategy); every registered strategy under --full.
STRATEGIES = ("checkfreq",)


@dataclass
class Run:
    """One run of the script in its own folder: `proc` until it is waited for."""

    cwd: Path
    proc: subprocess.Popen

    def wait(self) -> Run:
        self.proc.wait(timeout=TIMEOUT_S)
        assert self.proc.returncode == 0, f"{self.cwd.name}: exit {self.proc.returncode}\n{self.log()[-4000:]}"
        return self

    def log(self) -> str:
        return (self.cwd / "log.txt").read_text()

    def losses(self) -> list[tuple[int, float]]:
        """(step, loss) in the order the script logged them, over all attempts."""
        lines = (self.cwd / "run" / "losses.jsonl").read_text().splitlines()
        return [(e["step"], e["loss"]) for e in map(json.loads, lines)]

    def final(self) -> dict:
        return load(self.cwd / "run" / "final.pt")

    def setup(self) -> dict:
        """What accelerate set up (scripts/accelerate_loop.py writes it)."""
        return json.loads((self.cwd / "run" / "accelerate.json").read_text())

    def saved(self, step: int) -> dict:
        """accelerate's own `save_state` at `step`: model, optimizer, scheduler."""
        d = self.cwd / "accel" / f"step_{step}"
        return {"model": load_file(d / "model.safetensors"), "optimizer": load(d / "optimizer.bin"),
                "scheduler": load(d / "scheduler.bin")}


def start(cwd: Path, argv: list[Any], *, fault: str | None = None, drop_env: tuple[str, ...] = ()) -> Run:
    """`python ARGV` in a new folder `cwd`, in the background, in a session of its own (kill_tree)."""
    cwd.mkdir()
    env = {k: v for k, v in clean_env(fault).items() if k not in drop_env}
    with open(cwd / "log.txt", "wb") as log:
        proc = subprocess.Popen([sys.executable, *map(str, argv)], cwd=cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return Run(cwd, proc)


def script_args(*extra: Any) -> list[Any]:
    return [SCRIPT, "--steps", STEPS, "--save-every", SAVE_EVERY, "--save-dir", "accel", "--out", "run", *extra]


@dataclass
class Runs:
    plain: Run  # plain python, uninterrupted: the truth, and accelerate's own checkpoints
    resumed: Run  # plain python resumed by accelerate's load_state from the plain run's step RESUMED
    killed: dict[str, Run]  # per strategy: ckptrun --no-dist-env, killed mid-step KILL, restarted once
    dist_env: Run  # ckptrun with torchrun's environment, OMP_NUM_THREADS unset
    global_rng: tuple[Run, Run, Run]  # plain, resumed, killed (default strategy) with --global-rng-loader


def ckptrun_args(*flags: Any) -> list[Any]:
    return ["-m", "ckptrun", *flags, "--no-dist-env", "--dir", "ckpts", "--keep", "0", "--max-restarts", "1",
            "--metrics-dir", "metrics"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[Runs]:
    """Every run the tests compare, started together (2 cores), each once; whatever still runs
    when one fails is killed."""
    root = tmp_path_factory.mktemp("accelerate")
    started: list[Run] = []

    def go(name: str, argv: list[Any], **kwargs: Any) -> Run:
        started.append(start(root / name, argv, **kwargs))
        return started[-1]

    def resumed_from(plain: Run, *flags: str) -> Run:
        return go(f"{plain.cwd.name}-resumed", script_args(
            *flags, "--resume-from", plain.wait().cwd / "accel" / f"step_{RESUMED}"))

    kill = f"kill:step={KILL}"
    try:
        plain = go("plain", script_args())
        global_plain = go("global-rng", script_args("--global-rng-loader"))
        killed = {s: go(s, [*ckptrun_args("--strategy", s, *REGISTRY[s].short_run_flags), *script_args()], fault=kill)
                  for s in selected_strategies(pytestconfig, STRATEGIES)}
        global_killed = go("global-rng-killed", [*ckptrun_args(), *script_args("--global-rng-loader")], fault=kill)
        dist_env = go("dist-env", ["-m", "ckptrun", "--dir", "ckpts", SCRIPT, "--steps", DIST_STEPS, "--save-every",
                                   DIST_STEPS, "--save-dir", "accel", "--out", "run"], drop_env=("OMP_NUM_THREADS",))
        resumed, global_resumed = resumed_from(plain), resumed_from(global_plain, "--global-rng-loader")
        yield Runs(plain, resumed.wait(), {s: r.wait() for s, r in killed.items()}, dist_env.wait(),
                   (global_plain, global_resumed.wait(), global_killed.wait()))
    finally:
        for run in started:
            if run.proc.poll() is None:
                kill_tree(run.proc.pid)


def restored_beside_saved(run: Run, saved: Run, step: int) -> tuple[dict, dict]:
    """(`ckptrun restore --step` of `run`, accelerate's own save of `saved`) as comparable dicts;
    the model's keys sorted (safetensors sorts them)."""
    state, _ = restore(run.cwd, run.cwd / "ckpts", step)
    extra = [k for k in state["extra"] if not k.startswith(DDP_BUCKETS)]  # (ckptrun's own: DDP's bucket layout)
    assert not extra, f"more state than one model and one optimizer: {extra}"
    assert len(state["schedulers"]) == 1, "the scheduler is stored once (not its accelerate wrapper too)"
    mine = {"model": dict(sorted(state["model"].items())), "optimizer": state["optimizer"],
            "scheduler": state["schedulers"][0]}
    theirs = saved.saved(step)
    return mine, {**theirs, "model": dict(sorted(theirs["model"].items()))}


def test_accelerates_own_resume_mid_epoch_is_bit_exact(runs):
    """The reference: accelerate's `load_state` at step RESUMED, `skip_first_batches` for the rest
    of the epoch, equals the uninterrupted run (its DataLoader draws nothing from the global RNG)."""
    truth = dict(runs.plain.losses())
    assert runs.resumed.losses() == [(s, truth[s]) for s in range(RESUMED + 1, STEPS + 1)]
    assert_same(runs.resumed.final(), runs.plain.final())


@pytest.mark.parametrize("strategy", strategy_params(STRATEGIES))
def test_killed_run_logs_the_plain_loss_from_where_it_resumed(runs, strategy):
    """The restarted loop starts where the last committed step left it: no step skipped, none
    repeated beyond the lost work, and every loss (before and after the kill) is the
    uninterrupted run's, bit for bit."""
    run = runs.killed[strategy]
    starts = [(e["restart_count"], e["resume_step"]) for e in run_events(run.cwd / "metrics")]
    assert starts[0] == (0, 0) and [n for n, _ in starts] == [0, 1], starts
    # The kill fires as step KILL's update begins. A lazy strategy (datastates) hands step
    # KILL - 1 over at that moment, its late copies still running behind: the worker dying
    # under them leaves KILL - 2 the newest committed step (README, datastates), never older,
    # and the second attempt logs step KILL - 1 again, with the same loss.
    resume = starts[1][1]
    assert RESUMED - 1 <= resume <= RESUMED, starts
    plain = runs.plain.losses()
    assert [s for s, _ in plain] == list(range(1, STEPS + 1))
    assert run.losses() == plain[:KILL - 1] + plain[resume:]
    assert RESTART_WARNING not in run.log()


@pytest.mark.parametrize("strategy", strategy_params(STRATEGIES))
def test_killed_run_ends_bit_identical_with_as_many_steps(runs, strategy):
    """Model, optimizer, scheduler and RNG equal the uninterrupted run's (hence accelerate's own
    resume's); the optimizer took STEPS steps and so did ckptrun's count."""
    run, final = runs.killed[strategy], runs.killed[strategy].final()
    assert {int(s["step"]) for s in final["optimizer"]["state"].values()} == {STEPS}
    assert final["scheduler"]["last_epoch"] == STEPS
    assert Store(run.cwd / "ckpts").manifests()[-1].step == STEPS
    assert_same(final, runs.plain.final())


@pytest.mark.parametrize("strategy", strategy_params(STRATEGIES))
def test_restore_equals_accelerates_own_save_state(runs, strategy):
    """`restore --step N` of the killed run is accelerate's `save_state` at N of the uninterrupted
    run (model, the one optimizer its AcceleratedOptimizer wraps, scheduler), before and after
    the restart."""
    for step in COMPARED:
        mine, theirs = restored_beside_saved(runs.killed[strategy], runs.plain, step)
        assert_same(mine, theirs, f"step {step}")


def test_with_a_loader_on_the_global_rng_ckptrun_resumes_as_accelerate_does(runs):
    """A DataLoader without a generator of its own draws each iterator's base seed from the global
    RNG: the iterator a resume starts mid-epoch shifts every later dropout mask, in accelerate's own
    resume as in ckptrun's. Neither is exact any more; ckptrun's equals accelerate's bit for bit."""
    plain, resumed, killed = runs.global_rng
    truth, logged = plain.losses(), killed.losses()
    assert logged[:RESUMED] == truth[:RESUMED]
    assert logged[RESUMED:] == resumed.losses()
    assert [s for s, _ in logged] == [s for s, _ in truth] and logged[RESUMED][1] != truth[RESUMED][1]
    assert_same(killed.final(), resumed.final())


def test_torchrun_environment_makes_accelerate_distributed_with_one_process(runs):
    """With torchrun's variables (ckptrun's default) accelerate takes LOCAL_RANK/WORLD_SIZE for a
    multi-process CPU launch: a gloo process group of one, the model wrapped in DDP (a gradient
    all-reduce every step for nothing) and, with OMP_NUM_THREADS unset, torch's thread count reset
    to the physical cores over the script's own set_num_threads(1), so its numbers are no longer
    plain python's. Its checkpoints are still right: the inner model and the one optimizer. With
    --no-dist-env accelerate sets up exactly what it does under plain python."""
    plain = runs.plain.setup()
    assert plain == {"distributed_type": "DistributedType.NO", "num_processes": 1, "model_wrapper": "TinyLM",
                     "threads": 1, "process_group": False, "rank_env": False}
    for run in runs.killed.values():
        assert run.setup() == plain
    assert runs.dist_env.setup() == {
        "distributed_type": "DistributedType.MULTI_CPU", "num_processes": 1,
        "model_wrapper": "DistributedDataParallel", "threads": max(1, psutil.cpu_count(logical=False)),
        "process_group": True, "rank_env": True}
    mine, theirs = restored_beside_saved(runs.dist_env, runs.dist_env, DIST_STEPS)
    assert_same(mine, theirs)
