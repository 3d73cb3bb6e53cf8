"""What `ckptrun bench` runs: model sizes, the configurations (the `none` baseline, the
references, every ckptrun strategy) and the command line of each run.

The references are checkpointing that the example script does itself (`--ref-save`, see
examples/bench_refs.py); `none` is the same script without checkpointing, the denominator of
every ratio, except for a strategy run with options that change training itself (gradient
compression: `Option.trains`): its denominator is `none+VALUE`, the script trained the same way
(the same flag) without checkpointing, so the ratio is the cost of checkpointing alone.
Strategies run the same script under the ckptrun launcher, with the engine's file
writer given by `--io-engine` (several, comma-separated: each strategy runs with each, named
`STRATEGY:ENGINE`, to compare the native and the Python writer on the same strategy).
"""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import CkptrunError, UsageError
from ..faults import ENV as FAULT_ENV

BASELINE = "none"
# Display name -> the example script's `--ref-save` value.
REFERENCES = {"torch.save": "torch", "dcp-thread": "dcp-thread", "dcp-process": "dcp-process"}
# The references of `--strategies default` (one DCP mode; `all` adds dcp-process).
DEFAULT_REFERENCES = ("torch.save", "dcp-thread")

# Example-script flags per size. tiny: seconds, for tests; small (CPU default): ~4.2M parameters,
# ~55 MB of model + AdamW state, so checkpoint costs show next to a ~0.1 s step on one core;
# medium: ~110M parameters (~1.3 GB of state), for GPUs; large: ~362M parameters (4.3 GB of
# model + AdamW state, fp32), a step of ~0.2 s on an H100 (8.9 TFLOP): the GPU check's bench;
# wide (CPU): ~141M parameters, nearly all in a 262144 x 512 embedding (tied with the head): 1.7 GB
# of model + AdamW state against a step of about a second on one core (32 tokens: ~9 GFLOP forward
# through the head, twice that backward, then AdamW over 141M values), over 1 GB of state per second
# of step, above the ~570 MB/s this machine's disk writes: the regime where the state outruns the disk.
MODELS: dict[str, dict[str, int]] = {
    "tiny": {"layers": 2, "d-model": 64, "heads": 4, "vocab": 256, "seq": 32, "batch": 8},
    "small": {"layers": 4, "d-model": 256, "heads": 4, "vocab": 4096, "seq": 64, "batch": 4},
    "medium": {"layers": 12, "d-model": 768, "heads": 12, "vocab": 32768, "seq": 256, "batch": 8},
    "large": {"layers": 26, "d-model": 1024, "heads": 16, "vocab": 32768, "seq": 512, "batch": 8},
    "wide": {"layers": 2, "d-model": 512, "heads": 8, "vocab": 262144, "seq": 16, "batch": 2},
}


@dataclass(frozen=True)
class Configuration:
    """One bar of the benchmark: a method at a checkpoint interval."""

    name: str
    method: str  # "none", a REFERENCES key, or a strategy name
    kind: str  # "baseline", "reference" or "ckptrun"
    every: int | None  # None: the strategy's defaults (no --every); a reference's: not chosen yet
    flags: tuple[str, ...] = ()  # a strategy's own run options (VARIANTS); a baseline's script flags
    reference: str = BASELINE  # the configuration its overhead ratio is measured against
    durable: str = ""  # `bench --durable`: the tier its runs drain to, each under a prefix of its own
    # A reference's interval chosen within the budget (bench/budget.py): the cost of one save that chose it,
    # and the steps from a save's step until it was on disk, both measured in its calibration run
    save_cost_s: float | None = None
    save_lag_steps: float | None = None


@dataclass(frozen=True)
class Workload:
    """The example GPT run the same way in every configuration."""

    script: Path
    model: str
    device: str
    threads: int

    def script_args(self, steps: int, timing_json: Path) -> list[str]:
        sizes = [a for flag, v in MODELS[self.model].items() for a in (f"--{flag}", str(v))]
        return [*sizes, "--steps", str(steps), "--threads", str(self.threads), "--device", self.device,
                "--timing-json", str(timing_json)]


def example_script() -> Path:
    """examples/train_gpt.py of the source tree this ckptrun runs from."""
    path = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
    if not path.is_file():
        raise CkptrunError(f"ckptrun bench trains examples/train_gpt.py, not found at {path}; "
                           "run it from a ckptrun source checkout (pip install -e .)")
    return path


DEFAULTS = "default"  # `--every default`: each strategy at its own defaults, the references within the budget


def parse_every(text: str) -> list[int | None]:
    """The intervals of `--every`: step counts, and None for `default` (no --every: each
    strategy's own cadence; the references at the interval the budget allows, bench/budget.py)."""
    try:
        values = [None if v.strip() == DEFAULTS else int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--every takes `{DEFAULTS}` or step counts separated by commas, e.g. 1,5,10 "
                         f"(got {text!r})") from None
    if not values or min((v for v in values if v is not None), default=1) < 1:
        raise UsageError(f"--every values must be at least 1 (got {text!r})")
    return list(dict.fromkeys(values))


def every_label(every: int | None) -> str:
    """An interval as names and tables show it: `auto` for the defaults."""
    return "auto" if every is None else str(every)


# Strategy settings worth a bar of their own: name -> (strategy, its run options).
VARIANTS = {"lowdiff+topk": ("lowdiff", ("--compress", "topk:0.01")),
            "lightcheck-whole": ("lightcheck", ("--layer-wait", "whole")),
            "lightcheck-region": ("lightcheck", ("--copy-to", "region")),
            "lightcheck-host": ("lightcheck", ("--copy-to", "host")),
            "lowdiff+persist1": ("lowdiff+", ("--persist-every", "1")),
            "checkfreq-persist10": ("checkfreq", ("--persist-every", "10")),
            "sync-persist10": ("sync", ("--persist-every", "10")),
            "gockpt-k1": ("gockpt", ("--spread", "1")),
            "gockpt-k4": ("gockpt", ("--spread", "4")),
            "gockpt-k7": ("gockpt", ("--spread", "7"))}


# NAME-nobudget: a strategy at its defaults without the overhead budget (--max-overhead off), the
# defaults before the budget existed: beside NAME in one invocation, what the budget changes.
NOBUDGET = "-nobudget"


def variant(method: str) -> tuple[str, tuple[str, ...]]:
    """(strategy, its flags) of a configuration's method: a VARIANTS entry, NAME-nobudget, or NAME."""
    if method in VARIANTS:
        return VARIANTS[method]
    if method.endswith(NOBUDGET):
        return method.removesuffix(NOBUDGET), ("--max-overhead", "off")
    return method, ()


def parse_io_engines(text: str) -> list[str]:
    from ..storage.iowriter import ENGINES

    values = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not values or any(v not in ENGINES for v in values):
        raise UsageError(f"--io-engine takes {', '.join(ENGINES)}, comma-separated (got {text!r})")
    return values


def configurations(methods: str, every: str, io_engines: str = "auto", durable: str = "", *,
                   nodes: int = 1, replicas: int = 1, max_overhead: str = "",
                   host_memory: str = "") -> list[Configuration]:
    """`none` first, then each chosen reference and strategy at each interval (and each writer,
    strategies only), in that order. `default` stands for DEFAULT_REFERENCES and every registered
    strategy at its defaults (what each strategy costs against what one would use otherwise);
    `all` for every reference, strategy and VARIANTS entry. With `durable` (a --durable URL),
    each strategy's configuration is followed by NAME+durable, the same run draining to it,
    whose ratio is against NAME: what the remote tier adds; with `replicas` K > 1, each that
    takes --replicas by NAME+node-local (a --dir per node, against NAME: what the layout adds)
    and NAME+replicas (the same with --replicas K, against NAME+node-local: what the copies in
    partners' memory add). On `nodes` > 1 the
    references (the script's own saves, one process) are not run: `default` and `all` leave
    them out, and one named is refused. An interval None (`default`) is a reference's to be
    chosen within the budget (bench/budget.py) before it runs. `max_overhead` and `host_memory`,
    when given, are passed to every ckptrun run as --max-overhead and --host-memory."""
    from ..strategies import REGISTRY

    refs = REFERENCES if nodes == 1 else {}
    known = [*refs, *REGISTRY, *VARIANTS]
    groups = {"default": [*(r for r in DEFAULT_REFERENCES if r in refs), *REGISTRY], "all": known}
    known = [*known, *(f"{name}{NOBUDGET}" for name in REGISTRY)]
    wanted = [n for m in methods.split(",") if m.strip() for n in groups.get(m.strip(), [m.strip()])]
    if nodes > 1 and (named := [m for m in wanted if m in REFERENCES]):
        raise UsageError(f"{', '.join(named)} run on one node (the script's own saves): leave them out of "
                         "--strategies, or use --nodes 1")
    unknown = [m for m in wanted if m != BASELINE and m not in known]
    if unknown:
        raise UsageError(f"unknown --strategies {', '.join(unknown)}; choose from: default, all, {BASELINE}, "
                         f"{', '.join(known)}")
    intervals, engines = parse_every(every), parse_io_engines(io_engines)
    baselines = {BASELINE: Configuration(BASELINE, BASELINE, "baseline", None)}
    configs = []
    for method in dict.fromkeys(m for m in wanted if m != BASELINE):
        for e in intervals:
            name = method if len(intervals) == 1 else f"{method}@{every_label(e)}"
            if method in REFERENCES:
                configs.append(Configuration(name, method, "reference", e))
                continue
            base, flags = variant(method)
            flags = (*flags, "--max-overhead", max_overhead) if max_overhead and "--max-overhead" not in flags \
                else flags
            flags = (*flags, "--host-memory", host_memory) if host_memory else flags
            reference = matching_baseline(base, flags)
            baselines.setdefault(reference.name, reference)
            for io in engines:
                plain = Configuration(name if len(engines) == 1 else f"{name}:{io}", base, "ckptrun", e,
                                      (*flags, "--io-engine", io), reference.name)
                configs.append(plain)
                if durable:
                    configs.append(replace(plain, name=f"{plain.name}+durable", reference=plain.name,
                                           durable=durable))
                if replicas > 1 and REGISTRY[base].replicas:
                    local = replace(plain, name=f"{plain.name}+node-local", reference=plain.name,
                                    flags=(*plain.flags, "--node-local-dir"))
                    configs += [local, replace(local, name=f"{plain.name}+replicas", reference=local.name,
                                               flags=(*local.flags, "--replicas", str(replicas)))]
    return [*baselines.values(), *configs]


def matching_baseline(strategy: str, flags: tuple[str, ...]) -> Configuration:
    """`none`, or `none+VALUE` where `flags` set options of `strategy` that change training
    (`Option.trains`): the example script run with those same flags, without checkpointing."""
    from ..strategies import REGISTRY

    trains = {o.flag for o in REGISTRY[strategy].options if o.trains}
    pairs = [(flag, value) for flag, value in zip(flags[::2], flags[1::2], strict=False) if flag in trains]
    if not pairs:
        return Configuration(BASELINE, BASELINE, "baseline", None)
    name = "+".join([BASELINE, *(value for _, value in pairs)])
    return Configuration(name, BASELINE, "baseline", None, tuple(a for pair in pairs for a in pair))


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    crash_step: int | None = None  # ckptrun runs: the worker is killed in this step and restarted


def launch(cfg: Configuration, work: Workload, run_dir: Path, steps: int, *, recovery: bool = False) -> Launch:
    """How to run `cfg` for `steps` steps in `run_dir`.

    ckptrun runs measure their recovery in the same launch: the worker is killed in step
    steps+1 (after its backward, `CKPTRUN_FAULT`), the launcher restarts it, and it resumes from
    the newest committed step. A script (the references) is instead run again with `recovery`:
    it restores its newest save and takes one step, without periodic saves of its own.
    """
    env = run_env()
    if cfg.kind == "ckptrun":
        # nothing to recover from when the interval exceeds the run (at the defaults: there is something)
        crash = steps + 1 if cfg.every is None or cfg.every <= steps else None
        if crash:
            env[FAULT_ENV] = f"kill:step={crash}"
        return Launch(_ckptrun_argv(cfg, work, run_dir, crash or steps, 1 if crash else 0), env, crash)
    return Launch(_script_argv(cfg, work, run_dir, steps, every=steps + 1 if recovery else cfg.every,
                               resume=recovery), env)


def failure_launch(cfg: Configuration, work: Workload, run_dir: Path, steps: int, *, again: bool) -> Launch:
    """How `bench --failures` runs `cfg` (`again`: after its whole process tree was killed). The
    launcher restarts a killed worker (no restart limit); a script is started `again` by the bench,
    the references from their newest save, `none` from step 0 (it has nothing to resume from)."""
    if cfg.kind == "ckptrun":
        return Launch(_ckptrun_argv(cfg, work, run_dir, steps, FAILURE_RESTARTS), run_env())
    return Launch(_script_argv(cfg, work, run_dir, steps, every=cfg.every, resume=again), run_env())


FAILURE_RESTARTS = 1_000_000  # `--max-restarts` under `bench --failures`: the bench decides when a run ends


def run_env() -> dict[str, str]:
    """The environment of a run: this one's, less ckptrun's own settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith("CKPTRUN_")}


def _ckptrun_argv(cfg: Configuration, work: Workload, run_dir: Path, steps: int, max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "ckptrun", "run",
            *ckptrun_flags(cfg, run_dir / "ckpt", run_dir / "metrics", run_dir.name),
            "--max-restarts", str(max_restarts), str(work.script), *work.script_args(steps, run_dir / "timing.jsonl")]


def ckptrun_flags(cfg: Configuration, ckpt_dir: Path, metrics_dir: Path, run_name: str) -> list[str]:
    """`ckptrun run`'s flags for `cfg`: strategy, its options, --dir, --every, --metrics-dir."""
    # The defaults (None) and interval 1 leave --every unset: each strategy's own cadence (its own
    # intervals auto, or as a variant sets them). A given --every N is honoured as given (every
    # multiple of N restorable), which pins those intervals to N, or refuses a variant that cannot.
    every = ["--every", str(cfg.every)] if cfg.every not in (None, 1) else []
    # A numeric interval is measured as asked: no overhead budget thins it (unless --max-overhead
    # was given to bench); `default` (None) runs each strategy at its defaults, the budget included.
    if cfg.every is not None and "--max-overhead" not in cfg.flags:
        every += ["--max-overhead", "off"]
    # A prefix of its own per run: a run never resumes from, or is refused over, another's steps.
    durable = ["--durable", f"{cfg.durable.rstrip('/')}/{run_name}-{uuid.uuid4().hex[:8]}"] if cfg.durable else []
    return ["--strategy", cfg.method, *cfg.flags, *durable, "--dir", str(ckpt_dir), *every,
            "--metrics-dir", str(metrics_dir)]


def _script_argv(cfg: Configuration, work: Workload, run_dir: Path, steps: int, *, every: int | None,
                 resume: bool) -> list[str]:
    argv = [sys.executable, str(work.script), *work.script_args(steps, run_dir / "timing.jsonl")]
    if cfg.kind == "baseline":
        return [*argv, *cfg.flags]
    if every is None:
        raise CkptrunError(f"{cfg.name} has no interval yet: the bench chooses it within the budget first")
    argv += ["--ref-save", REFERENCES[cfg.method], "--ref-every", str(every), "--ref-dir", str(run_dir / "ckpt")]
    return [*argv, "--ref-resume"] if resume else argv
