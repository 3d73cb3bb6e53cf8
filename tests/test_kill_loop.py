"""The randomized whole-tree kill loop (issue 10, "Tests that must exist"): for every strategy,
start a run, SIGKILL its whole process tree at a random moment, check that `verify` passes and
that `restore latest` equals the same step of an uninterrupted run, resume, and again; after the
kills, run to the end and compare the final state bit for bit. Nothing a killed run left behind
(staging files, temporary folder) outlives the next run's start.

By default the default strategy, checkfreq (record folders committed by a manifest rename; the
other commit protocol, lightcheck's and pccheck's pointer swap in a preallocated region, is killed
at each of its phases by tests/test_crash_matrix.py); every registered strategy under `--full` or
`--soak`. Two kills per strategy by default (each kill's moment drawn as below); `--soak N` makes it N (in cycles of
five, each in a fresh checkpoint directory), `--kill-seed S` replays the kill delays of a
reported seed.
"""

from __future__ import annotations

import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import EXAMPLE, TINY, assert_training_state, kill_tree, load, run_in_process, spawn, strategy_params

from ckptrun.cli import main as cli
from ckptrun.restore.export import export
from ckptrun.storage.leftovers import owned
from ckptrun.storage.store import Store
from ckptrun.strategies import REGISTRY

STEPS = 200
KILLS_PER_CYCLE = 5
DEFAULT_KILLS = 2
# When a kill comes: a third during start-up and resume (a random fraction of the time a run took
# to commit its first record), the rest a random moment (up to TRAINING_S) after a run's first
# new commit: training, writes, commits. Relative to what the run shows, not to the clock, so that
# a loaded machine shifts them along.
STARTUP_SHARE = 1 / 3
TRAINING_S = 1.2
# A run commits its first record within seconds, and finishes within a minute; longer is a hang.
FIRST_COMMIT_S, FINAL_RUN_S = 40, 120
# lowdiff's options (the other strategies ignore them): small, so that kills hit diff batches,
# full checkpoints and chains alike.
OPTIONS = ["--keep", "0", "--no-dashboard"]
ARGS = [EXAMPLE, *TINY, "--steps", STEPS]
STRATEGIES = ("checkfreq",)  # by default (see above); every registered one under --full or --soak


class Hang(AssertionError):
    pass


@pytest.fixture(scope="module")
def truth(tmp_path_factory) -> Callable[[int], dict]:
    """step -> the example's own save after `step` of one uninterrupted plain-python run."""
    root = tmp_path_factory.mktemp("kill-loop-truth")
    run_in_process(root, *ARGS, "--save-every", 1, "--save-path", root / "{step}.pt")
    return lambda step: load(root / f"{step}.pt")


@pytest.fixture
def seed(request) -> int:
    given = request.config.getoption("--kill-seed")
    return given if given is not None else random.SystemRandom().randrange(2**32)


def committed(ckpts: Path) -> int:
    """How many records are committed (a cheap look: manifests present, not read)."""
    return len(list(ckpts.glob("*/MANIFEST.json")))


class Loop:
    """One strategy's kill loop, and what happened so far for the failure message."""

    def __init__(self, strategy: str, seed: int, truth: Callable[[int], dict], flags: tuple[str, ...] = ()) -> None:
        self.strategy, self.seed, self.truth, self.flags = strategy, seed, truth, flags
        self.rng = random.Random(f"{seed}:{strategy}")
        self.history: list[str] = []
        self.launchers: list[int] = []
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0  # launch to first new commit, as the first kill in training measured it

    def start(self, cwd: Path) -> subprocess.Popen:
        proc = spawn(cwd, "--strategy", self.strategy, "--dir", "ckpts", *OPTIONS,
                     *REGISTRY[self.strategy].short_run_flags, *self.flags, *ARGS,
                     "--save-at", STEPS, "--save-path", "final.pt")
        self.launchers.append(proc.pid)
        self.proc = proc
        return proc

    def stop(self) -> None:
        """Kill the run still going after a failure."""
        if self.proc is not None and self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait()

    def kill_at_random(self, proc: subprocess.Popen, ckpts: Path) -> str | None:
        """Kill the run's whole tree at a random moment; None if it ended first (exit 0)."""
        t0, before = time.monotonic(), committed(ckpts)
        if self.startup_s and self.rng.random() < STARTUP_SHARE:
            when, delay = "start-up", self.rng.uniform(0.05, 1.0) * self.startup_s
        else:
            when, delay = "training", self.rng.uniform(0, TRAINING_S)
            while committed(ckpts) <= before and proc.poll() is None:
                if time.monotonic() - t0 > FIRST_COMMIT_S:
                    raise Hang(f"no new commit within {FIRST_COMMIT_S} s of the launch")
                time.sleep(0.05)
            self.startup_s = self.startup_s or time.monotonic() - t0
        try:
            rc = proc.wait(delay)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            return f"killed in {when} at {time.monotonic() - t0:.2f} s"
        self.history.append(f"exited {rc} before the kill in {when}")
        assert rc == 0, f"the run exited {rc} on its own"
        return None

    def latest_restores_exactly(self, ckpts: Path, newest_before: int) -> int:
        """`verify` passes, and `restore latest` is the uninterrupted run's state of that step."""
        if not ckpts.is_dir():  # killed before the launcher created it
            return newest_before
        assert cli(["verify", "--dir", str(ckpts)]) == 0, "verify failed (see the BAD lines above)"
        steps = [m.step for m in Store(ckpts).manifests()]
        newest = max(steps, default=-1)
        assert newest >= newest_before, f"the newest committed step went back from {newest_before} to {newest}"
        if steps:
            out = ckpts.parent / "latest.pt"
            export(ckpts, "latest", out, "torch")
            state = load(out)
            assert state["step"] == newest, f"restore latest gave step {state['step']}, newest committed {newest}"
            assert_training_state(state, self.truth(newest))
        return newest

    def cycle(self, cwd: Path, kills: int) -> int:
        """Up to `kills` kills, then a run to the end, in a fresh directory; returns the kills done."""
        cwd.mkdir()
        ckpts, newest, done = cwd / "ckpts", -1, 0
        while done < kills:
            killed = self.kill_at_random(self.start(cwd), ckpts)
            if killed is None:
                break
            done += 1
            newest = self.latest_restores_exactly(ckpts, newest)
            self.history.append(f"{killed}, newest {newest}")
        else:
            t0, proc = time.monotonic(), self.start(cwd)
            try:
                rc = proc.wait(FINAL_RUN_S)
            except subprocess.TimeoutExpired:
                raise Hang(f"the final run did not finish within {FINAL_RUN_S} s") from None
            self.history.append(f"final run exited {rc} after {time.monotonic() - t0:.1f} s")
            assert rc == 0, f"the final run exited {rc}"
        assert_training_state(load(cwd / "final.pt"), self.truth(STEPS))
        assert self.latest_restores_exactly(ckpts, newest) == STEPS
        assert Store(ckpts).incomplete() == [], "a run that exited 0 left torn records"
        return done

    def leftovers(self) -> list[Path]:
        """What the killed launchers left in shared memory or the temporary folder."""
        return [path for path, owner in owned() if owner.pid in self.launchers and not owner.alive()]

    def failed(self, cwd: Path, e: AssertionError) -> AssertionError:
        log = (cwd / "ckptrun.log").read_text()[-3000:] if (cwd / "ckptrun.log").exists() else ""
        return type(e)(f"strategy {' '.join([self.strategy, *self.flags])}, seed {self.seed} (replay: --kill-seed "
                       f"{self.seed}); "
                       f"so far: {'; '.join(self.history)}\n{e}\n--- ckptrun log (tail) ---\n{log}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "strategy" in metafunc.fixturenames:
        soak = metafunc.config.getoption("--soak")
        metafunc.parametrize("strategy", strategy_params(REGISTRY if soak else STRATEGIES))


def test_kill_loop(strategy, seed, truth, tmp_path, request):
    run_loop(Loop(strategy, seed, truth), tmp_path, request.config.getoption("--soak") or DEFAULT_KILLS)


@pytest.mark.full  # (tests/test_memory_first.py kills workers and engines at set points by default)
def test_kill_loop_memory_first(seed, truth, tmp_path, request):
    """The default strategy holding every step in memory and writing every 3rd (`--persist-every`):
    a slot held is written as the next capture starts, and the disk holds fewer steps."""
    run_loop(Loop(STRATEGIES[0], seed, truth, ("--persist-every", "3")), tmp_path,
             request.config.getoption("--soak") or DEFAULT_KILLS)


def run_loop(loop: Loop, tmp_path: Path, kills: int) -> None:
    strategy, seed, done, cycle = loop.strategy, loop.seed, 0, 0
    while done < kills:
        assert cycle <= kills, f"the runs end before the kills (seed {seed}): {loop.history}"
        cwd = tmp_path / f"cycle-{cycle}"
        try:
            done += loop.cycle(cwd, min(KILLS_PER_CYCLE, kills - done))
        except AssertionError as e:
            raise loop.failed(cwd, e) from None
        finally:
            loop.stop()
        cycle += 1
    print(f"{' '.join([strategy, *loop.flags])}, seed {seed}:", "; ".join(loop.history))
    assert loop.leftovers() == [], f"left behind by killed runs (seed {seed}): {loop.leftovers()}"
