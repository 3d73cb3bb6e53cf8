"""Lightning's `Trainer` under ckptrun (issue 11): the built-in integration brings an unchanged
Lightning script, killed mid-step and restarted, to the resumed step. For each strategy (by default
a representative few, every one in REGISTRY under `--full`), one run killed in step 14 (mid-epoch:
10 batches an epoch) and restarted must take the uninterrupted run's per-step losses, restore any
step as Lightning's own checkpoint of it, end after the same number of optimizer steps bit-identical
to the uninterrupted run, and make Lightning write the checkpoints it wrote uninterrupted (loops and
callbacks included). Lightning's own resume from its last checkpoint before the kill (step 12) is
measured beside it: it reshuffles the resumed epoch's data from the start and has no RNG state, so
it is not exact."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import (
    assert_same,
    ckptrun,
    load,
    logged,
    ok,
    python,
    restore,
    run_events,
    selected_strategies,
    strategy_params,
)

from ckptrun.storage.store import Store
from ckptrun.strategies import REGISTRY
from ckptrun.worker.integrations.lightning import _Tracker

SCRIPT = Path(__file__).resolve().parent / "scripts" / "lightning_fit.py"
STEPS, EVERY, KILL = 24, 4, 14  # Lightning saves every 4 steps; step 14 is batch 4 of epoch 2
BATCHES_PER_EPOCH = 10  # the script's 40 samples in batches of 4
LAST_SAVED = (KILL - 1) // EVERY * EVERY  # Lightning's last checkpoint before the kill
SAVED = range(EVERY, STEPS + 1, EVERY)
RESTORED = (8, 20)  # `restore` checks: a step before the kill, and one the restarted worker took
ON_RESTART_WARNING = "does not call ckptrun.resume_step()"
NOT_RESUMABLE_WARNING = "your dataloader is not resumable"  # Lightning's, on a mid-epoch resume
# By default one strategy per framework module, the three taking different ones so that every
# family (full snapshot: the default under accelerate; differential: lowdiff under HF Trainer;
# region: lightcheck under Lightning) runs under some framework (the framework's part is the same
# for every strategy); every registered strategy under --full.
STRATEGIES = ("lightcheck",)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> dict[str, Any]:
    """Every run the tests compare, two at a time (two cores): plain python uninterrupted (it also
    writes Lightning's checkpoints); Lightning's own resume, in a folder that ran to LAST_SAVED
    first (so that ModelCheckpoint reloads its state: same dirpath); per strategy one ckptrun run
    with every step committed, killed in step KILL and restarted once."""
    root = tmp_path_factory.mktemp("lightning")
    args = ["--max-steps", STEPS, "--every", EVERY]

    def plain_and_own() -> None:
        for name in ("plain", "own"):
            (root / name).mkdir()
        python(root / "plain", SCRIPT, *args)
        python(root / "own", SCRIPT, "--max-steps", LAST_SAVED, "--every", EVERY)
        python(root / "own", SCRIPT, *args, "--ckpt-path", ckpt_file(root / "own", LAST_SAVED))

    def managed(name: str, *flags: Any) -> str:
        (root / name).mkdir()
        proc = ckptrun(root / name, *flags, "--dir", "ckpts", "--keep", 0, "--max-restarts", 1,
                       "--metrics-dir", "metrics", SCRIPT, *args, fault=f"kill:step={KILL}")
        return ok(proc).stderr

    with ThreadPoolExecutor(2) as pool:
        own = pool.submit(plain_and_own)
        stderr = {s: pool.submit(managed, s, "--strategy", s, *REGISTRY[s].short_run_flags, "--every", 1)
                  for s in selected_strategies(pytestconfig, STRATEGIES)}
        stderr["memory-first"] = pool.submit(managed, "memory-first", "--persist-every", 1000)
        own.result()
        return {"root": root, "stderr": {s: f.result() for s, f in stderr.items()}}


def ckpt_file(folder: Path, step: int) -> Path:
    (path,) = folder.glob(f"lightning_ckpts/*-step={step}.ckpt")
    return path


def lightning_ckpt(folder: Path, step: int) -> dict:
    """Lightning's own checkpoint of `step`, with the run's folder taken out of its paths."""
    def portable(obj: Any) -> Any:
        if isinstance(obj, str):
            return obj.replace(str(folder), "RUN")
        if isinstance(obj, dict):
            return {portable(k): portable(v) for k, v in obj.items()}
        return obj

    return portable(load(ckpt_file(folder, step)))


def losses(folder: Path) -> list[tuple[int, float]]:
    """(global step, loss) of every finished step, both attempts of a restarted run included."""
    lines = (folder / "losses.txt").read_text().split("\n")
    return [(int(step), float.fromhex(loss)) for step, loss in (line.split() for line in lines if line)]


def steps_by_attempt(metrics: Path) -> list[list[int]]:
    """The optimizer steps each worker attempt took, from ckptrun's per-step metrics."""
    attempts: list[list[int]] = []
    for event in map(json.loads, (metrics / "worker-0.jsonl").read_text().splitlines()):
        if event["type"] == "run":
            attempts.append([])
        elif event["type"] == "step":
            attempts[-1].append(event["step"])
    return attempts


def max_abs_diffs(a: dict, b: dict) -> dict[str, float]:
    """Largest absolute difference per group of a final state (weights, Adam's moments and step
    counts, learning rate)."""
    pairs = {"weights": [(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"]]}
    adam_a, adam_b = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    for field in ("exp_avg", "exp_avg_sq", "step"):
        pairs[f"adam {field}"] = [(adam_a[i][field], adam_b[i][field]) for i in adam_a]
    pairs["lr"] = [(torch.tensor(x), torch.tensor(y)) for x, y in
                   zip(a["lr_schedulers"][0]["_last_lr"], b["lr_schedulers"][0]["_last_lr"], strict=True)]
    return {group: max((x.double() - y.double()).abs().max().item() for x, y in ps) for group, ps in pairs.items()}


@pytest.mark.parametrize("strategy", strategy_params(STRATEGIES))
def test_losses_equal_the_uninterrupted_run(runs, strategy):
    truth = dict(losses(runs["root"] / "plain"))
    assert sorted(truth) == list(range(1, STEPS + 1))
    managed = losses(runs["root"] / strategy)
    assert sorted({step for step, _ in managed}) == list(range(1, STEPS + 1))
    assert [(step, loss) for step, loss in managed if loss != truth[step]] == []  # redone steps included


@pytest.mark.parametrize("strategy", strategy_params(STRATEGIES))
def test_restore_equals_lightnings_own_checkpoint(runs, strategy):
    folder = runs["root"] / strategy
    for step in RESTORED:
        state, _ = restore(folder, folder / "ckpts", step)
        own = load(ckpt_file(runs["root"] / "plain", step))
        assert_same(state["model"], own["state_dict"], f"step {step} model")
        assert_same(state["optimizer"], own["optimizer_states"][0], f"step {step} optimizer")
        assert_same(state["schedulers"], own["lr_schedulers"], f"step {step} lr_schedulers")


@pytest.mark.parametrize("strategy", strategy_params(STRATEGIES))
def test_killed_run_ends_as_the_uninterrupted_one(runs, strategy):
    root, folder = runs["root"], runs["root"] / strategy
    first, second = run_events(folder / "metrics")
    assert (first["restart_count"], second["restart_count"]) == (0, 1), "the fault did not fire"
    resumed = second["resume_step"]
    assert 0 < resumed < KILL and resumed % BATCHES_PER_EPOCH, "not resumed mid-epoch: no data fast-forward"
    assert steps_by_attempt(folder / "metrics") == [list(range(1, KILL)), list(range(resumed + 1, STEPS + 1))]
    assert ON_RESTART_WARNING not in runs["stderr"][strategy]
    assert NOT_RESUMABLE_WARNING not in runs["stderr"][strategy]  # the data were positioned
    assert Store(folder / "ckpts").manifests()[-1].step == STEPS
    final, truth = load(folder / "final.pt"), load(root / "plain" / "final.pt")
    assert final["global_step"] == truth["global_step"] == STEPS
    assert_same(final, truth)  # model, optimizer (its step counts too), scheduler, epoch: bit for bit
    for step in (s for s in SAVED if s > resumed):  # loops and callbacks (best-k scores) as if never killed
        assert_same(lightning_ckpt(folder, step), lightning_ckpt(root / "plain", step), f"step {step}")


def test_memory_first_resumes_from_the_engines_memory_as_the_uninterrupted_run(runs):
    """The default strategy with --persist-every 1000 (steps taken through Lightning's closure):
    the killed worker resumes step KILL-1 from its engine's memory, none of it on disk, takes
    exactly the steps after it and ends as the uninterrupted run, bit for bit."""
    root, folder = runs["root"], runs["root"] / "memory-first"
    assert [e["resume_step"] for e in run_events(folder / "metrics")] == [0, KILL - 1]
    assert f"resumed step {KILL - 1} from the checkpoint engine's memory" in runs["stderr"]["memory-first"]
    assert steps_by_attempt(folder / "metrics") == [list(range(1, KILL)), list(range(KILL, STEPS + 1))]
    assert [m.step for m in Store(folder / "ckpts").manifests()] == [STEPS]
    assert_same(load(folder / "final.pt"), load(root / "plain" / "final.pt"))


def test_lightnings_own_resume_takes_the_same_steps_but_is_not_exact(runs):
    """The measured baseline (README): Lightning's resume from its own checkpoint before the kill
    ends after as many steps, but its first resumed step already differs: the resumed epoch's
    data start over with a new shuffle, and dropout draws from an RNG the checkpoint lacks."""
    root = runs["root"]
    assert_same(lightning_ckpt(root / "own", LAST_SAVED), lightning_ckpt(root / "plain", LAST_SAVED))
    own, truth = load(root / "own" / "final.pt"), load(root / "plain" / "final.pt")
    assert own["global_step"] == truth["global_step"] == STEPS
    assert dict(losses(root / "own"))[LAST_SAVED + 1] != dict(losses(root / "plain"))[LAST_SAVED + 1]
    diffs = max_abs_diffs(own, truth)
    print(f"Lightning's own resume from step {LAST_SAVED} vs uninterrupted, max abs difference: {diffs}")
    assert diffs["weights"] > 0


def test_a_callback_state_json_cannot_hold_is_left_out_loudly_once():
    module = SimpleNamespace(call=SimpleNamespace(_call_callbacks_state_dict=lambda trainer: {
        "Scores": {"best": torch.tensor(0.5)}, "Odd": {"handle": object()}}))
    tracker = _Tracker(rt=None, module=module)
    with logged() as caught:
        first, second = tracker._callbacks(None), tracker._callbacks(None)
    assert first == second == {"Scores": {"best": {"__tensor__": "AAAAPw==", "dtype": "float32", "shape": []}}}
    assert caught == [
        "ckptrun: the state of Lightning callback Odd holds a value of type object, which ckptrun does not checkpoint; "
        "a resumed run starts that callback afresh"]
