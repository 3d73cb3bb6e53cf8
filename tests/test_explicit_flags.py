"""An explicit flag is never overridden (issue 33): auto-tuning fills in only what the user left
unset. `--every N` given leaves every multiple of N restorable once the run ends, for every
strategy (a strategy may commit more steps, never fewer), bit for bit the script's own save;
each auto flag given explicitly keeps its value while the auto one moves; a combination a
strategy cannot honour is refused at start in one line naming the flag."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import EXAMPLE, STEPS, TINY, assert_training_state, ckptrun, error_line, ok, restore, strategy_params
from test_tune import Trainer

from ckptrun.errors import UsageError
from ckptrun.strategies import REGISTRY, all_options
from ckptrun.strategies.gockpt.trainer import GoCkpt
from ckptrun.strategies.lightcheck.trainer import LightCheck
from ckptrun.strategies.lowdiff.policy import FullEveryBatch
from ckptrun.strategies.lowdiff_plus.trainer import LowDiffPlus
from ckptrun.strategies.memory_first.policy import PersistInterval
from ckptrun.strategies.pccheck.trainer import PCcheck
from ckptrun.strategies.save_policy import Measured
from ckptrun.worker.decisions import FIRST_EVAL, DalyInterval, FixedInterval, PersistBound, Retuner

EVERY = 3
# The strategies that map an explicit --every onto intervals of their own (the others checkpoint
# at the due steps it sets); the rest of the registry runs under --full.
MAPPED = tuple(name for name, entry in REGISTRY.items() if entry.explicit_every)


# ---- every strategy: --every 3 over 12 steps leaves 3, 6, 9, 12 restorable -----------------------


@pytest.fixture(scope="module")
def every_run(tmp_path_factory: pytest.TempPathFactory):
    """The checkpoint dir of one `--every 3` run of the example per strategy, every record kept
    and the strategy's own options unset (cached for the module)."""
    cache: dict[str, Path] = {}

    def get(strategy: str) -> Path:
        if strategy not in cache:
            cwd = tmp_path_factory.mktemp(f"every-{strategy}")
            ok(ckptrun(cwd, "--strategy", strategy, "--every", EVERY, "--keep", "0", "--dir", "ckpts",
                       "--no-dashboard", EXAMPLE, *TINY))
            cache[strategy] = cwd / "ckpts"
        return cache[strategy]

    return get


@pytest.mark.parametrize("strategy", strategy_params(MAPPED))
def test_every_multiple_of_an_explicit_every_is_restorable(strategy, every_run, example_truth, tmp_path):
    ckpt = every_run(strategy)
    for step in range(EVERY, STEPS + 1, EVERY):
        state, _ = restore(tmp_path, ckpt, step)
        assert state["step"] == step
        assert_training_state(state, example_truth(step))


@pytest.mark.parametrize(("flags", "says"), [
    (["--strategy", "lowdiff+", "--every", "10", "--persist-every", "4"], "--persist-every 4 with --every 10"),
    (["--strategy", "gockpt", "--every", "3", "--spread", "4"], "--spread 4 with --every 3"),
], ids=["lowdiff+", "gockpt"])
def test_an_explicit_every_that_cannot_be_honoured_is_refused_at_start(flags, says, tmp_path):
    proc = ckptrun(tmp_path, *flags, "--dir", "ckpts", EXAMPLE, *TINY)
    line = error_line(proc)
    assert proc.returncode == 2 and says in line and "give " in line, line
    assert not (tmp_path / "ckpts").exists()  # refused before anything started


def test_explicit_every_maps_onto_the_strategy_options():
    lowdiff_plus, gockpt = REGISTRY["lowdiff+"], REGISTRY["gockpt"]
    assert lowdiff_plus.honour_every({"persist_every": "auto"}, 10)["persist_every"] == "10"
    assert lowdiff_plus.honour_every({"persist_every": None}, 10)["persist_every"] == "10"
    assert lowdiff_plus.honour_every({"persist_every": "5"}, 10)["persist_every"] == "5"  # divides 10: kept
    with pytest.raises(UsageError, match="--persist-every 4 with --every 10"):
        lowdiff_plus.honour_every({"persist_every": "4"}, 10)
    assert gockpt.honour_every({"spread": "3"}, 3) == {"spread": "3"}
    with pytest.raises(UsageError, match="--spread 4 with --every 3"):
        gockpt.honour_every({"spread": "4"}, 3)
    assert REGISTRY["checkfreq"].honour_every({}, 7) == {}  # its due steps are --every's


@pytest.mark.parametrize(("argv", "recipe", "given", "persist_every"), [
    ([], "", False, "auto"),  # --every left at its default: lowdiff+'s own auto interval
    (["--every", "1"], "", True, "1"),  # the "--every 1": persisted every step
    ([], "every: 10\n", True, "10"),  # a recipe's value is given too
    (["--every", "auto"], "", False, "auto"),
    (["--every", "10", "--persist-every", "5"], "", True, "5"),  # an explicit --persist-every wins
], ids=["default", "every-1", "recipe", "auto", "both"])
def test_the_run_command_tells_a_given_every_from_its_default(argv, recipe, given, persist_every, tmp_path,
                                                              monkeypatch):
    from ckptrun import cli
    from ckptrun.launcher import run as launcher

    seen = []
    monkeypatch.setattr(launcher, "run", lambda cfg, opts, script, args, **kw: seen.append(cfg) or 0)
    path = tmp_path / "r.yaml"
    path.write_text("strategy: lowdiff+\n" + recipe)
    assert cli.main(["--recipe", str(path), *argv, str(EXAMPLE)]) == 0
    assert (seen[0].every_given, seen[0].options["persist_every"]) == (given, persist_every)


# ---- each auto flag: an explicit value wins -------------------------------------------------------


def test_explicit_every_is_never_retuned():
    """The same measurements move `--every auto` (Daly's interval) and leave `--every 4` alone."""
    retuner = Retuner(3600.0)
    fixed, auto = retuner.add(FixedInterval(4)), retuner.add(PersistBound(DalyInterval()))
    Trainer(retuner).run(FIRST_EVAL + 60, 0.1, 0.002)
    assert auto.every != 1 and fixed.every == 4


MEASURED = Measured(3600.0, True, step_s=0.1, iter_s=0.1, optim_s=0.01, persist_s=0.5, write_bw=1e8,
                    sizes={"full": 10**8, "diff": 10**7})


def _full_every() -> None:
    auto = FullEveryBatch().propose(MEASURED, 10)
    assert auto is not None and auto.settings["full_every"] != 7
    given = FullEveryBatch("7", "auto").propose(MEASURED, 10)
    assert given is None or given.settings["full_every"] == 7


def _batch() -> None:
    auto = FullEveryBatch().propose(MEASURED, 10)
    assert auto is not None and auto.settings["batch"] != 2
    given = FullEveryBatch("auto", "2").propose(MEASURED, 10)
    assert given is None or given.settings["batch"] == 2


def _persist_every() -> None:
    retuner = Retuner(3600.0)
    given, auto = retuner.add(PersistInterval(5)), retuner.add(PersistInterval(None))
    retuner.observe_write(10**6, 0.001)
    Trainer(retuner).run(FIRST_EVAL + 30, 0.1, 0.0)
    assert auto.every != 5 and given.every == 5 and not given.adjustable


def _ctx(**options: str) -> SimpleNamespace:
    """The little of a StrategyContext that a strategy's __init__ reads."""
    return SimpleNamespace(options=options, policy=lambda p: p, every_auto=False, every=1, every_given=False,
                           max_inflight=2)


def _rebase_every() -> None:
    assert LowDiffPlus(_ctx(rebase_every="7"))._rebase_every() == 7
    assert LowDiffPlus(_ctx(rebase_every="auto"))._rebase_every() == 0  # auto on the CPU: never


def _spread() -> None:
    given = GoCkpt(_ctx(spread="2"))
    assert (given.k, given.fixed_k) == (2, 2)  # never re-chosen (`_measure` and the byte ratio skip it)
    auto = GoCkpt(_ctx(spread="auto"))
    assert auto.fixed_k is None and auto._max_k() == 7
    assert auto._auto_k() == 7  # training on the CPU: the widest spread
    auto.ctx.every, auto.ctx.every_given = 3, True
    assert auto._max_k() == 3 == auto._auto_k()  # --every 3 given: an auto k ends each spread at a multiple of 3


def _chunk_mb() -> None:
    assert PCcheck(_ctx(chunk_mb="3"))._chunk_for(1 << 30) == 3 << 20
    assert PCcheck(_ctx(chunk_mb="auto"))._chunk_for(1 << 30) == 128 << 20


def _copy_to() -> None:
    assert LightCheck(_ctx(copy_to="region")).direct and not LightCheck(_ctx(copy_to="host")).direct


def _hw_failure_share() -> None:
    """auto: the share of machine losses the run's rates give (the launcher's `memory_lost_share`)."""
    assert LowDiffPlus(_ctx(hw_failure_share="0.9", memory_lost_share=0.2)).persist.hw_share == 0.9
    assert LowDiffPlus(_ctx(hw_failure_share="auto", memory_lost_share=0.2)).persist.hw_share == 0.2


EXPLICIT_WINS = {"full_every": _full_every, "batch": _batch, "persist_every": _persist_every,
                 "hw_failure_share": _hw_failure_share,
                 "rebase_every": _rebase_every, "spread": _spread, "chunk_mb": _chunk_mb, "copy_to": _copy_to}


@pytest.mark.parametrize("option", [o.name for _, o in all_options() if o.default == "auto"])
def test_each_auto_option_given_explicitly_wins(option):
    """Every registered option whose default is auto has a check here (a new one fails until it does)."""
    assert option in EXPLICIT_WINS, f"no check that an explicit --{option.replace('_', '-')} wins"
    EXPLICIT_WINS[option]()
