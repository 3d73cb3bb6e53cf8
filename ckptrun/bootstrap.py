"""Worker entry point (`python -m ckptrun.bootstrap SCRIPT ARGS...`), started by the elastic agent.

Connects to this rank's engine (which flushes first), agrees with the other ranks on the step
to resume from, installs the hooks, then runs the user's script unmodified with runpy.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import warnings
from pathlib import Path

from .config import RESUME_ENV, RunConfig
from .engine.client import EngineLost
from .errors import CheckpointMismatch, CkptrunError
from .jobstore import job_store
from .recovery import Plan, diff_states, newest_good, plans, read_state
from .runtime import ResumeState, Runtime, StopRun, install
from .store import Store


def _rank_env() -> tuple[int, int, int, int]:
    env = os.environ
    return (int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1)),
            int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))


def _decide(rt: Runtime, store: Store) -> Plan | None:
    """Rank 0's choice: the newest committed step that verifies, once every engine has flushed."""
    rt.client.request({"op": "commit_pending"})
    if not rt.cfg.resume and rt.restart_count == 0:
        return None
    plan = newest_good(store)
    for name in store.incomplete():
        store.remove(name)
    newest = plan.step if plan else -1
    # A re-run writes these steps again (a corrupt manifest would block their commit); keep the
    # bad copies for inspection.
    damaged = [m.name for m in store.manifests(warn=False) if m.step > newest] + list(store.unreadable())
    for name in damaged:
        warnings.warn(f"ckptrun: moving {name} (not restorable) aside to {store.root}/damaged/", stacklevel=1)
        (store.root / "damaged").mkdir(exist_ok=True)
        os.replace(store.root / name, store.root / "damaged" / f"{name}-{int(time.time())}")
    return plan


def _agreed_resume(rt: Runtime, store: Store) -> Plan | None:
    if rt.world_size == 1:
        return _decide(rt, store)
    kv = job_store(rt.restart_count)
    kv.set(f"flushed/{rt.rank}", "1")
    if rt.rank == 0:
        kv.wait([f"flushed/{r}" for r in range(rt.world_size)])
        plan = _decide(rt, store)
        kv.set("resume", str(plan.step) if plan else "")
    step = kv.get("resume").decode()
    return plans(store)[int(step)] if step else None


def _fail(cfg: RunConfig | None, rank: int, err: CkptrunError) -> None:
    """Exit the worker. A lost engine is transient (the elastic agent restarts the worker and
    the launcher the engine); anything else is the user's to fix and is reported by the launcher."""
    if isinstance(err, EngineLost):
        print(f"ckptrun: rank {rank}: {err}; exiting so the worker restarts", file=sys.stderr, flush=True)
        sys.exit(1)
    print(f"ckptrun: error: {err}", file=sys.stderr, flush=True)
    if cfg and cfg.engine_dir:
        Path(cfg.engine_dir, f"error-{rank}.txt").write_text(f"{err.exit_code}\n{err}\n")
    sys.exit(err.exit_code)


def main() -> None:
    script, *args = sys.argv[1:]
    cfg = RunConfig.from_env()
    rank, local_rank, world_size, restart_count = _rank_env()
    t_start = time.time()
    try:
        rt = Runtime(cfg, rank, local_rank, world_size, restart_count)
        store = Store(cfg.dir)
        plan = _agreed_resume(rt, store)
        if plan is not None:
            if plan.base.world_size != world_size:
                raise CheckpointMismatch(
                    f"{cfg.dir} step {plan.step} was written by {plan.base.world_size} ranks, this run has "
                    f"{world_size}; launch {plan.base.world_size} ranks, or export it with `ckptrun restore`")
            rt.resume = ResumeState(plan.step, plan.base.name, read_state(store, plan.base, rank),
                                    plan.base.world_size, diff_states(store, plan, rank) if plan.diffs else None)
            rt.step = rt.checkpointed_step = plan.step
        if plan is not None or restart_count > 0:
            rt.recovery_started = t_start
        os.environ[RESUME_ENV] = str(rt.step)
        rt.metrics.emit(type="run", pid=os.getpid(), engine_pid=rt.engine_pid, strategy=cfg.strategy,
                        settings=rt.strategy.settings(), dir=cfg.dir, world_size=world_size,
                        restart_count=restart_count, resume_step=rt.step, start_t=t_start)
        install(rt)
    except CkptrunError as e:
        _fail(cfg, rank, e)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except StopRun as e:
        if rank == 0:
            print(f"ckptrun: stopped the script after step {e.args[0]} (--max-steps)", file=sys.stderr, flush=True)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    except CkptrunError as e:
        _fail(cfg, rank, e)
    try:
        rt.finish()
    except CkptrunError as e:
        _fail(cfg, rank, e)


if __name__ == "__main__":
    main()
