"""HF `transformers.Trainer` under ckptrun (issue 11): on a restart the built-in integration brings
HF's own loop to the resumed step, so a killed run ends as an uninterrupted one, bit for bit.

The runs are shared by every test (two at a time, 2 cores): the script under plain python (the
ground truth, which writes HF's own checkpoint-N folders), HF's own resume from the last of them
before the kill, per strategy (by default a representative few, every registered one under
`--full`) one ckptrun run whose worker is killed mid-step KILL and restarted (plus `ckptrun
restore` of two of HF's checkpoint steps), one such run bounded by `--max-steps`, and a ckptrun run
of the script passing `resume_from_checkpoint` itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same, ckptrun, load, ok, python, restore, run_events, selected_strategies, strategy_params
from safetensors.torch import load_file
from transformers.trainer_pt_utils import safe_globals

from ckptrun.storage.store import Store
from ckptrun.strategies import REGISTRY

SCRIPT = Path(__file__).resolve().parent / "scripts" / "hf_trainer.py"
STEPS, SAVE_STEPS, LOG_STEPS = 24, 5, 7  # as the script sets them
KILL = 13  # the worker kills itself mid-step KILL in its first attempt
HF_RESUME = (KILL - 1) // SAVE_STEPS * SAVE_STEPS  # HF's last checkpoint before the kill
RESTORED = (HF_RESUME, HF_RESUME + SAVE_STEPS)  # HF checkpoints compared with `restore`: before and after the kill
BOUND = 20  # --max-steps of one killed run (an HF checkpoint step)
TIMING = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_tokens_per_second"}
TIED = {"lm_head.weight": "transformer.wte.weight"}  # saved once by HF (safetensors drops shared tensors)
NO_RESUME_WARNING = "does not call ckptrun.resume_step()"
# By default one strategy per framework module, the three taking different ones so that every
# family (full snapshot: the default under accelerate; differential: lowdiff under HF Trainer;
# region: lightcheck under Lightning) runs under some framework (the framework's part is the same
# for every strategy); every registered strategy under --full.
STRATEGIES = ("lowdiff",)


@dataclass
class Run:
    cwd: Path
    output: str  # stdout and stderr
    restored: dict[int, dict] = field(default_factory=dict)  # `ckptrun restore` of HF's checkpoint steps

    def losses(self) -> list[dict]:
        """One line per optimizer step taken, in order, across worker attempts."""
        return [json.loads(line) for line in (self.cwd / "losses.jsonl").read_text().splitlines()]

    def final(self) -> dict:
        return load(self.cwd / "final.pt")

    def hf_checkpoints(self) -> list[str]:
        return sorted(p.name for p in (self.cwd / "out").glob("checkpoint-*"))

    def resume_step(self) -> int:
        return run_events(self.cwd / "metrics")[-1]["resume_step"]


def _script(*extra: Any) -> list[Any]:
    return [SCRIPT, "--out", "out", "--losses", "losses.jsonl", "--final", "final.pt", *extra]


def _plain(cwd: Path, *extra: Any) -> Run:
    cwd.mkdir()
    proc = python(cwd, *_script(*extra))
    return Run(cwd, proc.stdout + proc.stderr)


def _managed(cwd: Path, flags: list[Any], *extra: Any, fault: str | None = None) -> Run:
    cwd.mkdir()
    proc = ok(ckptrun(cwd, *flags, "--dir", "ckpts", "--keep", "0", "--metrics-dir", "metrics", *_script(*extra),
                      fault=fault))
    return Run(cwd, proc.stdout + proc.stderr)


def _killed(cwd: Path, flags: list[Any], restored: tuple[int, ...]) -> Run:
    run = _managed(cwd, [*flags, "--max-restarts", "1"], fault=f"kill:step={KILL}")
    run.restored = {n: restore(cwd, cwd / "ckpts", n)[0] for n in restored}
    return run


def _resuming_itself(cwd: Path, hf_checkpoint: Path) -> Run:
    run = _managed(cwd, [], "--resume-from", hf_checkpoint)
    last = Store(cwd / "ckpts").manifests()[-1].step
    run.restored = {last: restore(cwd, cwd / "ckpts", last)[0]}
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("hf-trainer")
    hf_checkpoint = root / "plain" / "out" / f"checkpoint-{HF_RESUME}"
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(_plain, root / "plain")

        def after_plain(job: Callable[..., Run], *args: Any) -> Run:
            plain.result()
            return job(*args)

        jobs = {s: pool.submit(_killed, root / s, ["--strategy", s, *REGISTRY[s].short_run_flags], RESTORED)
                for s in selected_strategies(pytestconfig, STRATEGIES)}
        jobs["bounded"] = pool.submit(_killed, root / "bounded", ["--max-steps", BOUND], (BOUND,))
        jobs["memory-first"] = pool.submit(_killed, root / "memory-first", ["--persist-every", "1000"], ())
        jobs["hf-resume"] = pool.submit(after_plain, _plain, root / "hf-resume", "--resume-from", hf_checkpoint)
        jobs["script-resumes"] = pool.submit(after_plain, _resuming_itself, root / "script-resumes", hf_checkpoint)
        return {"plain": plain.result(), **{name: job.result() for name, job in jobs.items()}}


def comparable(final: dict, *, summary: bool = True) -> dict:
    """A final state without wall-clock timings; `summary=False` also drops the end-of-train
    summary's train_loss (HF averages it over the steps of the last `train()` call: after a
    resume, HF's or ckptrun's, that is not the whole run)."""
    state = json.loads(final["trainer_state"])
    state["log_history"] = [{k: e[k] for k in sorted(e) if k not in TIMING and (summary or k != "train_loss")}
                            for e in state["log_history"]]  # key order: HF's checkpoint sorts them
    return {**final, "trainer_state": state}


def losses_by_step(run: Run) -> dict[int, list[float]]:
    return {line["step"]: line["losses"] for line in run.losses()}


def assert_summary_covers_the_last_call(final: dict, losses: dict[int, list[float]], start: int) -> None:
    """HF's end-of-train train_loss is the mean loss of the steps the last `train()` call took
    (after `start`); a step's loss is the sum of its micro-batches' (summed in float32 by HF)."""
    summary = json.loads(final["trainer_state"])["log_history"][-1]
    steps = [sum(losses[s]) for s in range(start + 1, STEPS + 1)]
    assert summary["train_loss"] == pytest.approx(sum(steps) / len(steps), rel=1e-6)


@pytest.mark.parametrize("strategy", strategy_params(STRATEGIES))
def test_every_forward_pass_has_the_plain_runs_loss(runs, strategy):
    plain, lines = losses_by_step(runs["plain"]), runs[strategy].losses()
    assert {line["step"] for line in lines} == set(plain) == set(range(1, STEPS + 1))
    for line in lines:  # before the kill and after the restart
        assert line["losses"] == plain[line["step"]], f"step {line['step']}"


@pytest.mark.parametrize("strategy", strategy_params(STRATEGIES))
def test_a_killed_worker_ends_as_the_uninterrupted_run(runs, strategy):
    run, plain = runs[strategy], runs["plain"]
    assert [e["restart_count"] for e in run_events(run.cwd / "metrics")] == [0, 1], "the fault did not fire"
    resumed = run.resume_step()
    assert 0 < resumed < KILL
    # the restarted worker took exactly the steps after the resumed one: HF's loop did not start over
    assert [line["step"] for line in run.losses()] == [*range(1, KILL), *range(resumed + 1, STEPS + 1)]
    assert NO_RESUME_WARNING not in run.output
    assert run.hf_checkpoints() == plain.hf_checkpoints()
    final = run.final()
    assert json.loads(final["trainer_state"])["global_step"] == STEPS
    assert_same(comparable(final, summary=False), comparable(plain.final(), summary=False))
    assert_summary_covers_the_last_call(final, losses_by_step(plain), resumed)


def assert_equals_hfs_checkpoint(restored: dict, folder: Path) -> None:
    """`ckptrun restore` of a step equals HF's checkpoint-N of that step."""
    weights = load_file(folder / "model.safetensors")
    model = restored["model"]
    assert set(model) - set(weights) == set(TIED)
    assert_same({k: model[k] for k in weights}, weights, f"{folder.name} weights")
    for tied, weight in TIED.items():
        assert torch.equal(model[tied], model[weight])
    assert_same(restored["optimizer"], load(folder / "optimizer.pt"), f"{folder.name} optimizer")
    assert_same(restored["schedulers"], [load(folder / "scheduler.pt")], f"{folder.name} scheduler")
    with safe_globals():  # HF's allow-list for the numpy state in its RNG file
        rng = torch.load(folder / "rng_state.pth", weights_only=True)
    assert_same(restored["rng"]["torch"], rng["cpu"])
    assert restored["rng"]["python"] == rng["python"]
    position = json.loads(restored["extra"]["transformers.Trainer"]["json"])
    expected = position["trainer_state"]
    expected["total_flos"] += position["since_log"]["current_flos"]  # HF's save adds the flops since the last log
    expected["stateful_callbacks"]["TrainerControl"]["args"]["should_save"] = True  # it is saving
    assert expected == json.loads((folder / "trainer_state.json").read_text()), folder.name


@pytest.mark.parametrize("strategy", strategy_params(STRATEGIES))
def test_restore_equals_hfs_own_checkpoint(runs, strategy):
    run = runs[strategy]
    assert set(run.restored) == set(RESTORED)
    for step, restored in run.restored.items():
        assert_equals_hfs_checkpoint(restored, run.cwd / "out" / f"checkpoint-{step}")


def test_hfs_own_resume_ends_as_the_uninterrupted_run_but_for_one_logged_loss(runs):
    """HF's own resume, measured: bit-exact too, except the first loss it logs after the resume
    point when that is not a logging step: its checkpoint does not hold the loss summed since the
    last log (ckptrun tracks it, see above)."""
    own, plain = runs["hf-resume"], runs["plain"]
    assert [line["step"] for line in own.losses()] == list(range(HF_RESUME + 1, STEPS + 1))
    assert HF_RESUME % LOG_STEPS
    expected, got = comparable(plain.final(), summary=False), comparable(own.final(), summary=False)
    first_log = next(i for i, e in enumerate(got["trainer_state"]["log_history"]) if e["step"] > HF_RESUME)
    for state in (expected, got):
        del state["trainer_state"]["log_history"][first_log]["loss"]
    assert_same(got, expected)
    assert_summary_covers_the_last_call(own.final(), losses_by_step(plain), HF_RESUME)


def test_a_script_resuming_hf_itself_is_left_to_hf(runs):
    """`train(resume_from_checkpoint=...)` under ckptrun: HF loads its own checkpoint as asked, the
    run ends as HF's own resume does, and ckptrun checkpoints it (counting its own steps)."""
    run, own = runs["script-resumes"], runs["hf-resume"]
    assert [line["step"] for line in run.losses()] == list(range(HF_RESUME + 1, STEPS + 1))
    final = run.final()
    assert_same(comparable(final), comparable(own.final()))
    [(last, restored)] = run.restored.items()
    assert last == STEPS - HF_RESUME
    assert_same(restored["model"], final["model"])
    position = json.loads(restored["extra"]["transformers.Trainer"]["json"])
    assert position["trainer_state"]["global_step"] == STEPS


def test_memory_first_resumes_from_the_engines_memory_as_the_uninterrupted_run(runs):
    """The default strategy with --persist-every 1000: the killed worker resumes step KILL-1
    from its engine's memory (HF's loop position and the trainer's state held in the slot, none
    of it on disk), takes exactly the steps after it and ends as the uninterrupted run."""
    run, plain = runs["memory-first"], runs["plain"]
    assert run.resume_step() == KILL - 1
    assert f"resumed step {KILL - 1} from the checkpoint engine's memory" in run.output
    assert [line["step"] for line in run.losses()] == [*range(1, KILL), *range(KILL, STEPS + 1)]
    assert [m.step for m in Store(run.cwd / "ckpts").manifests()] == [STEPS]
    assert_same(comparable(run.final(), summary=False), comparable(plain.final(), summary=False))


def test_max_steps_bounds_the_resumed_loop(runs):
    run = runs["bounded"]
    assert f"stopped the script after step {BOUND} (--max-steps)" in run.output
    assert [line["step"] for line in run.losses()] == [*range(1, KILL), *range(run.resume_step() + 1, BOUND + 1)]
    assert Store(run.cwd / "ckpts").manifests()[-1].step == BOUND
    assert_equals_hfs_checkpoint(run.restored[BOUND], run.cwd / "out" / f"checkpoint-{BOUND}")
    plain_weights = load_file(runs["plain"].cwd / "out" / f"checkpoint-{BOUND}" / "model.safetensors")
    assert_same(load_file(run.cwd / "out" / f"checkpoint-{BOUND}" / "model.safetensors"), plain_weights)
