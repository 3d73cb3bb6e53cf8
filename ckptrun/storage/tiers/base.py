"""One interface for every place a run's records live besides --dir's own writers.

A tier holds records in the checkpoint format unchanged: `<record>/<file>` objects (rank data,
rank index or rank file) and the record's commit object `<record>/MANIFEST.json`, written last
and only once every rank's part is there; removing a record takes the commit object first. A
tier knows objects, not checkpoints: `ls`, `verify`, `restore`, resume and retention read it
through `tiers.mirror` and `store_read`, the one reader, so they never learn which tier they read.

Its listing is untrusted input (DESIGN invariant 7): only keys of the form
`<record name>/<known file name>` with a size in range count; anything else is refused and said.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from ...errors import CorruptCheckpoint
from ..fsutil import FaultHook, _no_fault
from ..schema import MANIFEST, MARKER, MAX_FILE_BYTES, MAX_METADATA_BYTES, Manifest, checksum, is_record_name
from ..store_read import parse_manifest
from .source import Source

FILE_NAME = re.compile(r"MANIFEST\.json|rank-[0-9]{5}\.(data|json|ckpt)")
UploadFault = FaultHook  # called at "part" (a piece of a record is up), "commit", "committed"


class Tier(ABC):
    """A place that stores records as objects; see the module docstring."""

    url: str

    # ---- what each kind of tier implements ---------------------------------------------
    @abstractmethod
    def probe(self, write: bool = True) -> None:
        """Prove the tier is reachable (and writable, with `write`) now, or raise a one-line
        CkptrunError (exit 2)."""

    @abstractmethod
    def _list(self) -> list[tuple[str, int]]:
        """(key relative to the tier's root, size) of every object, as the store lists them."""

    @abstractmethod
    def put(self, key: str, src: Source, fault: UploadFault = _no_fault) -> None:
        """Store `src` at `key` whole or not at all (a reader never sees a part of it); `fault`
        is called at "part" after each piece of a large object is up."""

    @abstractmethod
    def get(self, key: str, dest: Path, size: int) -> None:
        """Copy the object at `key` (listed with `size` bytes) into the new file `dest`."""

    @abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Remove these objects (missing ones are no error), in the order given."""

    @abstractmethod
    def sweep_partial(self) -> int:
        """Abort or remove the unfinished uploads a dead writer left; returns how many."""

    # ---- what every tier shares --------------------------------------------------------
    def listing(self) -> tuple[dict[str, dict[str, int]], list[str]]:
        """({record: {file: size}}, refused keys): what the tier holds, names from the listing."""
        records: dict[str, dict[str, int]] = {}
        refused: list[str] = []
        for key, size in self._list():
            parts = key.split("/")
            if parts == [MARKER] or parts[-1].startswith(".probe-"):
                continue
            if (len(parts) != 2 or not is_record_name(parts[0]) or not FILE_NAME.fullmatch(parts[1])
                    or not 0 <= size <= MAX_FILE_BYTES
                    or (not parts[1].endswith((".data", ".ckpt")) and size > MAX_METADATA_BYTES)):
                refused.append(f"{key} ({size} bytes)")
                continue
            records.setdefault(parts[0], {})[parts[1]] = size
        return records, refused

    def committed(self) -> list[str]:
        """The records whose commit object is there, oldest first."""
        return sorted(name for name, files in self.listing()[0].items() if MANIFEST in files)

    def manifest(self, name: str, dest: Path) -> Manifest:
        """The checked commit object of `name`, copied to `dest` (a new file) on the way."""
        sizes = self.listing()[0].get(name, {})
        if MANIFEST not in sizes:
            raise CorruptCheckpoint(f"{name}: no commit object in {self.url}")
        self.get(f"{name}/{MANIFEST}", dest, sizes[MANIFEST])
        m = parse_manifest(dest.read_bytes(), name)
        if m.name != name:
            raise CorruptCheckpoint(f"{name}: manifest names another record ({m.name})")
        return m

    def publish_record(self, name: str, parts: list[list[tuple[str, Source]]], manifest: bytes, *,
                       fault: UploadFault = _no_fault, pool_map: Callable = map) -> None:
        """Write record `name`: every rank's part (data before index: the index makes a part
        count), `pool_map` running the parts (a thread pool's map uploads them in parallel),
        then the commit object, last. A failure anywhere leaves no commit object."""
        list(pool_map(lambda part: self.put_part(name, part, fault), parts))
        self.publish_commit(name, manifest, fault)

    def put_part(self, name: str, part: list[tuple[str, Source]], fault: UploadFault = _no_fault) -> None:
        """Upload one rank's part of record `name`, in order (data before index)."""
        for file, src in part:
            self.put(f"{name}/{file}", src, fault)
            fault("part")

    def publish_commit(self, name: str, manifest: bytes, fault: UploadFault = _no_fault) -> None:
        """The commit object of `name`: only once every rank's part is up (the caller knows)."""
        fault("commit")
        self.put(f"{name}/{MANIFEST}", Source.of_bytes(manifest, checksum(manifest), f"{name}: manifest"))
        fault("committed")

    @staticmethod
    def ranks_up(files: dict[str, int]) -> set[int]:
        """The ranks whose part is complete among a record's listed `files`: its index (a rank
        file, or an index, which goes up after the data)."""
        return {int(f[5:10]) for f in files if f.endswith((".json", ".ckpt")) and f != MANIFEST}

    def remove_record(self, name: str, files: list[str]) -> None:
        """Unpublish `name`: its commit object first, so no reader ever sees a half-deleted record."""
        self.delete([f"{name}/{f}" for f in [MANIFEST, *sorted(set(files) - {MANIFEST})]])

    def sweep(self) -> tuple[int, list[str]]:
        """At the start of a run (the only writer): abort dead uploads and remove every record
        without a commit object. Returns (uploads aborted, records removed)."""
        aborted = self.sweep_partial()
        records, _ = self.listing()
        torn = sorted(name for name, files in records.items() if MANIFEST not in files)
        for name in torn:
            self.remove_record(name, list(records[name]))
        return aborted, torn
