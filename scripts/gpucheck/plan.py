"""What the check runs, in order: each part's command, environment and time budget.

On a device (the default) the budgets add up to 7 minutes of an H100; `--cpu` runs the same
parts on the CPU with tiny sizes and budgets for a small shared machine (2 loaded cores: a
process start there takes seconds), so the check's own bugs show before a device is lent.
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


BUDGETS = {  # seconds: on the device (7 minutes in all), and with --cpu
    # (the tests first: on an H200 each CUDA test took 10-30 s one at a time, 13 of 16 in 170 s, and
    # each bench configuration 16-48 s, so one call rarely finishes the bench; a second call gives it
    # the rest, README "GPU check")
    "device": (20, 30), "install": (30, 60), "cuda-timed": (40, 60), "cuda-tests": (110, 180),
    "crash-matrix": (130, 1500), "bench-every-10": (70, 900), "bench-every-1": (20, 900)}
PARTS = tuple(BUDGETS)


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


def plan(cpu: bool, out: Path, parts: list[str], budgets: dict[str, int] | None = None) -> list[Part]:
    """The parts named in `parts`, in the check's order; `budgets` replaces some parts' budgets."""
    py, mode = sys.executable, 1 if cpu else 0
    device, model = ("cpu", "tiny") if cpu else ("cuda", "large")
    pytest = (py, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "gpucheck.instafail", "--tb=short",
              "--durations=10")
    timed = ("-m", "cuda and timed", "tests/test_cuda.py")  # alone on the GPU: it reads the device's timeline
    cuda_tests = ("-m", "cuda and not timed", "tests/test_cuda.py")
    matrix = ("tests/test_crash_matrix.py", "tests/test_memory_first.py", "-k",
              "restore_any_step or killed_run_finishes or each_crash_matrix_fault_resumes")
    parallel = ("-n", "4") if has_xdist() else ()
    chosen = [*REFERENCES, *strategies()]  # the references first: a bench cut at its budget still compares
    def bench(every: int, steps: int, warmup: int) -> Part:
        scratch = SCRATCH / f"bench-every-{every}"
        return Part(f"bench-every-{every}",
                    f"ckptrun bench --device {device} --model {model} at --every {every}: none, every strategy, "
                    "torch.save, both DCP modes", BUDGETS[f"bench-every-{every}"][mode],
                    (py, "-m", "ckptrun", "bench", "--device", device, "--model", model, "--strategies",
                     ",".join(["none", *chosen]), "--every", str(every), "--steps", str(steps), "--warmup", str(warmup),
                     "--json", str(out / f"bench-every-{every}.json"), "--dir", str(scratch), "--wide"),
                    configs=("none", *chosen), scratch=scratch)

    every = [
        Part("device", "the device line: name, driver, torch, CUDA", BUDGETS["device"][mode],
             (py, "-c", f"CPU = {cpu}\n{DEVICE_LINE}"), log=SETUP_LOG),
        Part("install", f"pydantic and its needs from {WHEELS.name}/ (no index) into {SITE}, ckptrun from the "
                        "working tree (PYTHONPATH); both imported", BUDGETS["install"][mode],
             (py, "-m", "gpucheck.install", *(["--cpu"] if cpu else [])), log=SETUP_LOG),
        Part("cuda-timed", "the CUDA test that reads the device's timeline (the copy overlapping compute), "
                           "alone on the GPU", BUDGETS["cuda-timed"][mode], (*pytest, *timed), tests=timed),
        Part("cuda-tests", "the other CUDA tests (pytest -m cuda tests/test_cuda.py), four at a time",
             BUDGETS["cuda-tests"][mode], (*pytest, *parallel, *cuda_tests), tests=cuda_tests),
        Part("crash-matrix", f"the crash matrix on {device} for every registered strategy: restore at several "
                             "steps, a worker killed and restarted (and resumed from the engine's memory with "
                             "--persist-every)", BUDGETS["crash-matrix"][mode],
             (*pytest, *parallel, *matrix), env={"CKPTRUN_TEST_DEVICE": device}, tests=matrix),
        # The warm-up covers the first checkpoint (it allocates and page-locks the staging slots, a
        # one-time cost of seconds for 4.3 GB); the timed steps hold a checkpoint of the steady state.
        bench(10, 22, 11),
        bench(1, 6, 2),
    ]
    return [replace(p, budget_s=(budgets or {}).get(p.name, p.budget_s)) for p in every if p.name in parts]
