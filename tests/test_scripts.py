"""Third-party style scripts (tests/scripts/) run unmodified under ckptrun and, killed at step 7
and restarted, end bit-identical to an uninterrupted plain-python run."""

from __future__ import annotations

import psutil
import pytest
from conftest import (
    FULL,
    SCRIPTS,
    STEPS,
    assert_training_state,
    ckptrun,
    error_line,
    load,
    ok,
    python,
    restore,
    resumed_beside_plain,
    run_events,
    strategy_params,
)

from ckptrun.storage.store import Store
from ckptrun.worker.patches import BACKWARDS_WITHOUT_OPTIMIZER


@pytest.mark.parametrize("script, strategy, fault", [
    ("while_loop.py", "sync", "kill:step=7"),
    ("batchnorm_sgd.py", "checkfreq", "kill:step=7:phase=write"),
    ("tracked_ema.py", "checkfreq", "kill:step=7"),
    ("orphan_param.py", "checkfreq", "kill:step=7"),
])
def test_script_resumes_exactly_after_a_kill(script, strategy, fault, tmp_path):
    args = ["--steps", STEPS, "--save-at", STEPS, "--save-path"]
    plain, managed = resumed_beside_plain(tmp_path, SCRIPTS / script, args, ["--strategy", strategy, "--dir", "ckpts"],
                                          fault)
    assert_training_state(load(managed / "resumed.pt"), load(plain / "truth.pt"))


@pytest.mark.parametrize("iterations, ran, when", [
    (100000, BACKWARDS_WITHOUT_OPTIMIZER, f"ran {BACKWARDS_WITHOUT_OPTIMIZER} backward passes without"),
    (3, 3, "never created"),
])
def test_script_without_optimizer_fails_clearly_once(iterations, ran, when, tmp_path):
    """Stopped within its first steps of a long loop (at exit if it ends before), and told once:
    by the launcher, not the worker too."""
    proc = ckptrun(tmp_path, "--dir", "ckpts", SCRIPTS / "no_optimizer.py", "--iterations", iterations)
    line = error_line(proc)
    assert proc.returncode == 1 and when in line and "torch.optim optimizer" in line, line
    assert proc.stderr.count("torch.optim optimizer") == 1, proc.stderr
    assert "summary" not in proc.stdout + proc.stderr  # nothing to summarize: the error ends the output
    iterations_run = [line for line in proc.stdout.splitlines() if line.startswith("iteration ")]
    assert iterations_run == [f"iteration {i}" for i in range(ran)], proc.stdout[-500:]
    store = Store(tmp_path / "ckpts")
    assert store.manifests() == [] and store.incomplete() == []


def test_module_less_parameter_resumes_and_is_restored_by_offline_replay(tmp_path):
    """lowdiff, killed at step 7: the free-standing tensor (no model key) resumes exactly, and
    `restore` of a step that is a diff replays it too."""
    args = ["--steps", STEPS, "--save-at", STEPS, "--save-path"]
    flags = ["--strategy", "lowdiff", "--full-every", "5", "--batch", "3", "--keep", "0", "--dir", "ckpts"]
    plain, managed = resumed_beside_plain(tmp_path, SCRIPTS / "orphan_param.py", args, flags, "kill:step=7")
    truth = load(plain / "truth.pt")
    assert_training_state(load(managed / "resumed.pt"), truth)
    assert Store(managed / "ckpts").manifests()[-1].kind == "diff"
    restored, _ = restore(tmp_path, managed / "ckpts", STEPS)
    (scale,) = restored["extra"]["ckptrun.orphan_params.optimizer"].values()
    assert_training_state({**restored, "model": {**restored["model"], "scale": scale}}, truth)


def _unwrapped(state: dict) -> dict:
    """A compiled model's state_dict under the plain model's keys (as nanoGPT strips them to load)."""
    return {**state, "model": {k.removeprefix("_orig_mod."): v for k, v in state["model"].items()}}


@pytest.mark.parametrize("strategy", strategy_params(["lowdiff"]))
def test_compiled_model_resumes_exactly_and_restores_under_the_plain_keys(strategy, tmp_path):
    """nanoGPT compiles its model by default: with torch.compile (inductor) the hooks still see
    every step's gradients and state, the worker killed at step 7 ends bit-identical, and
    `restore` gives the model's own keys (no `_orig_mod.` of the wrapper)."""
    args = ["--steps", STEPS, "--save-at", STEPS, "--compile", "inductor", "--save-path"]
    flags = ["--no-dist-env", "--strategy", strategy, "--keep", "0", "--dir", "ckpts",
             *(["--full-every", "5", "--batch", "3"] if strategy == "lowdiff" else [])]
    plain, managed = resumed_beside_plain(tmp_path, SCRIPTS / "nanogpt_style.py", args, flags, "kill:step=7")
    truth = _unwrapped(load(plain / "truth.pt"))
    assert list(load(plain / "truth.pt")["model"])[0].startswith("_orig_mod."), "the model was not compiled"
    assert_training_state(_unwrapped(load(managed / "resumed.pt")), truth)
    restored, _ = restore(tmp_path, managed / "ckpts", STEPS)
    assert_training_state(restored, truth)


@pytest.mark.parametrize("start_method", [pytest.param("fork", marks=FULL), pytest.param("spawn", marks=FULL),
                                          "forkserver"])
def test_dataloader_workers_resume_exactly_and_none_outlives_the_killed_worker(start_method, tmp_path):
    """Batches from a DataLoader with two worker processes, the worker killed at step 7: the run
    resumes bit-exact, and no loader worker of the killed one is left. With forkserver the loader
    workers' parent is the forkserver, which outlived the killed worker (torch elastic signals
    only a live worker's process group): they ran on, holding the launcher's output open, and
    this run never ended."""
    args = ["--steps", STEPS, "--start-method", start_method, "--save-at", STEPS, "--save-path"]
    plain, managed = tmp_path / "plain", tmp_path / "ckptrun"
    plain.mkdir()
    managed.mkdir()
    script = SCRIPTS / "dataloader_workers.py"
    python(plain, script, *args, "truth.pt")
    ok(ckptrun(managed, "--strategy", "checkfreq", "--dir", "ckpts", "--max-restarts", "1", "--metrics-dir",
               "metrics", script, *args, "resumed.pt", fault="kill:step=7"))
    assert [e["restart_count"] for e in run_events(managed / "metrics")] == [0, 1], "the fault did not fire"
    assert_training_state(load(managed / "resumed.pt"), load(plain / "truth.pt"))
    pids = [int(line) for line in (managed / "loader-pids.txt").read_text().split()]
    assert len(pids) >= 4, pids  # two per epoch's loader, before and after the restart
    left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not left, f"loader workers still running after the run: {left}"


@pytest.mark.parametrize("strategy", strategy_params(["checkfreq", "lowdiff"]))
@pytest.mark.parametrize("inf_at, fault", [("4", "kill:step=7"), ("3,4", "kill:step=7"), ("6", "kill:step=7")])
def test_steps_a_grad_scaler_skips_count_as_iterations(strategy, inf_at, fault, tmp_path):
    """A GradScaler skips the optimizer's step at the iterations whose loss is inf, and the
    loop counts its iterations from resume_step(): killed after (or right after) a skip, the
    run resumes at the iteration after the restored step, with the scaler and scheduler as
    that iteration found them (the skip's own update and scheduler step not yet in), and ends
    bit-identical. Before, resume_step() counted optimizer steps: the loop repeated each skipped
    iteration and the state of the step held the skip's scaler update."""
    args = ["--steps", STEPS, "--inf-at", inf_at, "--save-path"]
    flags = ["--strategy", strategy, "--keep", "0", "--dir", "ckpts",
             *(["--full-every", "5", "--batch", "3"] if strategy == "lowdiff" else [])]
    plain, managed = resumed_beside_plain(tmp_path, SCRIPTS / "scaler_skip.py", args, flags, fault)
    truth, resumed = load(plain / "truth.pt"), load(managed / "resumed.pt")
    assert_training_state(resumed, truth)
    skips = len(inf_at.split(","))
    assert Store(managed / "ckpts").manifests()[-1].step == int(STEPS) - skips


@pytest.mark.parametrize("strategy", strategy_params(["lowdiff+", "lowdiff"]))
def test_frozen_layer_in_the_optimizer_unfrozen_later_resumes_exactly(strategy, tmp_path):
    """The optimizer holds a layer that does not require grad (lowdiff+ used to fail at the
    optimizer's construction: a tensor that does not require grad takes no gradient hook) until
    iteration 6, and a head without gradients every other step: killed at step 7 and restarted,
    the run ends bit-identical, and `restore` of its last step equals it."""
    args = ["--steps", STEPS, "--save-path"]
    plain, managed = resumed_beside_plain(tmp_path, SCRIPTS / "frozen_layer.py", args,
                                          ["--strategy", strategy, "--keep", "0", "--dir", "ckpts"], "kill:step=7")
    truth = load(plain / "truth.pt")
    assert_training_state(load(managed / "resumed.pt"), truth)
    assert_training_state(restore(managed, managed / "ckpts", STEPS)[0], truth)


def test_a_param_group_added_mid_run_is_named_and_a_resume_past_it_refused_in_one_line(tmp_path):
    """ckptrun does not resume a param group added after the optimizer was made (README): the
    run says so once when the script adds it, and the restart after the kill at step 9 stops
    with one line naming the checkpoint and the fix (before: torch's ValueError, a traceback)."""
    proc = ckptrun(tmp_path, "--strategy", "checkfreq", "--dir", "ckpts", "--max-restarts", "1",
                   SCRIPTS / "added_group.py", "--steps", STEPS, fault="kill:step=9")
    line = error_line(proc)
    assert proc.returncode == 2 and "different number of parameter groups" in line and "--no-resume" in line, line
    assert proc.stderr.count("added a param group to its AdamW") == 1, proc.stderr[-2000:]
