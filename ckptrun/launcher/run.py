"""The run command: start one engine per local rank, then the workers through torchrun's
elastic agent (rendezvous, restarts), and report failures as one line."""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass
from multiprocessing.connection import Client
from pathlib import Path

from ..config import ENV, RunConfig, is_torchrun_var
from ..errors import CkptrunError, UsageError
from ..ipc.messages import Shutdown
from ..ipc.staging import shm_root
from ..log import configure as configure_log
from ..log import log
from ..memory_budget import Budget
from ..storage.dirlock import DirLock, lock_name
from ..storage.leftovers import new_tag, remove_staging, run_name, sweep_stale
from ..storage.store import Store
from . import replicas


@dataclass
class LaunchOptions:
    """torchrun's launch options, same names and meaning."""

    nproc_per_node: str = "1"
    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None
    local_addr: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    standalone: bool = False
    term_timeout: float = 30.0  # seconds from SIGTERM/SIGINT to exit (ckptrun's own, not torchrun's)

    def torchrun_argv(self) -> list[str]:
        argv = ["--nproc-per-node", self.nproc_per_node, "--nnodes", self.nnodes,
                "--max-restarts", str(self.max_restarts), "--monitor-interval", "0.1"]
        for flag, value in (("--node-rank", self.node_rank), ("--rdzv-backend", self.rdzv_backend),
                            ("--rdzv-endpoint", self.rdzv_endpoint), ("--rdzv-id", self.rdzv_id),
                            ("--rdzv-conf", self.rdzv_conf), ("--local-addr", self.local_addr),
                            ("--master-addr", self.master_addr), ("--master-port", self.master_port)):
            if value is not None:
                argv += [flag, str(value)]
        if self.standalone or self._one_node_unaddressed():
            argv.append("--standalone")
        return argv

    def _one_node_unaddressed(self) -> bool:
        """One node and no rendezvous or port named: torch 2.13's torchrun then takes a free port
        itself (a standalone rendezvous), torch 2.11's binds 29500, so that a second job on the
        machine failed with EADDRINUSE. Asked for here, alike on both."""
        return (self.nnodes.split(":")[-1] == "1" and self.rdzv_backend is None and self.rdzv_endpoint is None
                and self.master_port is None)


def shutdown_timeout_flag(seconds: int) -> list[str]:
    """torchrun's --shutdown-timeout (how long the agent waits after forwarding SIGTERM before it
    kills the workers), where this torch's torchrun has it: torch 2.11's does not, and its agent
    then waits its own fixed 30 s."""
    from torch.distributed.run import get_args_parser

    flag = "--shutdown-timeout"
    return [flag, str(seconds)] if flag in get_args_parser().format_help() else []


def torchrun_namespace(argv: list[str], script: str, script_args: list[str]) -> argparse.Namespace:
    """torchrun's parsed arguments for the launcher's `argv`, the worker's entry and its SCRIPT
    ARGS. The script's part is set after parsing, never parsed: torchrun's parser abbreviates and
    reads every word, so a script's own `--log out.txt` stopped the run as an ambiguous --log-dir."""
    from torch.distributed.run import parse_args

    args = parse_args([*argv, "-m", "ckptrun.worker.bootstrap"])
    args.training_script_args = [script, *script_args]
    return args


def engine_imports(cfg: RunConfig) -> tuple[str, ...]:
    """The modules each engine will import once its worker says hello: its strategy's handler,
    and torch.distributed with --replicas or --node-local-dir (the round's job store and gloo)."""
    from ..strategies import REGISTRY

    handler = REGISTRY[cfg.strategy].engine_handler
    return (*([handler.partition(":")[0]] if handler else []),
            *(["torch.distributed"] if cfg.replicas > 1 or cfg.node_local_dir else []))


class EngineSupervisor:
    """Runs the engines (spawn), restarts one that dies, and shuts them down after a flush."""

    def __init__(self, cfg: RunConfig, nlocal: int, tag: str, engines_lock: str) -> None:
        self.cfg, self.nlocal, self.tag, self.engines_lock = cfg, nlocal, tag, engines_lock
        self.ctx = mp.get_context("spawn")
        self.preload = engine_imports(cfg)
        self.procs: list = [None] * nlocal
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="ckptrun-engines", daemon=True)

    def _start(self, local_rank: int) -> None:
        from ..engine.server import main as engine_main

        address = self.cfg.engine_address(local_rank)
        if not address.startswith("\0"):  # a dead engine's abstract name went with its socket
            Path(address).unlink(missing_ok=True)
        # The kernel's parent-death signal only for engines started from the main thread: it fires
        # when the starting thread ends, and a restart comes from the monitor thread.
        p = self.ctx.Process(target=engine_main, name=f"ckptrun-engine-{local_rank}",
                             args=(address, bytes.fromhex(self.cfg.authkey), local_rank, self.tag,
                                   self.cfg.metrics_dir, self.engines_lock, os.getpid(),
                                   threading.current_thread() is threading.main_thread(), self.preload))
        p.start()
        self.procs[local_rank] = p

    def start(self) -> None:
        for r in range(self.nlocal):
            self._start(r)
        self._monitor.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for r, p in enumerate(self.procs):
                if p is not None and not p.is_alive() and not self._stop.is_set():
                    log.warning(f"checkpoint engine of local rank {r} died (exit code {p.exitcode}); "
                                "restarting it")
                    self._start(r)

    def shutdown(self, timeout: float = 600.0) -> None:
        self._stop.set()
        for r, p in enumerate(self.procs):
            if p is None or not p.is_alive():
                continue
            try:
                with Client(self.cfg.engine_address(r), family="AF_UNIX",
                            authkey=bytes.fromhex(self.cfg.authkey)) as c:
                    c.send(Shutdown())
            except OSError:
                p.terminate()
        for p in self.procs:
            if p is not None:
                p.join(timeout)
                if p.is_alive():
                    p.kill()
        remove_staging(self.tag)


def preflight(cfg: RunConfig, script: str, *, per_host_lock: bool = False) -> DirLock:
    """Every check that can fail before anything starts; returns the directory's lock, held."""
    from ..strategies import REGISTRY
    from . import durable

    if cfg.strategy not in REGISTRY:
        raise UsageError(f"unknown strategy {cfg.strategy!r}; choose one of: {', '.join(REGISTRY)}")
    if not Path(script).is_file():
        raise UsageError(f"script {script!r} not found; give the path of a Python training script")
    if cfg.every < 1:
        raise UsageError(f"--every must be at least 1 (got {cfg.every})")
    if cfg.keep < 0:
        raise UsageError(f"--keep must be 0 (keep all) or more (got {cfg.keep})")
    if cfg.max_inflight < 1:
        raise UsageError(f"--max-inflight must be at least 1 (got {cfg.max_inflight})")
    if cfg.on_save_error not in ("warn", "fail"):
        raise UsageError(f"--on-save-error must be warn or fail (got {cfg.on_save_error!r})")
    if cfg.on_restart not in ("resume", "fresh", "fail"):
        raise UsageError(f"--on-restart must be resume, fresh or fail (got {cfg.on_restart!r})")
    store = Store(cfg.dir)
    store.ensure_writable()
    lock = DirLock(store.root, lock_name(per_host_lock)).acquire()
    try:
        if not cfg.resume and store.manifests(warn=False):
            raise UsageError(f"--no-resume, but {cfg.dir} already holds committed steps; "
                             "pass another --dir or remove the old checkpoints")
        durable.prepare(cfg, store)
    except BaseException:
        lock.release()
        raise
    if lock.taken_over:
        log.info(f"took over {lock.path} from a run that ended without releasing it ({lock.taken_over})")
    return lock


@dataclass
class OutputOptions:
    """What the launcher shows: `dashboard`: a live panel on a terminal (`wide`: every column),
    else (or off a terminal) a log line every `log_interval` seconds (logging, logger `ckptrun`);
    `quiet`: errors only, no panel, no summary."""

    dashboard: bool = True
    wide: bool = False
    log_interval: float = 5.0
    quiet: bool = False


def run(cfg: RunConfig, opts: LaunchOptions, script: str, script_args: list[str], *,
        output: OutputOptions | None = None, metrics_file: str | None = None) -> int:
    """Launch and supervise a training run; returns the exit code. The directory is locked for
    the whole run (engines included)."""
    output = output or OutputOptions()
    if not cfg.dist_env:
        _one_process(opts)
    replicas.check(cfg, opts.nnodes)
    shm_root()  # a CKPTRUN_STAGING_DIR that cannot hold staging files stops the run before it writes
    lock = preflight(cfg, script, per_host_lock=opts.nnodes != "1")
    try:
        return _launch(cfg, opts, script, script_args, lock, output, metrics_file)
    finally:
        lock.release()


def _one_process(opts: LaunchOptions) -> None:
    """--no-dist-env hides from the script what several processes would need to find each other."""
    for flag, value in (("--nproc-per-node", opts.nproc_per_node), ("--nnodes", opts.nnodes)):
        if any(n.strip() != "1" for n in value.split(":")):
            raise UsageError(f"--no-dist-env runs one process on one node; drop {flag} {value}, or drop "
                             "--no-dist-env to give the script torchrun's environment")


def _adapt_torch_elastic() -> None:
    """What ckptrun changes of torch elastic's agent, once per launcher (each install says why)."""
    from .rdzv_exit import install as quiet_clean_finish
    from .rdzv_names import install as cheap_rdzv_names
    from .worker_groups import install as end_dead_workers_groups

    cheap_rdzv_names()
    quiet_clean_finish()
    end_dead_workers_groups()
    # The agent's own warnings on a signal ("Received 15 death signal", "Sending process ... closing
    # signal") restate what ckptrun reports in one line.
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _launch(cfg: RunConfig, opts: LaunchOptions, script: str, script_args: list[str], lock: DirLock,
            output: OutputOptions, metrics_file: str | None) -> int:
    import torch.distributed.run as torchrun
    from rich.console import Console
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .console.dashboard import Dashboard
    from .console.hostmetrics import HostSampler
    from .console.worker_logs import WorkerLogTailer, torchrun_args

    _adapt_torch_elastic()
    nlocal = torchrun.determine_local_world_size(opts.nproc_per_node)
    if cfg.host_memory_node:
        cfg.host_memory, cfg.host_memory_nlocal = cfg.host_memory_node // nlocal, nlocal
        log.info(Budget(cfg.host_memory, node=cfg.host_memory_node, nlocal=nlocal,
                        source=cfg.host_memory_source).start_line())
    swept = sweep_stale()
    if swept.owners:
        log.info(str(swept))
    tag = new_tag()
    engine_dir = tempfile.mkdtemp(prefix=run_name(tag, ""))
    cfg.dir = str(Path(cfg.dir).resolve())
    cfg.engine_dir, cfg.authkey = engine_dir, os.urandom(16).hex()
    cfg.metrics_dir = cfg.metrics_dir or os.path.join(engine_dir, "metrics")
    if not cfg.dist_env:  # before torchrun adds its own to this process's environment
        cfg.launcher_env = {k: v for k, v in os.environ.items() if is_torchrun_var(k)}
    os.environ[ENV] = cfg.to_env()
    if opts.nnodes != "1":
        # torch 2.13's shared rendezvous store cannot take a replaced node: rank 0's agent publishes
        # the workers' MASTER_ADDR/PORT in the first round only, and a node joining a later round
        # waits for them until the join times out. Every round then gets a store of its own, hosted
        # by worker rank 0 (ckptrun.worker.jobstore).
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    console = Console()
    live = output.dashboard and not output.quiet and console.is_terminal
    configure_log(fresh_lines=not live)
    # On SIGTERM/SIGINT the elastic agent forwards the signal and gives the workers this long to
    # hand over their newest finished step; the engines then get the rest of the grace period.
    worker_grace = max(1, int(opts.term_timeout * 2 / 3))
    # The agent's folder (error files; the workers' output when live) in the run's own temporary
    # folder, removed with it: left to torch, every run left a torchelastic_* folder in /tmp.
    log_dir = os.path.join(engine_dir, "logs")
    argv = [*opts.torchrun_argv(), *shutdown_timeout_flag(worker_grace), "--log-dir", log_dir]
    logs = None
    if live:  # workers write to files that are echoed above the panel
        argv += torchrun_args()
        logs = WorkerLogTailer(log_dir, console)
        logs.start()
    dash = Dashboard(cfg.metrics_dir, metrics_file, live=live, console=console, sampler=HostSampler() if live else None,
                     top=logs.open_lines if logs else None, wide=output.wide, log_interval=output.log_interval)
    dash.start()
    engines = EngineSupervisor(cfg, nlocal, tag, str(lock.engines_path))
    engines.start()
    stopped_by: int | None = None
    try:
        # torchrun's own entry: it picks a free local port on one node, as `torchrun` does.
        torchrun.run(torchrun_namespace(argv, script, script_args))
        return 0
    except SignalException as e:
        stopped_by = int(e.sigval)
        return 128 + stopped_by
    except ChildFailedError as e:
        raise _failure(e, engine_dir, opts) from None
    finally:
        engines.shutdown(timeout=max(1.0, opts.term_timeout - worker_grace) if stopped_by else 600.0)
        if logs is not None:
            logs.stop()
        dash.stop()
        shutil.rmtree(engine_dir, ignore_errors=True)
        if opts.nnodes == "1":  # every writer of this directory has stopped: no record is on its way
            Store(cfg.dir, claim=lock.claim).sweep_incomplete()  # (never another run's directory)
        if stopped_by is not None:
            log.info(f"stopped by {signal.Signals(stopped_by).name}; {_committed_line(cfg.dir)}")


def _failure(e: Exception, engine_dir: str, opts: LaunchOptions) -> CkptrunError:
    """The one line (and exit code) for a run whose workers failed for good: the script's own
    exit code when it chose to exit, the crash otherwise."""
    errors = {int(p.stem.removeprefix("error-")): p.read_text().split("\n", 1)
              for p in Path(engine_dir).glob("error-*.txt")}
    if errors:  # the lowest rank's is the run's; the workers print none, so other ranks' are said here
        code, message = errors[min(errors)]
        for rank, (_, other) in sorted(errors.items()):
            if other.strip() != message.strip():
                log.info(f"rank {rank}: {other.strip()}")
        return CkptrunError(message.strip(), exit_code=int(code))
    first = next(iter(e.failures.values()))
    code = first.exitcode if first.exitcode > 0 else 128 - first.exitcode  # killed by a signal: 128+N
    how = (f"was killed by {signal.Signals(-first.exitcode).name}" if first.exitcode < 0
           else f"crashed (exit code {code})")
    return CkptrunError(f"training failed: rank {first.local_rank} {how} after {opts.max_restarts} restart(s); "
                        "see the log above, and raise --max-restarts to recover from more failures", exit_code=code)


def _committed_line(directory: str) -> str:
    from ..restore.recovery import restorable

    steps = restorable(Store(directory))
    return f"step {steps[-1]} is committed in {directory}" if steps else f"no step is committed in {directory}"
