"""What the check runs: the work of one device session (15 minutes, start-up included, at
most 10 a command) in two calls, each a list of parts with its command, environment and time
budget.

What the last device runs did not pass or measure comes first (LAST_RUN: the tests they passed
and the bench rows they measured; `--last FILE` reads another, e.g. a check's own
`reached.json`). The work, in order: the owed tests (the CUDA tests and the crash matrix on
CUDA that were not passed: failed, not reached or new), the bench rows at --every 10 and then 1
(rows not measured before first; a row is a configuration, measured at steady state: every
timed step after the run's first checkpoint and the slots' set-up), then the tests passed last
time, again. Each call takes the work in that order while its device estimate fits CALL_S (a
bench invocation adds `none`, the denominator of its ratios); what fits neither call is named in
the plan. `--cpu` runs the same plan on the CPU with tiny sizes and budgets for a small shared
machine (2 loaded cores), so the check's own bugs show before a device is lent.
"""

from __future__ import annotations

import shlex
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / ".whl"  # scripts/gpu-wheels fills it; the device call carries it
SITE = Path(tempfile.gettempdir()) / "ckptrun-gpu-check-site"  # where the wheels are installed
REFERENCES = ("torch.save", "dcp-thread", "dcp-process")
SCRATCH = REPO / ".gpu-check-scratch"  # the benches' runs: on the disk the checkout is on (not tmpfs)
SETUP_LOG = "setup.log"  # the device and install parts' output (the other parts have a log each)

DEVICE_LINE = r"""
import platform, subprocess, torch
if torch.cuda.is_available():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.splitlines()[0]
        name, driver = (s.strip() for s in out.split(",", 1))
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        name, driver = torch.cuda.get_device_name(0), "unknown"
    print(f"device: {name} | driver {driver} | torch {torch.__version__} | CUDA {torch.version.cuda}")
else:
    print(f"device: cpu ({platform.machine()}) | torch {torch.__version__} | CUDA none")
    raise SystemExit(0 if CPU else "no CUDA device: scripts/gpu-check --cpu runs the parts on the CPU")
"""


@dataclass(frozen=True)
class Part:
    """One step of the check, run as a subprocess and stopped at `budget_s`."""

    name: str
    what: str  # one line for the plan and the report
    budget_s: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # added to the environment
    log: str = ""  # its output under OUT (default: NAME.log)
    tests: tuple[str, ...] = ()  # pytest parts: the tests it selects (what was not reached is listed from them)
    configs: tuple[str, ...] = ()  # bench parts: its configurations, in run order
    scratch: Path | None = None  # removed once the part ends (a bench stopped at its budget leaves its runs)

    @property
    def log_name(self) -> str:
        return self.log or f"{self.name}.log"

    def shown(self) -> str:
        """The command as a shell line (an inline script named, not shown)."""
        return " ".join([*(f"{k}={v}" for k, v in self.env.items()),
                         *("<the device-line script>" if "\n" in a else shlex.quote(a) for a in self.argv)])


LAST_RUN = Path(__file__).with_name("last-run.json")
CALL_S = (420, 350)  # device seconds of each call: with ~2 minutes of start-up, a 15-minute session
ROW_S = 40  # a bench configuration on the device: start, steady steps of the large model, a kill, recovery
STEADY = {10: (21, 11), 1: (8, 2)}  # --every: (--steps, --warmup): timed steps after the first checkpoint
BUDGETS = {  # seconds of each test part: on the device (each CUDA test took 10-30 s on an H200), and with --cpu
    "device": (20, 30), "install": (30, 60), "owed-cuda": (100, 300), "owed-crash": (100, 900),
    "cuda-timed": (40, 60), "cuda-tests": (110, 180), "crash-matrix": (130, 900)}
ROW_CPU_S = 90  # a bench configuration with --cpu (the tiny model)
PARTS = ("device", "install", "owed-cuda", "owed-crash", "bench-every-10", "bench-every-1", "cuda-timed",
         "cuda-tests", "crash-matrix")


def pythonpath(cpu: bool) -> str:
    """What the parts after the install import from: the wheels' folder (not with --cpu: this
    machine's Python has its own pydantic, and the wheels are for the device's 3.12) and the tree."""
    return ":".join([*([] if cpu else [str(SITE)]), str(REPO)])


def strategies() -> list[str]:
    """Every registered strategy (the registry is torch-free: importable before the install)."""
    sys.path.insert(0, str(REPO))
    from ckptrun.strategies import REGISTRY

    return list(REGISTRY)


def has_xdist() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


def last_run(path: Path) -> dict:
    """What the last device runs passed and measured (LAST_RUN's form)."""
    import json

    doc = json.loads(path.read_text())
    return {"passed": list(doc.get("passed", [])),
            "bench": {int(k): list(v) for k, v in doc.get("bench", {}).items()}}


def rows(every: int, measured: list[str]) -> list[str]:
    """The bench configurations at `every` (`none` aside), those not measured before first; the
    references first within each group (a call cut short still compares)."""
    every_one = [*REFERENCES, *strategies()]
    return [*(c for c in every_one if c not in measured), *(c for c in every_one if c in measured)]


@dataclass
class Schedule:
    calls: list[list[Part]]
    left: list[str]  # what fits in neither call


def schedule(cpu: bool, out: Path, last: Path = LAST_RUN) -> Schedule:
    """The work (module doc) packed into the calls."""
    done = last_run(last)
    py, mode = sys.executable, 1 if cpu else 0
    device, model = ("cpu", "tiny") if cpu else ("cuda", "large")
    pytest = (py, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "gpucheck.instafail", "--tb=short",
              "--durations=10")
    parallel = ("-n", "4") if has_xdist() else ()
    kept = ("-p", "gpucheck.lastrun")
    cuda_tests = (*kept, "-m", "cuda and not timed", "tests/test_cuda.py")
    timed = (*kept, "-m", "cuda and timed", "tests/test_cuda.py")  # alone on the GPU: it reads the device's timeline
    matrix = (*kept, "tests/test_crash_matrix.py", "tests/test_memory_first.py", "-k",
              "restore_any_step or killed_run_finishes or each_crash_matrix_fault_resumes")
    on = {"CKPTRUN_TEST_DEVICE": device, "GPUCHECK_LAST": str(last)}

    def tests(name: str, what: str, selection: tuple[str, ...], keep: str, xdist: bool = True) -> Part:
        return Part(name, what, BUDGETS[name][mode], (*pytest, *(parallel if xdist else ()), *selection),
                    env={**on, "GPUCHECK_KEEP": keep}, tests=selection)

    def bench(every: int, configs: list[str], call: int) -> Part:
        steps, warmup = STEADY[every]
        scratch = SCRATCH / f"bench-every-{every}"
        chosen = ("none", *configs)
        return Part(f"bench-every-{every}",
                    f"ckptrun bench --device {device} --model {model} at --every {every}, steady state (the first "
                    f"{warmup} steps untimed: the first checkpoint and the slots' set-up), stall by cause: "
                    f"{', '.join(chosen)}",
                    len(chosen) * (ROW_CPU_S if cpu else ROW_S),
                    (py, "-m", "ckptrun", "bench", "--device", device, "--model", model, "--strategies",
                     ",".join(chosen), "--every", str(every), "--steps", str(steps), "--warmup", str(warmup),
                     "--json", str(out / f"bench-every-{every}-call{call}.json"), "--dir", str(scratch), "--wide"),
                    configs=chosen, scratch=scratch)

    fixed = [Part("device", "the device line: name, driver, torch, CUDA", BUDGETS["device"][mode],
                  (py, "-c", f"CPU = {cpu}\n{DEVICE_LINE}"), log=SETUP_LOG),
             Part("install", f"pydantic and its needs from {WHEELS.name}/ (no index) into {SITE}, ckptrun from the "
                             "working tree (PYTHONPATH); both imported", BUDGETS["install"][mode],
                  (py, "-m", "gpucheck.install", *(["--cpu"] if cpu else [])), log=SETUP_LOG)]
    work: list[Part | tuple[int, str]] = [
        tests("owed-cuda", "the CUDA tests the last device runs did not pass (failed, not reached, new), four at "
                           "a time", cuda_tests, "owed"),
        tests("owed-crash", f"the crash matrix on {device} where the last device runs did not pass it: restore at "
                            "several steps, a worker killed and restarted (and resumed from the engine's memory "
                            "with --persist-every)", matrix, "owed"),
        *((every, c) for every in STEADY for c in rows(every, done["bench"].get(every, []))),
        tests("cuda-timed", "the CUDA test that reads the device's timeline (the copy overlapping compute), alone "
                            "on the GPU (whatever the record says)", timed, "all", xdist=False),
        tests("cuda-tests", "the CUDA tests the last device runs passed, again", cuda_tests, "passed"),
        tests("crash-matrix", f"the crash matrix on {device} where the last device runs passed it, again", matrix,
              "passed")]
    calls = []
    for call, room in enumerate(CALL_S, 1):
        parts, benches = pack(work, room - sum(BUDGETS[p.name][0] for p in fixed))
        calls.append([*fixed, *(bench(p, benches[p], call) if isinstance(p, int) else p for p in parts)])
    left = [item.name if isinstance(item, Part) else f"bench-every-{item[0]} {item[1]}" for item in work]
    return Schedule(calls, left)


def pack(work: list[Part | tuple[int, str]], room: int) -> tuple[list[Part | int], dict[int, list[str]]]:
    """Take from the front of `work` (test parts; bench rows as (every, configuration)) while its
    device estimate fits `room` seconds: the parts in order, an int where the bench at that
    --every goes (its first row pays for its `none`), and each bench's rows."""
    parts: list[Part | int] = []
    benches: dict[int, list[str]] = {}
    while work:
        item = work[0]
        cost = BUDGETS[item.name][0] if isinstance(item, Part) else ROW_S * (1 + (item[0] not in benches))
        if cost > room:
            break
        room -= cost
        work.pop(0)
        if isinstance(item, Part):
            parts.append(item)
            continue
        if item[0] not in benches:
            parts.append(item[0])
        benches.setdefault(item[0], []).append(item[1])
    return parts, benches


def plan(cpu: bool, out: Path, parts: list[str], budgets: dict[str, int] | None = None, call: int = 1,
         last: Path = LAST_RUN) -> list[Part]:
    """The parts of `call` named in `parts`, in order; `budgets` replaces some parts' budgets."""
    chosen = schedule(cpu, out, last).calls[call - 1]
    return [replace(p, budget_s=(budgets or {}).get(p.name, p.budget_s)) for p in chosen if p.name in parts]
