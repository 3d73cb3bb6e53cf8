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
from datetime import timedelta
from pathlib import Path

from .config import RESUME_ENV, RunConfig
from .errors import CheckpointMismatch, CkptrunError
from .recovery import load_state, newest_good
from .runtime import ResumeState, Runtime, install
from .store import Manifest, Store


def _rank_env() -> tuple[int, int, int, int]:
    env = os.environ
    return (int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1)),
            int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))


def _decide(rt: Runtime, store: Store) -> Manifest | None:
    """Rank 0's choice: the newest committed step that verifies, once every engine has flushed."""
    rt.client.request({"op": "commit_pending"})
    if not rt.cfg.resume and rt.restart_count == 0:
        return None
    m = newest_good(store)
    for name in store.incomplete():
        store.remove(name)
    for newer in [x for x in store.manifests(warn=False) if m is None or x.step > m.step]:
        warnings.warn(f"ckptrun: moving damaged {newer.name} aside to {store.root}/damaged/", stacklevel=1)
        (store.root / "damaged").mkdir(exist_ok=True)
        os.replace(store.root / newer.name, store.root / "damaged" / f"{newer.name}-{int(time.time())}")
    return m


def _agreed_resume(rt: Runtime, store: Store) -> Manifest | None:
    if rt.world_size == 1:
        return _decide(rt, store)
    import torch.distributed as dist

    kv = dist.PrefixStore(
        f"ckptrun/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{rt.restart_count}",
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                      timeout=timedelta(minutes=10)),
    )
    kv.set(f"flushed/{rt.rank}", "1")
    if rt.rank == 0:
        kv.wait([f"flushed/{r}" for r in range(rt.world_size)])
        m = _decide(rt, store)
        kv.set("resume", m.name if m else "")
    name = kv.get("resume").decode()
    return store.manifest(name) if name else None


def _fail(cfg: RunConfig | None, rank: int, err: CkptrunError) -> None:
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
        m = _agreed_resume(rt, store)
        if m is not None:
            if m.world_size != world_size:
                raise CheckpointMismatch(
                    f"{cfg.dir} step {m.step} was written by {m.world_size} ranks, this run has "
                    f"{world_size}; launch {m.world_size} ranks, or export it with `ckptrun restore`")
            rt.resume = ResumeState(m.step, m.name, load_state(store, m, rank), m.world_size)
            rt.step = m.step
        if m is not None or restart_count > 0:
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
