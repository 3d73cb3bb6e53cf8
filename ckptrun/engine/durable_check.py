"""The leader's last check before a record's commit object in the durable tier: every part
listed is of that very commit. A restart runs a step again under the same name, and the re-run's
index differs (its snapshot times): a part of the other run (a round begun before the restart,
another engine's upload landing late) under the commit object would make the step unreadable,
and a committed step must never be."""

from __future__ import annotations

import tempfile
from collections.abc import Container
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import CorruptCheckpoint
from ..storage.schema import Manifest, checksum, rank_files
from ..storage.store import Store
from ..storage.tiers import Tier

FETCHES = 8  # the other ranks' indexes read back at once


def check_parts(tier: Tier, store: Store, m: Manifest, mine: Container[int]) -> None:
    """Raise CorruptCheckpoint, the record removed from `tier`, unless every part listed of `m`
    but those of the ranks in `mine` (uploaded by the caller) is of `m` itself: each index is
    read back (small objects, in parallel) and checked against `m`'s checksums. A rank file (one
    object, its index at its end) is not: its run is the one `store` holds if that still commits
    `m`. The next round uploads the step as `store` holds it then."""
    files = tier.listing()[0].get(m.name, {})
    now = next((x for x in store.manifests(warn=False) if x.name == m.name), None)
    if now is not None and now.index_checksums != m.index_checksums:
        tier.remove_record(m.name, list(files))
        raise CorruptCheckpoint(f"{m.name}: {store.root} holds another run of it now; "
                                f"the upload of the one before is removed from {tier.url}")
    keys = {r: rank_files(r)[1] for r in range(m.world_size) if r not in mine and rank_files(r)[1] in files}
    with tempfile.TemporaryDirectory(prefix="ckptrun-durable-") as tmp, ThreadPoolExecutor(FETCHES) as pool:
        def stale(r: int) -> bool:
            dest = Path(tmp) / keys[r]
            tier.get(f"{m.name}/{keys[r]}", dest, files[keys[r]])
            return checksum(dest.read_bytes()) != m.index_checksums[str(r)]
        bad = [r for r, no in zip(keys, pool.map(stale, keys), strict=True) if no]
    if bad:
        tier.remove_record(m.name, list(files))
        raise CorruptCheckpoint(f"{m.name}: rank {bad[0]}'s index in {tier.url} is not the one its "
                                "commit names (a part of another run of the step); the record is removed")
