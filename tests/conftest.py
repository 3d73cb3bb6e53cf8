"""Shared helpers for the foundation tests: ckptrun and scripts as subprocesses with a timeout,
bit-for-bit comparison of nested states, and ground-truth runs shared across test modules.

The ground truth of "the state after step N" is always a script's own `torch.save` after step
N in an uninterrupted run; what ckptrun restores or resumes must equal it bit for bit.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import runpy
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from filelock import FileLock

from ckptrun.log import log
from ckptrun.storage import rankfile
from ckptrun.storage.layout import Layout, TensorSpec, view
from ckptrun.storage.store import MANIFEST, Store, full_name, rank_files
from ckptrun.storage.tree import flatten, unflatten
from ckptrun.strategies import REGISTRY

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_gpt.py"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
STRATEGIES = list(REGISTRY)  # the crash matrix covers every registered strategy
STEPS = 12
# Where the example trains in the end-to-end tests: cpu, or cuda (scripts/gpu-check's crash matrix
# on a GPU: the truth and the ckptrun runs on the same device type, with deterministic kernels).
DEVICE = os.environ.get("CKPTRUN_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"CKPTRUN_TEST_DEVICE must be cpu or cuda (got {DEVICE!r})")
# The tiny example run every test shares: one thread so that results never depend on load.
TINY = ["--layers", "1", "--d-model", "32", "--steps", str(STEPS), "--threads", "1",
        *(["--device", "cuda", "--deterministic"] if DEVICE == "cuda" else [])]
LONG = [a if a != str(STEPS) else "100000" for a in TINY]  # the example, running until stopped
TIMEOUT_S = 240
# The DDP runs several modules share: dp_mlp.py (a replicated MLP, a per-rank parameter and
# Generator) for DDP_STEPS steps, each rank saving its own state at the end.
DP_MLP = SCRIPTS / "dp_mlp.py"
DDP_STEPS = 8


def clean_env(fault: str | None) -> dict[str, str]:
    """The test process's environment without ckptrun's own variables, plus a fault if asked.
    CKPTRUN_IO_ENGINE and CKPTRUN_STAGING_DIR stay: machine settings (the engines' file writer,
    where staging files live) for a whole test run, or for one test that sets them."""
    kept = ("CKPTRUN_IO_ENGINE", "CKPTRUN_STAGING_DIR")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTRUN_") or k in kept}
    # The suite's runs check mechanisms at the interval they ask for (every step unless told): the
    # overhead budget, which thins checkpoints that cost more than 5% of a tiny example's step, is
    # off unless a test gives --max-overhead (tests/test_budget.py).
    env["CKPTRUN_MAX_OVERHEAD"] = "off"
    if fault:
        env["CKPTRUN_FAULT"] = fault
    return env


def run_cmd(argv: list[Any], cwd: Path, *, fault: str | None = None,
            timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=clean_env(fault), capture_output=True, text=True,
                          timeout=timeout)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="also run the opt-in tests (marked `full`, deselected by default): the registry-wide "
                          "repeats of slow end-to-end modes (frameworks, kill loop, two nodes, ...) for every "
                          "strategy, not only a representative few (README, Testing)")
    parser.addoption("--soak", type=int, default=0, metavar="N",
                     help="test_kill_loop: N whole-tree kills per strategy instead of 2, for every strategy "
                          "(long soak mode)")
    parser.addoption("--kill-seed", type=int, default=None, metavar="S",
                     help="test_kill_loop: seed of the random kill delays (default: a new one, printed on failure)")


# ---- opt-in tests: one marker, one option ---------------------------------------------------
# A test (or one parametrisation of it) marked `full` repeats a slow end-to-end mode that the
# default run already covers for a representative subset; it is deselected unless --full is
# given, and the run's summary counts it as deselected and says how to include it.
FULL = pytest.mark.full


def full(config: pytest.Config) -> bool:
    return bool(config.getoption("--full"))


# One strategy of each family, for the registry-wide repeats of slow modes whose full run is
# opt-in: the default (a full snapshot in a staging slot, record folders), a differential one that
# restores by replaying the optimizer, and one writing a preallocated region.
REPRESENTATIVES = ("checkfreq", "lowdiff", "lightcheck")


def strategy_params(default: Iterable[str]) -> list[Any]:
    """Every registered strategy as a parametrisation, those outside `default` marked `full`
    (opt-in). `default` must name registered strategies."""
    default = set(default)
    assert default <= set(REGISTRY), f"not registered: {sorted(default - set(REGISTRY))}"
    return [pytest.param(s, marks=() if s in default else FULL) for s in REGISTRY]


def selected_strategies(config: pytest.Config, default: Iterable[str]) -> list[str]:
    """The strategies `strategy_params(default)` runs in this session (registry order): what a
    module-scoped fixture shared by such tests needs to prepare."""
    default = set(default)
    return [s for s in REGISTRY if full(config) or s in default]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "full: opt-in (a slow mode's registry-wide repeat); run only under --full")
    config.addinivalue_line("markers", "cuda: exercises a CUDA path (pytest -m cuda; skipped, saying so, without "
                                       "a GPU); scripts/gpu-check runs them on a device")
    config.addinivalue_line("markers", "timed: reads the device's own timeline, so it runs alone on the GPU "
                                       "(scripts/gpu-check runs the other CUDA tests four at a time)")
    # pytest-xdist hands out files by their number of tests unless told not to: keep the order
    # of the collection (LONGEST_FIRST).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# The test files whose runs take longest, longest first (seconds on 2 cores, measured): with
# `--dist loadfile` a file is one unit, handed to whichever xdist worker is free, so a long file
# handed out last keeps one worker busy while the other idles. Collected first, and handed out
# in collection order (`pytest_configure`), they leave the short files to even the end out
# (longest processing time first). A stale list costs balance, never a result.
LONGEST_FIRST = ("test_crash_matrix.py", "test_trust.py", "test_two_nodes.py", "test_durable.py",
                 "test_optimizers.py", "test_lowdiff.py", "test_writeonce.py", "test_lowdiff_plus.py",
                 "test_sharded.py", "test_scripts.py", "test_hf_trainer.py", "test_kill_loop.py",
                 "test_memory_first.py", "test_bench.py", "test_tune.py", "test_gockpt.py", "test_host_memory.py",
                 "test_untrusted_dir.py", "test_accelerate.py", "test_lightning.py", "test_goodput.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order kept
    if full(config):
        return
    opt_in = [item for item in items if item.get_closest_marker("full")]
    if opt_in:
        config.hook.pytest_deselected(items=opt_in)
        items[:] = [item for item in items if not item.get_closest_marker("full")]
        config.stash[_OPT_IN] = len(opt_in)
        if hasattr(config, "workeroutput"):  # a pytest-xdist worker: its controller prints the count
            config.workeroutput["opt_in"] = len(opt_in)


_OPT_IN = pytest.StashKey[int]()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist's controller collects nothing itself: the count comes from its workers (each
    collected every test)."""
    count = getattr(node, "workeroutput", {}).get("opt_in")
    if count:
        node.config.stash[_OPT_IN] = count


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if config.stash.get(_OPT_IN, 0):
        terminalreporter.write_line(f"{config.stash[_OPT_IN]} opt-in tests deselected (marked `full`): "
                                    "python -m pytest --full runs them too")


def spawn(cwd: Path, *args: Any, log: str = "ckptrun.log", fault: str | None = None) -> subprocess.Popen:
    """`python -m ckptrun ARGS` in the background, in a session of its own so that the test can kill
    its whole tree; stdout and stderr go to `cwd/log`."""
    with open(cwd / log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "ckptrun", *map(str, args)], cwd=cwd, env=clean_env(fault),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it at one moment, as a node failure does. The
    launcher's process group is not the whole tree: torch elastic starts each worker in a session of
    its own. The group is stopped first so that nothing in it starts another process meanwhile."""
    try:
        os.killpg(pid, signal.SIGSTOP)
        tree = psutil.Process(pid).children(recursive=True)
    except (ProcessLookupError, psutil.NoSuchProcess):
        return
    for group in {pid, *(p.pid for p in tree)}:  # a worker leads its own group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def ckptrun(cwd: Path, *args: Any, fault: str | None = None) -> subprocess.CompletedProcess:
    """`python -m ckptrun ARGS` in `cwd`; the caller checks the outcome."""
    return run_cmd([sys.executable, "-m", "ckptrun", *args], cwd, fault=fault)


def cli(cwd: Path, *argv: Any) -> subprocess.CompletedProcess:
    """`ckptrun ARGV` through the CLI's entry point in this process (a subprocess per call costs
    seconds of imports), for the commands that only read a directory (ls, verify, restore); exit
    code, stdout and stderr as a subprocess's (an uncaught exception fails the test instead of
    printing a traceback). tests/test_cli_errors.py checks the errors of a real subprocess."""
    from ckptrun import cli as entry

    args = [str(a) for a in argv]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), contextlib.chdir(cwd):
        code = entry.main(args)
    return subprocess.CompletedProcess(["ckptrun", *args], code, stdout.getvalue(), stderr.getvalue())


def verify(cwd: Path, ckpt_dir: Path | str, *extra: Any) -> subprocess.CompletedProcess:
    """`ckptrun verify --dir CKPT_DIR EXTRA`, in this process (`cli`)."""
    return cli(cwd, "verify", "--dir", ckpt_dir, *extra)


def subclassed_optimizer_script(tmp_path: Path) -> Path:
    """A script whose optimizer is a subclass of SGD (torch.optim's own step, another class)."""
    script = tmp_path / "custom.py"
    script.write_text("import torch\n"
                      "class Mine(torch.optim.SGD):\n    pass\n"
                      "p = torch.nn.Parameter(torch.ones(2))\n"
                      "Mine([p], lr=0.1)\n")
    return script


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def python(cwd: Path, script: Path, *args: Any) -> subprocess.CompletedProcess:
    """Run a script with plain python (no ckptrun): the uninterrupted ground truth."""
    return ok(run_cmd([sys.executable, script, *args], cwd))


def run_in_process(cwd: Path, script: Path, *args: Any) -> None:
    """`python(cwd, script, *args)` inside the test process: the same ground truth without a torch
    import per run (~1 s of CPU instead of ~5 on 2 cores). For a script that starts no process,
    from the test's main thread (it changes directory)."""
    argv, threads = sys.argv, torch.get_num_threads()
    env = {k: os.environ.pop(k) for k in [k for k in os.environ if k.startswith("CKPTRUN_")]}
    sys.argv = [str(script), *map(str, args)]
    try:
        with contextlib.chdir(cwd):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        assert e.code in (None, 0), f"{script.name} exited with {e.code}"
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
        os.environ.update(env)


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The CLI's one-line error: a failing exit, no traceback, the last stderr line says it all."""
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("ckptrun: error: "), proc.stderr
    return lines[-1]


def resumed_beside_plain(tmp_path: Path, script: Path, args: list[Any], flags: list[Any],
                         fault: str) -> tuple[Path, Path]:
    """`script ARGS truth.pt` as plain python in tmp_path/plain (in process), and `ckptrun FLAGS
    script ARGS resumed.pt` in tmp_path/ckptrun, killed by `fault` and restarted once; checks that
    both succeeded and the fault fired. Returns the two folders."""
    plain, managed = tmp_path / "plain", tmp_path / "ckptrun"
    plain.mkdir()
    managed.mkdir()
    run_in_process(plain, script, *args, "truth.pt")
    ok(ckptrun(managed, *flags, "--max-restarts", "1", "--metrics-dir", "metrics", script, *args, "resumed.pt",
               fault=fault))
    assert [e["restart_count"] for e in run_events(managed / "metrics")] == [0, 1], "the fault did not fire"
    return plain, managed


@contextlib.contextmanager
def logged() -> Iterator[list[str]]:
    """The lines ckptrun's logger says inside the block (the logger does not propagate)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(f"ckptrun: {record.getMessage()}")
    log.addHandler(handler)
    try:
        yield lines
    finally:
        log.removeHandler(handler)


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def restore(cwd: Path, ckpt_dir: Path, step: int | str, rank: int = 0) -> tuple[dict, str]:
    """`ckptrun restore` of one step into a file, in this process (`cli`); returns (the loaded
    state, stderr)."""
    out = cwd / f"restored-{step}-{rank}.pt"
    proc = cli(cwd, "restore", "--dir", ckpt_dir, "--step", step, "--rank", rank, "--out", out)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return load(out), proc.stderr


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """Equal structure (dict key order included), equal types (any dict counts as a dict: an
    OrderedDict state_dict comes back as a plain one), equal scalars, bit-identical tensors."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), \
            f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        assert torch.equal(_bits(a), _bits(b)), f"{path}: tensor values differ"
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert a.tobytes() == b.tobytes(), f"{path}: array values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), f"{path}: nan != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so that -0.0 != 0.0 and nan == nan (bit for bit)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def pack(state: Any) -> tuple[Any, bytes, dict[str, dict]]:
    """(skeleton, data, specs): a nested state laid out as ckptrun writes it (raw aligned bytes)."""
    skeleton, tensors = flatten(state)
    layout = Layout.of(tensors)
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    with torch.no_grad():
        for spec in layout.specs:
            view(buf, spec).copy_(tensors[spec.key])
    return skeleton, buf.numpy().tobytes(), {spec.key: spec.to_json() for spec in layout.specs}


def unpack(skeleton: Any, data: bytes, specs: dict[str, dict]) -> Any:
    """Inverse of `pack`, reading tensors back from the raw bytes."""
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return unflatten(skeleton, {k: view(buf, TensorSpec.from_json(k, s)) for k, s in specs.items()})


def assert_ddp_ranks_resume_from_memory(cwd: Path, flags: list[Any]) -> None:
    """Two DDP ranks with `flags` (a strategy that holds every step in its engine's memory), run
    uninterrupted and with rank 1 killed at step 5: both engines hold step 4, both ranks resume
    from memory there and end as the uninterrupted run does."""
    common = ["--nproc-per-node", "2", *flags, "--max-restarts", "1"]
    script = [EXAMPLE, *TINY, "--save-at", STEPS, "--save-path", "own-{rank}.pt"]
    for run in ("plain", "killed"):
        (cwd / run).mkdir()
    ok(ckptrun(cwd / "plain", *common, "--dir", "ckpts", *script))
    proc = ok(ckptrun(cwd / "killed", *common, "--dir", "ckpts", "--metrics-dir", "metrics", *script,
                      fault="kill:step=5:rank=1"))
    for rank in range(2):
        attempts = run_events(cwd / "killed" / "metrics", rank)
        assert [(e["restart_count"], e["resume_step"]) for e in attempts] == [(0, 0), (1, 4)], rank
        assert f"rank {rank}: resumed step 4 from the checkpoint engine's memory" in proc.stderr
        assert_training_state(load(cwd / "killed" / f"own-{rank}.pt"), load(cwd / "plain" / f"own-{rank}.pt"))


def assert_training_state(state: dict, truth: dict) -> None:
    """A restored or resumed state equals a script's own save: model and optimizer, bit for bit."""
    for key in truth:
        assert_same(state[key], truth[key], key)


def run_events(metrics_dir: Path, rank: int = 0) -> list[dict]:
    """The `run` events of one rank's worker attempts (one per start)."""
    lines = (metrics_dir / f"worker-{rank}.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("type") == "run"]


def copy_dir(src: Path, dst: Path, *, up_to: int | None = None) -> Path:
    """A private copy of a checkpoint dir, optionally without the records after step `up_to`
    (region slots of later steps are emptied, as if never written)."""
    shutil.copytree(src, dst)
    if up_to is not None:
        store = Store(dst)
        for m in store.manifests(warn=False):
            if m.step > up_to and m.layout == "region":
                for rank in range(m.world_size):
                    copy = store.regions.copy(m, rank)
                    _patch(dst / copy.file, copy.meta_offset, bytes(16))
            elif m.step > up_to:
                shutil.rmtree(dst / m.name)
    return dst


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def _region_copy(ckpt_dir: Path, record: int | str, rank: int = 0):
    """Where `record` lies in the region files, if it is a region step (else None)."""
    name = full_name(record) if isinstance(record, int) else record
    store = Store(ckpt_dir)
    m = next((m for m in store.manifests(warn=False) if m.name == name and m.layout == "region"), None)
    return None if m is None else store.regions.copy(m, rank)


def record_dir(ckpt_dir: Path, record: int | str) -> Path:
    """A record's folder: by name, or by step for a full checkpoint."""
    return ckpt_dir / (full_name(record) if isinstance(record, int) else record)


def data_file(ckpt_dir: Path, record: int | str, rank: int = 0) -> Path:
    """The file holding a rank's tensors: its data file, or its self-describing rank file."""
    own = record_dir(ckpt_dir, record) / rankfile.file_name(rank)
    return own if own.exists() else record_dir(ckpt_dir, record) / rank_files(rank)[0]


def flip_tensor_byte(ckpt_dir: Path, record: int | str, rank: int = 0) -> str:
    """Flip one bit inside the first tensor's bytes (not padding) of a record; returns its key."""
    region = _region_copy(ckpt_dir, record, rank)
    if region is not None:
        index = json.loads(region.index_raw)
        key, spec = next((k, s) for k, s in index["tensors"].items() if s["nbytes"] > 0)
        _flip(ckpt_dir / region.file, region.data_offset + spec["offset"] + spec["nbytes"] // 2)
        return key
    name = full_name(record) if isinstance(record, int) else record
    index = Store(ckpt_dir).read_index(name, rank)
    key, spec = next((k, s) for k, s in index["tensors"].items() if s["nbytes"] > 0)
    path = data_file(ckpt_dir, record, rank)
    raw = bytearray(path.read_bytes())
    raw[spec["offset"] + spec["nbytes"] // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    return key


def tear(ckpt_dir: Path, record: int | str, how: str) -> None:
    """Damage a record: no manifest (a crash mid-commit), a short data file, or a manifest whose
    bytes no longer match its checksum. In a region slot: its metadata gone (a crash before it
    was durable), the second half of its data zeroed (a torn data write), or a metadata byte flipped."""
    region = _region_copy(ckpt_dir, record)
    if region is not None:
        if how == "no-manifest":
            _patch(ckpt_dir / region.file, region.meta_offset, bytes(16))
        elif how == "truncated":
            half = region.data_nbytes // 2
            _patch(ckpt_dir / region.file, region.data_offset + half, bytes(region.data_nbytes - half))
        elif how == "bad-manifest":
            _flip(ckpt_dir / region.file, region.meta_offset + 40)
        else:
            raise ValueError(how)
        return
    if how == "no-manifest":
        (record_dir(ckpt_dir, record) / MANIFEST).unlink()
    elif how == "truncated":
        path = data_file(ckpt_dir, record)
        os.truncate(path, path.stat().st_size // 2)
    elif how == "bad-manifest":
        path = record_dir(ckpt_dir, record) / MANIFEST
        body = json.loads(path.read_text())
        path.write_text(json.dumps({**body, "kind": "x" + body["kind"]}))
    else:
        raise ValueError(how)


def session_folder(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Any]) -> Path:
    """The folder `name` that `make` fills once per test session: the pytest-xdist workers share
    it (the first to ask makes it while the others wait, then all read it), so a run that test
    files on both workers need is made once. Read-only once made."""
    base = factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "session"
    root.mkdir(exist_ok=True)
    path, done = root / name, root / f"{name}.done"
    with FileLock(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)  # a failed attempt's
            path.mkdir()
            make(path)
            done.touch()
    return path


def session_cache(factory: pytest.TempPathFactory, prefix: str, make: Callable[[Path, Any], Any]) -> Callable:
    """`get(key)`: the session folder `prefix-key`, made by `make(folder, key)` (memoized)."""
    cache: dict = {}

    def get(key: Any) -> Path:
        if key not in cache:
            name = "-".join(map(str, (prefix, *(key if isinstance(key, tuple) else (key,)))))
            cache[key] = session_folder(factory, name, lambda cwd: make(cwd, key))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def example_truth(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], dict]:
    """The example's own saves after step N of an uninterrupted plain-python run (one run saving
    every step, on first use; cached)."""
    root = session_folder(tmp_path_factory, "truth", lambda cwd: run_in_process(
        cwd, EXAMPLE, *TINY, "--save-every", 1, "--save-path", cwd / "truth-{step}.pt"))
    cache: dict[int, dict] = {}

    def get(step: int) -> dict:
        if step not in cache:
            cache[step] = load(root / f"truth-{step}.pt")
        return cache[step]

    return get


@pytest.fixture(scope="session")
def long_truth(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], dict]:
    """The state after step N of the example run with LONG arguments (its LR schedule spans
    100000 steps), from a plain-python run that stops there (cached)."""
    folder = session_cache(tmp_path_factory, "long-truth", lambda cwd, step: run_in_process(
        cwd, EXAMPLE, *LONG, "--stop-after", step, "--save-at", step, "--save-path", cwd / "truth.pt"))
    return lambda step: load(folder(step) / "truth.pt")


def example_run_argv(strategy: str, ckpt_dir: Path | str) -> list[Any]:
    """The command of `example_run`: the example under `strategy` with its short-run flags,
    keeping every step in `ckpt_dir` (its metrics beside it, in `metrics`)."""
    return ["--strategy", strategy, *REGISTRY[strategy].short_run_flags, "--dir", ckpt_dir, "--keep", "0",
            "--metrics-dir", Path(ckpt_dir).parent / "metrics", EXAMPLE, *TINY]


@pytest.fixture(scope="session")
def example_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Checkpoint dir of an uninterrupted ckptrun run of the example keeping every step, its
    metrics in `../metrics` (cached; read-only: copy it with `copy_dir` before changing anything)."""
    folder = session_cache(tmp_path_factory, "run", lambda cwd, strategy: ok(
        ckptrun(cwd, *example_run_argv(strategy, "ckpts"))))
    return lambda strategy: folder(strategy) / "ckpts"


@pytest.fixture(scope="session")
def ddp_truth(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """The folder of an uninterrupted DDP run of dp_mlp.py on `ranks` ranks without ckptrun
    (plain torchrun), holding each rank's own save own-{rank}-{DDP_STEPS}.pt (cached)."""
    return session_cache(tmp_path_factory, "ddp-truth", lambda cwd, ranks: ok(run_cmd(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", ranks, DP_MLP, "--wrap", "ddp",
         "--steps", DDP_STEPS, "--save-at", DDP_STEPS], cwd)))


@pytest.fixture(scope="session")
def ddp_killed_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], Path]:
    """The folder (ckpts, metrics, each rank's own save) of a ckptrun DDP run of dp_mlp.py whose
    rank 1 is killed mid-step 5 and restarted once, by (strategy, ranks): one run that the crash
    matrix's DDP tests and the write-once tests share (cached; read-only)."""
    get = session_cache(tmp_path_factory, "ddp-killed", lambda cwd, key: ok(ckptrun(
        cwd, "--nproc-per-node", key[1], "--max-restarts", "1", "--strategy", key[0],
        *REGISTRY[key[0]].short_run_flags, "--dir", "ckpts", "--metrics-dir", "metrics", DP_MLP, "--wrap", "ddp",
        "--steps", DDP_STEPS, "--save-at", DDP_STEPS, fault="kill:step=5:rank=1")))
    return lambda strategy, ranks: get((strategy, ranks))
