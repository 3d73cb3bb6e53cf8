"""Copy committed records from a tier into a local folder laid out like --dir.

`ls`, `verify`, `restore` and resume read a tier through such a copy and `store_read`, the
one reader of untrusted checkpoint directories, so every check of invariant 7 applies to it
unchanged. The names come from the tier's checked listing; the room is checked before anything
is copied; each file is copied under a hidden name and renamed, a record's manifest last, so a
copy cut short is an uncommitted record, never a committed one missing its data.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ...errors import CkptrunError, CorruptCheckpoint
from ...log import log
from ..fsutil import fsync_dir, fsync_file
from ..store import Store
from . import open_tier
from .base import MANIFEST, Tier

WORKERS = 8  # files copied at once (a large object is itself fetched in parallel ranges)


def mirror(tier: Tier, dest: Path, names: Iterable[str] | None = None, *, data: bool = True,
           durable: bool = True) -> list[str]:
    """Copy the committed records `names` (all when None) of `tier` into `dest`, their data too
    when `data`; records `dest` has committed already are left alone. Each file is on disk
    before the manifests go (fsynced), unless not `durable` (a private view read and thrown
    away). Returns the names copied."""
    records, refused = tier.listing()
    for key in refused:
        log.warning(f"{tier.url}: refusing {key}: not a record file, or its size is out of range")
    wanted = set(names) if names is not None else None
    store = Store(dest)
    chosen = [n for n, files in sorted(records.items()) if MANIFEST in files
              and (wanted is None or n in wanted) and not store.is_committed(n)]
    todo = {n: {f: s for f, s in records[n].items() if data or f == MANIFEST} for n in chosen}
    need = sum(s for files in todo.values() for s in files.values())
    dest.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest).free
    if need > free:
        raise CkptrunError(f"{tier.url}: copying {len(todo)} record(s) needs {need:,} bytes, {dest} has "
                           f"{free:,} free", exit_code=2)

    def fetch(item: tuple[str, str, int]) -> None:
        _fetch(tier, dest, *item, durable=durable)

    with ThreadPoolExecutor(WORKERS) as pool:
        for name in todo:
            (dest / name).mkdir(exist_ok=True)
        list(pool.map(fetch, [(n, f, s) for n, files in todo.items() for f, s in files.items() if f != MANIFEST]))
        for name in todo:  # the commit objects last
            fsync_dir(dest / name)
        list(pool.map(fetch, [(n, MANIFEST, files[MANIFEST]) for n, files in todo.items()]))
    for name in todo:
        fsync_dir(dest / name)
    return chosen


def _fetch(tier: Tier, dest: Path, name: str, file: str, size: int, *, durable: bool = True) -> None:
    """Copy one object into `dest/name/file`, under a hidden name until it is whole (and, when
    `durable`, on disk: a record restored into --dir is one a later resume may need, and a
    manifest published over files the page cache alone holds would be torn by a power loss)."""
    path = dest / name / file
    tmp = path.with_name(f".{file}.part-{os.getpid()}")
    try:
        tier.get(f"{name}/{file}", tmp, size)
        if durable:
            fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def fill(tier: Tier, store: Store, name: str, ranks: list[int] | None = None, *, checksums: bool = True) -> list[str]:
    """Copy into record `name` of `store` the parts of `ranks` (all when None) it lacks that
    `tier` holds, then check the record through `Store`; what was copied is removed again if
    it fails. A record committed in `store` keeps its manifest (it pins their checksums) and is
    checked whole; one `store` lacks (a node-local --dir that lost it) gets the tier's manifest
    last, and only `ranks` are checked (the others are on other nodes). Without `checksums`,
    every check but the tensors' checksums (for a caller whose tier checked every tensor as it
    arrived, and whose reader checks them again as it reads). Returns the files copied;
    CorruptCheckpoint (nothing left behind) when the record does not verify."""
    committed = store.is_committed(name)
    present = set(store.ranks_present(name)) if committed else set()
    listed = tier.listing()[0].get(name, {})
    if not committed and MANIFEST not in listed:
        raise CorruptCheckpoint(f"{name}: {tier.url} holds no manifest of it")
    files = {f: size for f, size in listed.items() if f != MANIFEST and int(f[5:10]) not in present
             and (ranks is None or int(f[5:10]) in ranks)}
    (store.root / name).mkdir(exist_ok=True)
    for file, size in files.items():
        _fetch(tier, store.root, name, file, size)
    fsync_dir(store.root / name)
    if not committed:
        _fetch(tier, store.root, name, MANIFEST, listed[MANIFEST])
        fsync_dir(store.root / name)
    problems = store.verify_record(store.manifest(name), {x.name for x in store.manifests(warn=False)},
                                   ranks=None if committed else ranks, checksums=checksums)
    if problems:
        if not committed:
            store.remove(name)
        for file in files:
            (store.root / name / file).unlink(missing_ok=True)
        raise CorruptCheckpoint(problems[0])
    return sorted(files)


@contextlib.contextmanager
def reading(url: str, endpoint: str | None = None,
            select: Callable[[Store], Iterable[str] | None] | None = None) -> Iterator[Store]:
    """The Store a reading command works on: --dir itself, or for an `s3://` URL a private copy
    of its manifests and, when `select` is given, of the records it picks from them (None: all)."""
    from . import is_remote

    if not is_remote(url):
        yield Store.existing(url)
        return
    tier = open_tier(url, endpoint)
    tier.probe(write=False)
    with tempfile.TemporaryDirectory(prefix="ckptrun-remote-") as tmp:
        store = Store(tmp, copy_of=url)
        mirror(tier, store.root, data=False, durable=False)
        if select is not None:
            picked = select(store)
            chosen = None if picked is None else list(picked)
            if chosen is None or chosen:
                _drop_manifests(store.root, chosen)
                mirror(tier, store.root, chosen, durable=False)
        yield store


def _drop_manifests(root: Path, names: Iterable[str] | None) -> None:
    """Forget the manifest-only copies of `names` (all when None), so `mirror` copies them whole."""
    for m in Path(root).glob(f"*/{MANIFEST}") if names is None else (Path(root) / n / MANIFEST for n in names):
        m.unlink(missing_ok=True)
