"""--durable at the start of a run: the tier is usable (else one line, exit 2) and noted in --dir
(for `ls`), and a resume takes the newest step of any tier: one the durable tier has and --dir
lacks is copied into --dir first (in parallel), where the workers resume from it as from any
committed step."""

from __future__ import annotations

import tempfile
import time

from ..config import RunConfig
from ..errors import UsageError
from ..log import log
from ..storage.store import Store
from ..storage.tiers import Tier, open_tier
from ..storage.tiers.mirror import mirror
from ..storage.tiers.recorded import record


def prepare(cfg: RunConfig, store: Store) -> None:
    if not cfg.durable:
        return
    if cfg.durable_every < 0 or cfg.durable_keep < 0:
        raise UsageError("--durable-every and --durable-keep must be 0 (auto / keep all) or more")
    tier = open_tier(cfg.durable, cfg.durable_endpoint or None)
    tier.probe()
    record(store.root, cfg.durable, cfg.durable_endpoint)
    if cfg.resume:
        pull_newer(tier, store)
    elif tier.committed():
        raise UsageError(f"--no-resume, but --durable {cfg.durable} already holds committed steps; "
                         "pass another --durable or remove them")


def pull_newer(tier: Tier, store: Store) -> list[str]:
    """Copy into `store` the records of the newest step `tier` can restore, if --dir has none as
    new; returns the records copied."""
    from ..restore.recovery import plans

    local = max(plans(store), default=-1)
    with tempfile.TemporaryDirectory(prefix="ckptrun-durable-") as tmp:
        view = Store(tmp)
        mirror(tier, view.root, data=False)
        remote = plans(view)
    if not remote or max(remote) <= local:
        return []
    t0, step = time.time(), max(remote)
    names = mirror(tier, store.root, [m.name for m in remote[step].records])
    log.info(f"resuming from {tier.url}: step {step} ({len(names)} record(s)) copied into {store.root} "
             f"in {time.time() - t0:.1f} s")
    return names
