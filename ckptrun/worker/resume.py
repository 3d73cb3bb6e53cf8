"""Where a worker resumes from: the step every rank agrees on, in the tier that holds it (its
engine's memory, its node's --dir, the durable tier), and that step's state read."""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from typing import TYPE_CHECKING

from ..config import RunConfig
from ..errors import CkptrunError
from ..ipc.messages import CommitPending
from ..log import log
from ..restore.consolidate import resharded
from ..restore.pull import take, tier_plans
from ..restore.recovery import DamagedRecord, Plan, newest_good, plans, resume_state
from ..storage.store import Store
from ..storage.tiers import Tier, open_tier
from .jobstore import job_store

if TYPE_CHECKING:
    from .runtime import Runtime


def _held(rt: Runtime) -> dict[int, int]:
    """Flush this rank's engine; {step: bytes} of the states it holds in memory (that outlived
    the crashed worker, or that partners gave back to a replaced node's engine), if a restart
    may resume from them."""
    reply = rt.client.request(CommitPending())
    if not rt.cfg.resume and rt.restart_count == 0 or rt.cfg.on_restart == "fresh" and rt.restart_count > 0:
        return {}
    return {int(step): int(nbytes) for step, nbytes in reply.get("held", [])}


def set_aside(store: Store, names: list[str], why: str = "not restorable") -> None:
    """Move records that will not be restored to damaged/: a re-run writes these steps again (a
    corrupt manifest would block their commit); the bad copies are kept for inspection."""
    for name in names:
        if not os.path.lexists(store.root / name):  # another rank's attempt moved it already
            continue
        log.warning(f"moving {name} ({why}) aside to {store.root}/damaged/")
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
    set_aside(store, [m.name for m in store.manifests(warn=False) if m.step > newest] + list(store.unreadable()))
    if rt.cfg.on_restart == "fresh" and rt.restart_count > 0:
        return None  # the script starts from scratch; committed steps are kept (and not rewritten)
    return plan


def read_resume(rt: Runtime, store: Store, plan: Plan, restarts: bool) -> tuple[Plan | None, tuple | None]:
    """(the plan resumed, its `resume_state`). A single rank chose `plan` without reading tensor
    bytes (`_decide`) and checks them as it reads them, once. With a restart to spare, the records
    between base and newest are checked while replay reads them, overlapped with it: a damaged
    one ends the attempt (`DamagedRecord`; the restart decides without it). On the last attempt
    they are all checked now (hashed, then read again by replay), and a damaged one is set aside
    and the choice made again here. Several ranks: rank 0 checked every byte already. A step
    written by another number of ranks is resharded (`resharded`, which refuses what it cannot)."""
    check_ahead = not restarts and rt.world_size == 1
    while True:
        try:
            if plan.base.world_size != rt.world_size:
                return plan, (resharded(store, plan, rt.rank, rt.world_size), None)
            return plan, resume_state(store, plan, rt.rank, check_ahead=check_ahead)
        except DamagedRecord as e:
            if rt.world_size > 1:
                raise
            log.warning(f"{e}; falling back to an older step")
            set_aside(store, [e.record])
            plan = _decide(rt, store, checksums=False)
            if plan is None:
                return None, None


def agreed_resume(rt: Runtime, store: Store, *, checksums: bool = True) -> Plan | tuple[int, int] | None:
    """Where to resume: a committed plan, or (step, bytes) of the state every rank's engine
    holds in memory: after a worker crash the engines outlive, no disk is read. Ranks resume
    from memory at the newest step all of theirs hold."""
    held = _held(rt)
    if rt.world_size == 1:
        return max(held.items()) if held else _decide(rt, store, checksums=checksums)
    kv = job_store(rt.restart_count)
    kv.set(f"flushed/{rt.rank}", ",".join(map(str, sorted(held))))
    if rt.cfg.node_local_dir:  # every rank decides alike, each from its own node's --dir
        step = _all_hold(kv, rt.world_size)
        if step is None:
            return _agreed_node_local(rt, store, kv, checksums=checksums)
        store.sweep_incomplete()  # (what only some ranks wrote before the resumed step never commits)
        return step, held[step]
    if rt.rank == 0:
        if (step := _all_hold(kv, rt.world_size)) is not None:
            store.sweep_incomplete()
            kv.set("resume", f"memory:{step}")
        else:
            plan = _decide(rt, store, checksums=checksums)
            kv.set("resume", str(plan.step) if plan else "")
    step = kv.get("resume").decode()
    if step.startswith("memory:"):
        at = int(step.removeprefix("memory:"))
        return at, held[at]
    return plans(store)[int(step)] if step else None


def _all_hold(kv, world_size: int) -> int | None:
    """The newest step every rank's engine holds in memory, once every engine has flushed; None
    if not one."""
    keys = [f"flushed/{r}" for r in range(world_size)]
    kv.wait(keys)
    common = set.intersection(*({int(s) for s in kv.get(k).decode().split(",") if s} for k in keys))
    return max(common, default=None)


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
    set_aside(store, [m.name for m in store.manifests(warn=False) if m.step > newest],
              f"not reachable by every rank, which resume from {f'step {newest}' if newest >= 0 else 'the start'}; "
              "the re-run writes it again")
    set_aside(store, list(store.unreadable()))
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
