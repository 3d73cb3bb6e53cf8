"""The run command: start one engine per local rank, then the workers through torchrun's
elastic agent (rendezvous, restarts), and report failures as one line."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Client
from pathlib import Path

from .config import ENV, RunConfig
from .errors import CkptrunError, UsageError
from .leftovers import new_tag, remove_staging, run_name, sweep_stale
from .store import Store


@dataclass
class LaunchOptions:
    """torchrun's launch options, same names and meaning."""

    nproc_per_node: str = "1"
    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    standalone: bool = False
    extra: list[str] = field(default_factory=list)

    def torchrun_argv(self) -> list[str]:
        argv = ["--nproc-per-node", self.nproc_per_node, "--nnodes", self.nnodes,
                "--max-restarts", str(self.max_restarts), "--monitor-interval", "0.1"]
        for flag, value in (("--node-rank", self.node_rank), ("--rdzv-backend", self.rdzv_backend),
                            ("--rdzv-endpoint", self.rdzv_endpoint), ("--rdzv-id", self.rdzv_id),
                            ("--master-addr", self.master_addr), ("--master-port", self.master_port)):
            if value is not None:
                argv += [flag, str(value)]
        if self.standalone:
            argv.append("--standalone")
        return argv + self.extra


class EngineSupervisor:
    """Runs the engines (spawn), restarts one that dies, and shuts them down after a flush."""

    def __init__(self, cfg: RunConfig, nlocal: int, tag: str) -> None:
        self.cfg, self.nlocal, self.tag = cfg, nlocal, tag
        self.ctx = mp.get_context("spawn")
        self.procs: list = [None] * nlocal
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="ckptrun-engines", daemon=True)

    def _start(self, local_rank: int) -> None:
        from .engine.server import main as engine_main

        address = self.cfg.engine_address(local_rank)
        Path(address).unlink(missing_ok=True)
        # The kernel's parent-death signal only for engines started from the main thread: it fires
        # when the starting thread ends, and a restart comes from the monitor thread.
        p = self.ctx.Process(target=engine_main, name=f"ckptrun-engine-{local_rank}",
                             args=(address, bytes.fromhex(self.cfg.authkey), local_rank, self.tag,
                                   self.cfg.metrics_dir, os.getpid(),
                                   threading.current_thread() is threading.main_thread()))
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
                    print(f"ckptrun: checkpoint engine of local rank {r} died (exit code {p.exitcode}); "
                          "restarting it", file=sys.stderr, flush=True)
                    self._start(r)

    def shutdown(self, timeout: float = 600.0) -> None:
        self._stop.set()
        for r, p in enumerate(self.procs):
            if p is None or not p.is_alive():
                continue
            try:
                with Client(self.cfg.engine_address(r), family="AF_UNIX",
                            authkey=bytes.fromhex(self.cfg.authkey)) as c:
                    c.send({"op": "shutdown"})
            except OSError:
                p.terminate()
        for p in self.procs:
            if p is not None:
                p.join(timeout)
                if p.is_alive():
                    p.kill()
        remove_staging(self.tag)


def preflight(cfg: RunConfig, script: str) -> None:
    """Every check that can fail before anything starts or is written."""
    from .strategies import REGISTRY

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
    store = Store(cfg.dir)
    store.ensure_writable()
    if not cfg.resume and store.manifests(warn=False):
        raise UsageError(f"--no-resume, but {cfg.dir} already holds committed steps; "
                         "pass another --dir or remove the old checkpoints")


def run(cfg: RunConfig, opts: LaunchOptions, script: str, script_args: list[str], *,
        dashboard: bool = True, metrics_file: str | None = None) -> int:
    """Launch and supervise a training run; returns the exit code.

    `dashboard`: a live panel on a terminal, a log line every few seconds otherwise."""
    preflight(cfg, script)
    import torch.distributed.run as torchrun
    from rich.console import Console
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .dashboard import Dashboard
    from .hostmetrics import HostSampler
    from .worker_logs import WorkerLogTailer

    nlocal = torchrun.determine_local_world_size(opts.nproc_per_node)
    swept = sweep_stale()
    if swept.owners:
        print(swept, file=sys.stderr, flush=True)
    tag = new_tag()
    engine_dir = tempfile.mkdtemp(prefix=run_name(tag, ""))
    cfg.dir = str(Path(cfg.dir).resolve())
    cfg.engine_dir, cfg.authkey = engine_dir, os.urandom(16).hex()
    cfg.metrics_dir = cfg.metrics_dir or os.path.join(engine_dir, "metrics")
    os.environ[ENV] = cfg.to_env()
    console = Console()
    live = dashboard and console.is_terminal
    argv = opts.torchrun_argv()
    logs = None
    if live:  # workers write to files that are echoed above the panel
        argv += ["--redirects", "3", "--log-dir", os.path.join(engine_dir, "logs")]
        logs = WorkerLogTailer(os.path.join(engine_dir, "logs"), console)
        logs.start()
    dash = Dashboard(cfg.metrics_dir, metrics_file, live=live, console=console,
                     sampler=HostSampler()) if dashboard or metrics_file else None
    if dash is not None:
        dash.start()
    engines = EngineSupervisor(cfg, nlocal, tag)
    engines.start()
    try:
        # torchrun's own entry: it picks a free local port on one node, as `torchrun` does.
        torchrun.run(torchrun.parse_args([*argv, "-m", "ckptrun.bootstrap", script, *script_args]))
        return 0
    except ChildFailedError as e:
        errors = sorted(Path(engine_dir).glob("error-*.txt"))
        if errors:
            code, message = errors[0].read_text().split("\n", 1)
            raise CkptrunError(message.strip(), exit_code=int(code)) from None
        first = next(iter(e.failures.values()))
        raise CkptrunError(f"training failed (rank {first.local_rank}, exit code {first.exitcode}) after "
                           f"{opts.max_restarts} restart(s); see the log above, and raise --max-restarts "
                           "to recover from more failures") from None
    finally:
        engines.shutdown()
        if logs is not None:
            logs.stop()
        if dash is not None:
            dash.stop()
        shutil.rmtree(engine_dir, ignore_errors=True)
