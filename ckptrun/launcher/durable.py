"""--durable at the start of a run: the tier is usable (else one line, exit 2) and noted in --dir
(for `ls`), and a resume takes the newest step of any tier: one the durable tier has and --dir
lacks is copied into --dir first (in parallel), where the workers resume from it as from any
committed step. With --node-local-dir the ranks are known only after the rendezvous, so each
worker takes its own rank's part instead (worker/bootstrap.py)."""

from __future__ import annotations

from ..config import RunConfig
from ..errors import UsageError
from ..restore.pull import pull_newest
from ..storage.store import Store
from ..storage.tiers import open_tier
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
        if not cfg.node_local_dir:  # node-local: each worker takes its own rank's part
            pull_newest(tier, store)
    elif tier.committed():
        raise UsageError(f"--no-resume, but --durable {cfg.durable} already holds committed steps; "
                         "pass another --durable or remove them")
