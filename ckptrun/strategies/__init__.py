"""The strategy registry: name -> where its trainer side (and engine side, if any) lives.

Entries are import paths so that neither the CLI nor the engine imports torch to list them.
Strategies outside the package register an `Entry` under the entry-point group
`ckptrun.strategies` (docs/architecture.md, "Adding a strategy").
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import entry_points

from ..log import log
from . import datastates, gockpt, lightcheck, lowdiff, lowdiff_plus, memory_first, pccheck
from .options import Option

GROUP = "ckptrun.strategies"
DEFAULT = "checkfreq"  # `ckptrun run`'s --strategy when none is given
BASELINE = "sync"  # the blocking checkpoint (torch.save's): `ckptrun tune` measures costs against it


@dataclass(frozen=True)
class Entry:
    trainer: str
    summary: str
    engine_handler: str | None = None
    options: tuple[Option, ...] = ()  # its own flags (the CLI adds them to `run`)
    # Flags that make a short run (tens of steps) exercise the whole mechanism (lowdiff: several
    # full checkpoints and diff batches); the registry-wide contract tests pass them.
    short_run_flags: tuple[str, ...] = ()
    # `ckptrun tune`: "module:MODEL", a `ckptrun.tuning.model.TuningModel` instance: its paper's
    # model, reported, and this strategy's settings from it (see ckptrun/strategies/lowdiff/tuning.py);
    # None keeps the interval plan.
    tuning: str | None = None
    # It checkpoints sharded state (DTensor parameters and optimizer state: FSDP2, tensor parallel)
    # through the shared capture path; one that does not (the replay strategies: their engines and
    # offline replay step whole tensors) is refused when such an optimizer appears.
    sharded: bool = False
    # Under DDP, each replicated tensor (parameters, their gradients in diff records, optimizer
    # state) is written by one rank only (storage/writeonce.py); one that does not writes them
    # from every rank.
    write_once: bool = False
    # Its intervals (capture, diff, persist, full) and how --every N maps onto them, one sentence
    # (`ckptrun run --help`, README).
    intervals: str = ""
    # "module:function(options, every) -> options" (torch-free): --every N was given, so every
    # multiple of N must be restorable once the run ends; returns the strategy's option values
    # with what N implies filled in where the user left them unset, or raises UsageError naming
    # the flag that cannot be honoured and what to give instead. Called by the launcher before
    # anything starts. None: the strategy checkpoints at `ctx.due` steps, which --every sets.
    explicit_every: str | None = None
    # --replicas K > 1: its committed records are record folders that a rank's part alone restores
    # (no chain of records, no region of its own, nothing an engine holds needed to restore), so a
    # partner's copy of a rank's part of the newest one brings a replaced node back. One that does
    # not is refused.
    replicas: bool = False
    # `ckptrun tune`: (SUFFIX, "module:MODEL") rows of this strategy with other settings, each
    # planned by its own TuningModel from the same measured costs (row NAME-SUFFIX).
    tuning_variants: tuple[tuple[str, str], ...] = ()

    def load(self):
        return _attr(self.trainer)

    def load_tuning(self):
        return _attr(self.tuning)

    def load_tuning_variants(self) -> dict:
        """{suffix: TuningModel} of `tuning_variants`."""
        return {suffix: _attr(path) for suffix, path in self.tuning_variants}

    def honour_every(self, options: dict, every: int) -> dict:
        """`options` with an explicit --every N mapped onto this strategy's intervals (see
        `explicit_every`)."""
        return _attr(self.explicit_every)(options, every) if self.explicit_every else options

    def holds_snapshots(self, options: dict) -> bool:
        """Does the engine hold its snapshots in memory (a snapshot strategy given --persist-every)?"""
        return memory_first.SNAPSHOT_PERSIST_EVERY in self.options and options.get("persist_every") is not None

    def least_inflight(self, options: dict, replicas: int) -> int:
        """The fewest staging slots it works with: those the engine holds, and one to capture into."""
        return memory_first.least_slots(replicas) if self.holds_snapshots(options) else 1


def _attr(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


BUILTIN: dict[str, Entry] = {
    "sync": Entry("ckptrun.strategies.sync:Sync",
                  "blocking write on the training path (the torch.save baseline)", sharded=True, write_once=True,
                  replicas=True, options=(memory_first.SNAPSHOT_PERSIST_EVERY,),
                  explicit_every="ckptrun.strategies.memory_first:snapshot_every",
                  intervals="one: a checkpoint captured and written every N steps. With --persist-every P: "
                            "captured every step and held in the engine's memory, written every P (P must "
                            "divide N)."),
    "checkfreq": Entry("ckptrun.strategies.checkfreq:CheckFreq",
                       "snapshot to host overlapped with the next forward/backward; persist in the engine",
                       sharded=True, write_once=True, replicas=True, options=(memory_first.SNAPSHOT_PERSIST_EVERY,),
                       explicit_every="ckptrun.strategies.memory_first:snapshot_every",
                       tuning_variants=(memory_first.TUNED_VARIANT,),
                       intervals="one: a snapshot every N steps, persisted in the background. With "
                                 "--persist-every P: a snapshot every step held in the engine's memory, "
                                 "written every P (P must divide N)."),
    "lowdiff": Entry("ckptrun.strategies.lowdiff.trainer:LowDiff",
                     "every step's gradient as a batched differential checkpoint; full every F; exact replay",
                     engine_handler="ckptrun.strategies.lowdiff.engine:LowDiffHandler", options=lowdiff.OPTIONS,
                     short_run_flags=("--full-every", "8", "--batch", "3"),
                     tuning="ckptrun.strategies.lowdiff.tuning:MODEL", write_once=True,
                     intervals="a diff every step, --batch B per record, a full checkpoint every --full-every F; "
                               "every step is restorable by replay, so any N is met and F, B stay as given "
                               "(or auto)."),
    "lowdiff+": Entry("ckptrun.strategies.lowdiff_plus.trainer:LowDiffPlus",
                      "gradients copied layer-wise during backward update a CPU replica in the engine; a worker "
                      "crash resumes from it (no disk read); the replica is persisted every P steps",
                      engine_handler="ckptrun.strategies.lowdiff_plus.engine:LowDiffPlusHandler",
                      options=lowdiff_plus.OPTIONS, short_run_flags=("--persist-every", "1"),
                      tuning="ckptrun.strategies.memory_first.tuning:REPLICA", write_once=True, replicas=True,
                      explicit_every="ckptrun.strategies.memory_first:replica_every",
                      intervals="in memory every step; the replica persisted every --persist-every P: --every N "
                                "sets P = N (a given P must divide N); without --every, P is auto."),
    "pccheck": Entry("ckptrun.strategies.pccheck.trainer:PCcheck",
                     "N checkpoints in flight, chunks persisted by parallel writers into a slotted region; "
                     "pointer commit", engine_handler="ckptrun.strategies.pccheck.engine:PCcheckHandler",
                     options=pccheck.OPTIONS, short_run_flags=("--max-inflight", "3", "--chunk-mb", "1"),
                     tuning="ckptrun.strategies.pccheck.tuning:MODEL", sharded=True, write_once=True,
                     intervals="one: a checkpoint every N steps, up to --max-inflight in flight (auto: f*)."),
    "lightcheck": Entry("ckptrun.strategies.lightcheck.trainer:LightCheck",
                        "layer-wise copies into a mapped region file overlapped with the next step; each layer's "
                        "update waits only for its own copy; slot commit",
                        engine_handler="ckptrun.strategies.lightcheck.engine:LightCheckHandler",
                        options=lightcheck.OPTIONS, short_run_flags=("--copy-to", "region"),
                        sharded=True, write_once=True,
                        intervals="one: a layer-wise copy every N steps."),
    "datastates": Entry("ckptrun.strategies.datastates.trainer:DataStates",
                        "lazy snapshot copied during the next forward/backward, streamed chunk by chunk with objects "
                        "serialized on the side into one self-describing file per rank (header at the end)",
                        engine_handler="ckptrun.strategies.datastates.engine:DataStatesHandler",
                        options=datastates.OPTIONS, short_run_flags=("--stream-mb", "1"),
                        sharded=True, write_once=True,
                        intervals="one: a lazy snapshot every N steps."),
    "gockpt": Entry("ckptrun.strategies.gockpt.trainer:GoCkpt",
                    "one checkpoint spread over k steps in blocks (parameter + optimizer slices); gradients of "
                    "blocks already sent shipped each step; the engine rolls every block forward to one version",
                    engine_handler="ckptrun.strategies.gockpt.engine:GoCkptHandler", options=gockpt.OPTIONS,
                    tuning="ckptrun.strategies.gockpt.tuning:MODEL", write_once=True, replicas=True,
                    explicit_every="ckptrun.strategies.gockpt:explicit_every",
                    intervals="a checkpoint spread over --spread k steps: --every N makes each spread end at "
                              "a multiple of N (k at most N); without --every, a spread starts whenever none "
                              "runs (a record every k steps).",
                    # k = 1 (with small blocks: split tensors, shared blocks): the registry-wide suites assume
                    # a record of every due step, which a spread skips; tests/test_gockpt.py spreads
                    short_run_flags=("--spread", "1", "--block-mb", "0.05")),
}


@functools.cache
def registry() -> dict[str, Entry]:
    """The built-in strategies, then each entry point of GROUP that names an `Entry` (read once per
    process: the launcher and its workers, on the same path, agree); one that does not load,
    or takes a name already used, is left out with a warning rather than breaking every command."""
    found = dict(BUILTIN)
    for ep in entry_points(group=GROUP):
        try:
            entry = ep.load()
        except Exception as e:  # a third party's module: any error it raises
            log.warning(f"warning: strategy {ep.name!r} ({ep.value}) left out: {type(e).__name__}: {e}")
            continue
        if ep.name in found or not isinstance(entry, Entry):
            why = "the name is taken" if ep.name in found else f"{ep.value} is not a ckptrun.strategies.Entry"
            log.warning(f"warning: strategy {ep.name!r} left out: {why}")
            continue
        found[ep.name] = entry
    return found


def __getattr__(name: str) -> dict[str, Entry]:
    """`REGISTRY` is built on first use, not on import: a strategy's entry module imports this package."""
    if name == "REGISTRY":
        return registry()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def names() -> list[str]:
    return list(registry())


def names_where(test: Callable[[Entry], bool]) -> str:
    """The registered strategies that `test` accepts, comma-separated: what an error that refuses
    one strategy offers instead, without naming strategies outside this package."""
    return ", ".join(name for name, entry in registry().items() if test(entry))


def checkpoints_every_optimizer(entry: Entry) -> bool:
    """It saves each optimizer's state as it is (no replay of one optimizer's gradients)."""
    return not entry.load().single_optimizer


def all_options() -> Iterator[tuple[str, Option]]:
    """(strategy, option) for every registered strategy's options. Strategies may share a flag
    (`--persist-every`) when it takes the same values; its default and help may differ."""
    seen: dict[str, tuple[str, Option]] = {}
    for name, entry in registry().items():
        for opt in entry.options:
            if opt.name in seen and not _same_values(seen[opt.name][1], opt):
                raise RuntimeError(f"strategy {name} redeclares option {opt.flag} of {seen[opt.name][0]} "
                                   "with other values")
            seen.setdefault(opt.name, (name, opt))
            yield name, opt


def options_by_flag() -> dict[str, list[tuple[str, Option]]]:
    """Each option name, with the (strategy, option) pairs that declare it, in registry order."""
    flags: dict[str, list[tuple[str, Option]]] = {}
    for strategy, opt in all_options():
        flags.setdefault(opt.name, []).append((strategy, opt))
    return flags


def _same_values(a: Option, b: Option) -> bool:
    return (a.choices, a.ints, a.fraction, a.trains) == (b.choices, b.ints, b.fraction, b.trains)
