"""Worker entry point (`python -m ckptrun.worker.bootstrap SCRIPT ARGS...`), started by the elastic agent.

Connects to this rank's engine (which flushes first), agrees with the other ranks on the step
to resume from, installs the hooks, then runs the user's script unmodified with runpy.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import runpy
import signal
import sys
import time
from pathlib import Path

from ..config import RESUME_ENV, RunConfig, is_torchrun_var
from ..errors import AbortRun, CkptrunError
from ..ipc.client import EngineLost
from ..ipc.messages import CommitPending
from ..ipc.stdio import merge_stderr
from ..log import log
from ..restore.consolidate import resharded
from ..restore.pull import take, tier_plans
from ..restore.recovery import CHECK_AHEAD_BYTES, DamagedRecord, Plan, newest_good, plans, resume_state
from ..storage.store import Store
from ..storage.tiers import Tier, open_tier
from .hooks import StopRun
from .jobstore import job_store
from .loading import ResumeState, fetch_held
from .runtime import Runtime, install


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


def _held(rt: Runtime) -> tuple[int, int] | None:
    """Flush this rank's engine; (step, bytes) of the state it holds in memory (a replica that
    outlived the crashed worker), if a restart may resume from it."""
    reply = rt.client.request(CommitPending())
    if rt.restart_count == 0 or rt.cfg.on_restart == "fresh" or reply.get("held_step") is None:
        return None
    return int(reply["held_step"]), int(reply["held_nbytes"])


def _set_aside(store: Store, names: list[str]) -> None:
    """Move records that will not be restored to damaged/: a re-run writes these steps again (a
    corrupt manifest would block their commit); the bad copies are kept for inspection."""
    for name in names:
        if not os.path.lexists(store.root / name):  # another rank's attempt moved it already
            continue
        log.warning(f"moving {name} (not restorable) aside to {store.root}/damaged/")
        (store.root / "damaged").mkdir(exist_ok=True)
        with contextlib.suppress(FileNotFoundError):  # (a rank of the same node moved it just now)
            os.replace(store.root / name, store.root / "damaged" / f"{name}-{int(time.time())}")


def _decide(rt: Runtime, store: Store, *, checksums: bool) -> Plan | None:
    """Rank 0's choice: the newest committed step that verifies, once every engine has flushed.
    Without `checksums`, tensor bytes are checked only as the resume reads them (one pass over
    the chain instead of two); a record found damaged then ends the attempt (`DamagedRecord`)."""
    if not rt.cfg.resume and rt.restart_count == 0:
        return None
    plan = newest_good(store, checksums=checksums)
    store.sweep_incomplete()  # every engine has flushed: no record is on its way
    newest = plan.step if plan else -1
    _set_aside(store, [m.name for m in store.manifests(warn=False) if m.step > newest] + list(store.unreadable()))
    if rt.cfg.on_restart == "fresh" and rt.restart_count > 0:
        return None  # the script starts from scratch; committed steps are kept (and not rewritten)
    return plan


def _read_resume(rt: Runtime, store: Store, plan: Plan, restarts: bool) -> tuple[Plan | None, tuple | None]:
    """(the plan resumed, its `resume_state`). A single rank chose `plan` without reading tensor
    bytes (`_decide`) and checks them as it reads them, once. With a restart to spare, the records
    between base and newest are checked while replay reads them, overlapped with it: a damaged
    one ends the attempt (`DamagedRecord`; the restart decides without it). On the last attempt
    they are all checked now, kept in memory up to CHECK_AHEAD_BYTES, and a damaged one is set
    aside and the choice made again here. Several ranks: rank 0 checked every byte already. A step
    written by another number of ranks is resharded (`resharded`, which refuses what it cannot)."""
    hold = 0 if restarts or rt.world_size > 1 else CHECK_AHEAD_BYTES
    while True:
        try:
            if plan.base.world_size != rt.world_size:
                return plan, (resharded(store, plan, rt.rank, rt.world_size), None)
            return plan, resume_state(store, plan, rt.rank, hold_bytes=hold)
        except DamagedRecord as e:
            if rt.world_size > 1:
                raise
            log.warning(f"{e}; falling back to an older step")
            _set_aside(store, [e.record])
            plan = _decide(rt, store, checksums=False)
            if plan is None:
                return None, None


def _agreed_resume(rt: Runtime, store: Store, *, checksums: bool = True) -> Plan | tuple[int, int] | None:
    """Where to resume: a committed plan, or (step, bytes) of the state every rank's engine
    holds in memory: after a worker crash the engines outlive, no disk is read. Ranks resume
    from memory only when all of theirs hold the same step."""
    held = _held(rt)
    if rt.world_size == 1:
        return held or _decide(rt, store, checksums=checksums)
    kv = job_store(rt.restart_count)
    kv.set(f"flushed/{rt.rank}", str(held[0]) if held else "-")
    if rt.cfg.node_local_dir:  # every rank decides alike, each from its own node's --dir
        return held if _all_hold(kv, rt.world_size) else _agreed_node_local(rt, store, kv, checksums=checksums)
    if rt.rank == 0:
        if (step := _all_hold(kv, rt.world_size)) is not None:
            kv.set("resume", f"memory:{step}")
        else:
            plan = _decide(rt, store, checksums=checksums)
            kv.set("resume", str(plan.step) if plan else "")
    step = kv.get("resume").decode()
    if step.startswith("memory:"):
        return held
    return plans(store)[int(step)] if step else None


def _all_hold(kv, world_size: int) -> str | None:
    """The step every rank's engine holds in memory, once every engine has flushed; None if not one."""
    keys = [f"flushed/{r}" for r in range(world_size)]
    kv.wait(keys)
    steps = {kv.get(k).decode() for k in keys}
    return steps.pop() if len(steps) == 1 and steps != {"-"} else None


def _agreed_node_local(rt: Runtime, store: Store, kv, *, checksums: bool) -> Plan | None:
    """--node-local-dir: the newest step every rank restores from its own node's --dir (where
    a replaced node's engine has put back what partners held). Each rank says the newest step it
    can restore at most at the last round's smallest, until all say the same one: every rank
    decides alike, from the job store's keys. With --durable, a rank also reaches the steps the
    tier holds: one whose --dir lacks the agreed step takes its own part of it back from there.
    Each rank then moves aside, in its own --dir, the records newer than it (a step some nodes
    committed and others not: its re-run commits it anew)."""
    if not rt.cfg.resume and rt.restart_count == 0:
        return None
    store.sweep_incomplete()  # every engine has flushed (`_all_hold`): no record is on its way
    tier, remote = _durable(rt.cfg)
    at_most = None
    for i in itertools.count():
        plan = newest_good(store, at_most=at_most, checksums=checksums, ranks=[rt.rank])
        reach = max([plan.step if plan else -1, *(s for s in remote if at_most is None or s <= at_most)])
        kv.set(f"local/{i}/{rt.rank}", str(reach))
        keys = [f"local/{i}/{r}" for r in range(rt.world_size)]
        kv.wait(keys)
        steps = {int(kv.get(k)) for k in keys}
        if len(steps) == 1:
            break
        at_most = min(steps)
    newest = steps.pop()
    if tier is not None and newest >= 0 and (plan is None or plan.step != newest):
        take(tier, store, newest, remote[newest], [rt.rank])
        if newest not in plans(store):
            raise CkptrunError(f"--durable {tier.url}: rank {rt.rank}'s part of step {newest}, which the ranks "
                               f"agreed to resume from, did not come back into {store.root}")
    _set_aside(store, [m.name for m in store.manifests(warn=False) if m.step > newest] + list(store.unreadable()))
    if newest < 0 or rt.cfg.on_restart == "fresh" and rt.restart_count > 0:
        return None
    return plans(store)[newest]


def _durable(cfg: RunConfig) -> tuple[Tier | None, dict[int, Plan]]:
    """--durable: the tier and the steps it can restore (one listing, at the start of a resume
    every rank can reach); a tier that cannot be read is said, and counts as holding none."""
    if not cfg.durable:
        return None, {}
    tier = open_tier(cfg.durable, cfg.durable_endpoint or None)
    try:
        return tier, tier_plans(tier)
    except (CkptrunError, OSError) as e:
        log.warning(f"--durable {cfg.durable}: not read for the resume ({e}); resuming from --dir")
        return tier, {}


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
    t_start = time.time()
    if cfg.engine_dir:
        _error_file(cfg, rank).unlink(missing_ok=True)  # an earlier attempt's: this one decides
    try:
        rt = Runtime(cfg, rank, local_rank, world_size, restart_count)
        store = Store(cfg.dir)
        t_restore = time.perf_counter()
        plan = _agreed_resume(rt, store, checksums=world_size > 1)
        if isinstance(plan, Plan):
            plan, resumed = _read_resume(rt, store, plan, restarts)
        if isinstance(plan, tuple):
            rt.resume_from(fetch_held(rt.client, *plan, rank, world_size))
            log.info(f"rank {rank}: resumed step {rt.step} from the checkpoint engine's memory (no disk read)")
        elif plan is not None:
            state, diffs = resumed
            rt.resume_from(ResumeState(plan.step, plan.base.name, state, plan.base.world_size, diffs))
        rt.loading.restore_s = time.perf_counter() - t_restore
        if plan is not None or restart_count > 0:
            rt.recovery_started = t_start
        os.environ[RESUME_ENV] = str(rt.step)
        rt.metrics.emit(type="run", pid=os.getpid(), engine_pid=rt.engine_pid, strategy=cfg.strategy,
                        settings=rt.strategy.settings(), dir=cfg.dir, world_size=world_size,
                        restart_count=restart_count, resume_step=rt.step, start_t=t_start)
        install(rt)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _on_signal(rt))
    except CkptrunError as e:
        if isinstance(e, DamagedRecord):  # the restart decides without it
            _set_aside(store, [e.record])
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
            _set_aside(store, [e.error.record])
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
