"""The replicated memory tier: partners' parts of committed records, held in an engine's memory.

The same objects as every tier (`<record>/rank-NNNNN.*` and the record's `MANIFEST.json`) in a
dict instead of a store, so a held copy is read back through `mirror.fill` and `Store` like any
tier. Each part is checked as it arrives (`Source`: the index against the manifest's checksum,
every tensor against the index's), so a copy is held only complete and intact; `hold` keeps one
record per partner rank, the newest, which bounds an engine's memory to K-1 parts. A thin copy
(the data-parallel short-cut, dpshared.py) is checked as far as it goes and held thin.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import CorruptCheckpoint
from ..fsutil import _no_fault
from ..schema import Manifest, rank_files
from ..store_read import parse_manifest
from .base import MANIFEST, Tier, UploadFault
from .dpshared import copy_spans, parse
from .source import Source


class MemoryTier(Tier):
    """Objects in memory; see the module docstring."""

    def __init__(self, url: str = "memory") -> None:
        self.url = url
        self.objects: dict[str, bytes] = {}
        self.owners: dict[int, tuple[str, int]] = {}  # partner rank -> (record held, its step)
        self.thin: set[int] = set()  # partner ranks whose copy is held less their shared tensors

    def probe(self, write: bool = True) -> None:
        """Memory is always there."""

    def _list(self) -> list[tuple[str, int]]:
        return [(key, len(data)) for key, data in self.objects.items()]

    def put(self, key: str, src: Source, fault: UploadFault = _no_fault) -> None:
        self.objects[key] = src.checked()

    def get(self, key: str, dest: Path, size: int) -> None:
        data = self.objects[key]
        if len(data) != size:
            raise CorruptCheckpoint(f"{self.url}: {key} changed while read")
        dest.write_bytes(data)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self.objects.pop(key, None)

    def sweep_partial(self) -> int:
        return 0  # `put` stores an object whole or not at all

    def hold(self, owner: int, manifest: bytes, files: dict[str, bytes], *, thin: bool = False) -> Manifest | None:
        """Check and keep rank `owner`'s part (`files`) of the record `manifest` commits, in place
        of the one held for it before, unless that one is of the same step or a newer one (then
        None); CorruptCheckpoint (nothing kept) if any check fails. `thin`: its data file lacks
        the tensors its index names as shared (dpshared.py)."""
        m = parse_manifest(manifest, f"rank {owner}'s copy")
        old = self.owners.get(owner)
        if old is not None and old[1] >= m.step:
            return None
        index_file, data_file = rank_files(owner)[1], rank_files(owner)[0]
        if set(files) != {index_file, data_file} or str(owner) not in m.index_checksums:
            raise CorruptCheckpoint(f"{m.name}: rank {owner}'s copy holds {sorted(files)}")
        raw = files[index_file]
        what = f"{m.name}: rank {owner}'s copy"
        index = parse(raw, what)
        if (index.record, index.rank) != (m.name, owner):
            raise CorruptCheckpoint(f"{what}: its index is rank {index.rank}'s of {index.record}")
        spans, size = copy_spans(index, thin)
        if len(files[data_file]) != size:
            raise CorruptCheckpoint(f"{what}: its data is {len(files[data_file]):,} bytes, its index says {size:,}")
        part = [(data_file, Source.of_buffer(files[data_file], spans, what)),
                (index_file, Source.of_bytes(raw, m.index_checksums[str(owner)], f"{what} index"))]
        self.publish_record(m.name, [part], manifest)
        self.owners[owner] = (m.name, m.step)
        (self.thin.add if thin else self.thin.discard)(owner)
        if old is not None:
            self.drop(owner, old[0])
        return m

    def drop(self, owner: int, name: str) -> None:
        """Forget `owner`'s part of `name` (and the record's manifest, once no part is left)."""
        self.delete([f"{name}/{f}" for f in rank_files(owner)])
        if not any(k.startswith(f"{name}/rank-") for k in self.objects):
            self.delete([f"{name}/{MANIFEST}"])

    def forget(self, owner: int) -> None:
        """Let the copy held for `owner` go."""
        held = self.owners.pop(owner, None)
        if held is not None:
            self.drop(owner, held[0])
        self.thin.discard(owner)

    def part(self, owner: int) -> tuple[bytes, dict[str, bytes]] | None:
        """(manifest, files) of the copy held for `owner`, as `hold` takes them; None: none held."""
        if owner not in self.owners:
            return None
        name = self.owners[owner][0]
        return self.objects[f"{name}/{MANIFEST}"], {f: self.objects[f"{name}/{f}"] for f in rank_files(owner)}

