"""What `ckptrun bench` runs: model sizes, the configurations (the `none` baseline, the
references, every ckptrun strategy) and the command line of each run.

The references are checkpointing that the example script does itself (`--ref-save`, see
examples/bench_refs.py); `none` is the same script without checkpointing, the denominator of
every ratio. Strategies run the same script under the ckptrun launcher, with the engine's file
writer given by `--io-engine` (several, comma-separated: each strategy runs with each, named
`STRATEGY:ENGINE`, to compare the native and the Python writer on the same strategy).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import CkptrunError, UsageError
from ..faults import ENV as FAULT_ENV

BASELINE = "none"
# Display name -> the example script's `--ref-save` value.
REFERENCES = {"torch.save": "torch", "dcp-thread": "dcp-thread", "dcp-process": "dcp-process"}

# Example-script flags per size. tiny: seconds, for tests; small (CPU default): ~4.2M parameters,
# ~55 MB of model + AdamW state, so checkpoint costs show next to a ~0.1 s step on one core;
# medium: ~110M parameters (~1.3 GB of state), for GPUs.
MODELS: dict[str, dict[str, int]] = {
    "tiny": {"layers": 2, "d-model": 64, "heads": 4, "vocab": 256, "seq": 32, "batch": 8},
    "small": {"layers": 4, "d-model": 256, "heads": 4, "vocab": 4096, "seq": 64, "batch": 4},
    "medium": {"layers": 12, "d-model": 768, "heads": 12, "vocab": 32768, "seq": 256, "batch": 8},
}


@dataclass(frozen=True)
class Configuration:
    """One bar of the benchmark: a method at a checkpoint interval."""

    name: str
    method: str  # "none", a REFERENCES key, or a strategy name
    kind: str  # "baseline", "reference" or "ckptrun"
    every: int | None
    flags: tuple[str, ...] = ()  # a strategy's own run options (VARIANTS)


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


def parse_every(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--every takes step counts separated by commas, e.g. 1,5,10 (got {text!r})") from None
    if not values or min(values) < 1:
        raise UsageError(f"--every values must be at least 1 (got {text!r})")
    return list(dict.fromkeys(values))


# Strategy settings worth a bar of their own: name -> (strategy, its run options).
VARIANTS = {"lowdiff+topk": ("lowdiff", ("--compress", "topk:0.01")),
            "lightcheck-whole": ("lightcheck", ("--layer-wait", "whole")),
            "lightcheck-region": ("lightcheck", ("--copy-to", "region")),
            "lightcheck-host": ("lightcheck", ("--copy-to", "host")),
            "lowdiff+persist1": ("lowdiff+", ("--persist-every", "1")),
            "gockpt-k1": ("gockpt", ("--spread", "1")),
            "gockpt-k4": ("gockpt", ("--spread", "4")),
            "gockpt-k7": ("gockpt", ("--spread", "7"))}


def parse_io_engines(text: str) -> list[str]:
    from ..storage.iowriter import ENGINES

    values = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not values or any(v not in ENGINES for v in values):
        raise UsageError(f"--io-engine takes {', '.join(ENGINES)}, comma-separated (got {text!r})")
    return values


def configurations(methods: str, every: str, io_engines: str = "auto") -> list[Configuration]:
    """`none` first, then each chosen reference and strategy at each interval (and each writer,
    strategies only), in that order."""
    from ..strategies import REGISTRY

    known = [*REFERENCES, *REGISTRY, *VARIANTS]
    wanted = known if methods.strip() == "all" else [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in wanted if m != BASELINE and m not in known]
    if unknown:
        raise UsageError(f"unknown --strategies {', '.join(unknown)}; choose from: all, {BASELINE}, "
                         f"{', '.join(known)}")
    intervals, engines = parse_every(every), parse_io_engines(io_engines)
    configs = [Configuration(BASELINE, BASELINE, "baseline", None)]
    for method in dict.fromkeys(m for m in wanted if m != BASELINE):
        for e in intervals:
            name = method if len(intervals) == 1 else f"{method}@{e}"
            if method in REFERENCES:
                configs.append(Configuration(name, method, "reference", e))
                continue
            base, flags = VARIANTS.get(method, (method, ()))
            for io in engines:
                configs.append(Configuration(name if len(engines) == 1 else f"{name}:{io}", base, "ckptrun", e,
                                             (*flags, "--io-engine", io)))
    return configs


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
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTRUN_")}
    timing, ckpt = run_dir / "timing.jsonl", str(run_dir / "ckpt")
    if cfg.kind == "ckptrun":
        crash = steps + 1 if cfg.every <= steps else None  # nothing to recover from otherwise
        if crash:
            env[FAULT_ENV] = f"kill:step={crash}"
        argv = [sys.executable, "-m", "ckptrun", "run", "--strategy", cfg.method, *cfg.flags, "--dir", ckpt,
                "--every", str(cfg.every), "--max-restarts", "1" if crash else "0",
                "--metrics-dir", str(run_dir / "metrics"), str(work.script), *work.script_args(crash or steps, timing)]
        return Launch(argv, env, crash)
    argv = [sys.executable, str(work.script), *work.script_args(steps, timing)]
    if cfg.kind == "reference":
        argv += ["--ref-save", REFERENCES[cfg.method], "--ref-every", str(steps + 1 if recovery else cfg.every),
                 "--ref-dir", ckpt]
        argv += ["--ref-resume"] if recovery else []
    return Launch(argv, env)
