"""Steps taken back from the durable tier (--durable) into --dir: by the launcher before a
resume (the newest step of any tier, whole), and with --node-local-dir by each worker, its own
rank's part only, once the ranks agreed on a step the tier has and its node's --dir lacks (the
node lost its disk, or kept only newer steps). The tier's records are read through
`tiers.mirror` and `Store`, as every tier is."""

from __future__ import annotations

import tempfile
import time

from ..log import log
from ..storage.store import Store
from ..storage.tiers import Tier
from ..storage.tiers.mirror import fill, mirror
from .recovery import Plan, plans


def tier_plans(tier: Tier) -> dict[int, Plan]:
    """The steps `tier` can restore and their records, from its manifests alone (one listing)."""
    with tempfile.TemporaryDirectory(prefix="ckptrun-durable-") as tmp:
        view = Store(tmp)
        mirror(tier, view.root, data=False, durable=False)
        return plans(view)


def take(tier: Tier, store: Store, step: int, plan: Plan, ranks: list[int] | None = None) -> list[str]:
    """Copy `plan`'s records (step `step` in `tier`) into `store`: whole, or with `ranks` only
    their parts (a node-local --dir; each checked as it lands). Returns the records copied into."""
    t0, names = time.time(), [m.name for m in plan.records]
    copied = mirror(tier, store.root, names) if ranks is None else [n for n in names if fill(tier, store, n, ranks)]
    whose = "" if ranks is None else f" (rank {', '.join(map(str, ranks))}'s part)"
    log.info(f"resuming from {tier.url}: step {step}{whose} ({len(copied)} record(s)) copied into {store.root} "
             f"in {time.time() - t0:.1f} s")
    return copied


def pull_newest(tier: Tier, store: Store) -> list[str]:
    """Copy into `store`, whole, the records of the newest step `tier` can restore, if `store` has
    none as new; returns the records copied."""
    remote = tier_plans(tier)
    if not remote or max(remote) <= max(plans(store), default=-1):
        return []
    step = max(remote)
    return take(tier, store, step, remote[step])
