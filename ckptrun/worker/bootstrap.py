"""Worker entry point (`python -m ckptrun.worker.bootstrap SCRIPT ARGS...`), started by the elastic agent.

Says Hello to this rank's engine before importing the rest of ckptrun, and torch where the
engine meets no round (worker/greeting.py: the engine flushes and meets the round's engines
meanwhile), agrees with the other ranks on the step to resume from (worker/resume.py), installs
the hooks, then runs the user's script unmodified with runpy. This module imports torch only in
`main`, once the Hello is sent.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import RESUME_ENV, RunConfig, is_torchrun_var
from ..errors import AbortRun, CkptrunError
from ..ipc.client import EngineLost
from ..ipc.stdio import merge_stderr
from ..log import log
from .greeting import greet

if TYPE_CHECKING:
    from .runtime import Runtime


def _rank_env() -> tuple[int, int, int, int, int]:
    """(rank, local rank, world size, restart count, max restarts), from torchrun's environment."""
    env = os.environ
    return (int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1)),
            int(env.get("TORCHELASTIC_RESTART_COUNT", 0)), int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)))


def _hide_torchrun_env(launcher_env: dict[str, str]) -> None:
    """--no-dist-env: leave the script torchrun's variables as the launcher had them (usually none),
    as under plain `python SCRIPT`. Everything ckptrun needs of them is read by now; the job store
    (MASTER_ADDR/PORT) serves only multi-rank runs, which --no-dist-env refuses."""
    for name in [n for n in os.environ if is_torchrun_var(n)]:
        del os.environ[name]
    os.environ.update(launcher_env)


def _error_file(cfg: RunConfig, rank: int) -> Path:
    """Where a worker leaves the one line (and exit code) the launcher reports if it fails for good."""
    return Path(cfg.engine_dir, f"error-{rank}.txt")


def _leave_error(cfg: RunConfig | None, rank: int, code: int, message: str) -> None:
    if cfg and cfg.engine_dir:
        _error_file(cfg, rank).write_text(f"{code}\n{message}\n")


def _fail(cfg: RunConfig | None, rank: int, err: CkptrunError, restarts: bool) -> None:
    """Exit the worker. A lost engine is transient (the elastic agent restarts the worker and
    the launcher the engine); anything else is the user's to fix and is reported by the launcher,
    once, when the last attempt fails: an attempt that `restarts` says it here."""
    if isinstance(err, EngineLost):
        log.info(f"rank {rank}: {err}; exiting so the worker restarts")
        sys.exit(1)
    _leave_error(cfg, rank, err.exit_code, str(err))
    if restarts:
        log.info(f"rank {rank}: {err}; restarting (--max-restarts)")
    elif not (cfg and cfg.engine_dir):  # no launcher to report it
        log.error(f"error: {err}")
    sys.exit(err.exit_code)


def _on_signal(rt: Runtime):
    """SIGTERM/SIGINT: stop at the next optimizer step every rank agrees on (StepHooks._stop_here),
    after handing over the newest finished step. Repeats (the terminal's Ctrl-C and the agent's
    forwarded one) change nothing; the agent kills what outlives the grace period."""

    def handler(signum: int, frame) -> None:
        if rt.stop_signal is None:
            rt.stop_signal = signum

    return handler


def main() -> None:
    merge_stderr()  # live dashboard: one file per rank keeps stdout and stderr in order
    script, *args = sys.argv[1:]
    cfg = RunConfig.from_env()
    rank, local_rank, world_size, restart_count, max_restarts = _rank_env()
    restarts = restart_count < max_restarts
    if cfg.engine_dir:
        _error_file(cfg, rank).unlink(missing_ok=True)  # an earlier attempt's: this one decides
    try:
        greeting = greet(cfg, rank, local_rank, world_size, restart_count)
    except CkptrunError as e:
        _fail(cfg, rank, e, restarts)
    from ..restore.recovery import DamagedRecord, Plan
    from ..storage.store import Store
    from .hooks import StopRun
    from .loading import ResumeState, fetch_held
    from .resume import agreed_resume, read_resume, set_aside
    from .runtime import Runtime, install

    t_start = time.time()  # (recovery counts from here, after the imports, as it did before the Hello moved)
    try:
        rt = Runtime(cfg, rank, local_rank, world_size, restart_count, greeting=greeting)
        store = Store(cfg.dir)
        t_restore = time.perf_counter()
        plan = agreed_resume(rt, store, checksums=world_size > 1)
        if isinstance(plan, Plan):
            plan, resumed = read_resume(rt, store, plan, restarts)
        if isinstance(plan, tuple):
            rt.resume_from(fetch_held(rt.client, *plan, rank, world_size))
            log.info(f"rank {rank}: resumed step {rt.step} from the checkpoint engine's memory (no disk read)")
        elif plan is not None:
            state, diffs = resumed
            rt.resume_from(ResumeState(plan.step, plan.base.name, state, plan.base.world_size, diffs))
        rt.loading.restore_s = time.perf_counter() - t_restore
        if plan is not None or restart_count > 0:
            rt.recovery_started = t_start
        os.environ[RESUME_ENV] = str(rt.resume_iteration)
        rt.metrics.emit(type="run", pid=os.getpid(), engine_pid=rt.engine_pid, strategy=cfg.strategy,
                        settings=rt.strategy.settings(), dir=cfg.dir, world_size=world_size,
                        restart_count=restart_count, resume_step=rt.step, start_t=t_start)
        install(rt)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _on_signal(rt))
    except CkptrunError as e:
        if isinstance(e, DamagedRecord):  # the restart decides without it
            set_aside(store, [e.record])
        _fail(cfg, rank, e, restarts)
    if not cfg.dist_env:
        _hide_torchrun_env(cfg.launcher_env)
    sys.argv = [script, *args]
    stop: StopRun | None = None
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except StopRun as e:
        stop = e
        if rank == 0:
            log.info(f"stopped the script after step {e.step} ({e.reason})")
    except SystemExit as e:
        if e.code not in (None, 0):  # the script's own choice: its code is the run's, no restart advice
            code = e.code if isinstance(e.code, int) else 1
            if rt.state.optimizers:  # what it trained is handed over as after a normal exit
                rt.finish()
            _leave_error(cfg, rank, code, f"the training script exited with code {code} (rank {rank})")
            raise
    except AbortRun as e:
        if isinstance(e.error, DamagedRecord):  # the restart decides without it
            set_aside(store, [e.error.record])
        _fail(cfg, rank, e.error, restarts)
    except CkptrunError as e:
        _fail(cfg, rank, e, restarts)
    try:
        rt.finish()
    except CkptrunError as e:
        _fail(cfg, rank, e, restarts)
    if stop is not None and stop.signum is not None:
        sys.exit(128 + stop.signum)


if __name__ == "__main__":
    main()
