"""Steps taken back from the durable tier (--durable) into --dir: by the launcher before a
resume (the newest step of any tier), and by a worker of a --node-local-dir run whose node
lacks the step every rank can reach (its --dir kept only its newest steps, the tier has older
ones). The tier's records are read through `tiers.mirror` and `Store`, as every tier is."""

from __future__ import annotations

import tempfile
import time

from ..log import log
from ..storage.store import Store
from ..storage.tiers import Tier
from ..storage.tiers.mirror import mirror
from .recovery import plans


def pull_newest(tier: Tier, store: Store, *, at_most: int | None = None) -> list[str]:
    """Copy into `store` the records of the newest step (at most `at_most`) that `tier` can
    restore, if `store` has none as new; returns the records copied."""
    local = max((s for s in plans(store) if at_most is None or s <= at_most), default=-1)
    with tempfile.TemporaryDirectory(prefix="ckptrun-durable-") as tmp:
        view = Store(tmp)
        mirror(tier, view.root, data=False)
        remote = {s: p for s, p in plans(view).items() if at_most is None or s <= at_most}
    if not remote or max(remote) <= local:
        return []
    t0, step = time.time(), max(remote)
    names = mirror(tier, store.root, [m.name for m in remote[step].records])
    log.info(f"resuming from {tier.url}: step {step} ({len(names)} record(s)) copied into {store.root} "
             f"in {time.time() - t0:.1f} s")
    return names
