"""One run's checkpoint directory, as one object composed of its parts.

- `store_read.RecordReader`: the read side, the one gate every reader of the directory goes
  through (it is untrusted input, DESIGN invariant 7): listing, manifests, rank indexes, and the
  descriptor of each rank's data after every check (`open_rank`).
- `store_tensors`: tensor bytes read through that descriptor and checked (`read_rank`, restore;
  `verify_record`, verify).
- `store_write.RecordWriter`: the write side, rank parts published and records committed
  (DESIGN invariant 2: a manifest only once every rank's part is durable).
- `retention.Retention`: pruning beyond --keep, and sweeping torn records.

`Store` holds one of each and gives their methods under their own names, so a caller holds one
object; new code may take the part it needs instead. The format's names are re-exported here.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CkptrunError
from .retention import Retention, retained
from .schema import FORMAT, MANIFEST, MARKER, Manifest, checksum, diff_name, full_name, rank_files
from .store_read import RecordReader
from .store_tensors import read_rank, verify_record
from .store_write import RecordWriter, WrittenPart, rank_index

if TYPE_CHECKING:
    from .dirlock import Claim

__all__ = ["FORMAT", "MANIFEST", "MARKER", "Manifest", "Store", "WrittenPart", "checksum", "diff_name", "full_name",
           "rank_files", "rank_index", "retained"]


class Store:
    """One run's checkpoint directory (see the module docstring). With `claim` (a run's,
    storage/dirlock.py), nothing is written or removed once the path names another directory
    than the one the run locked: a write, commit or retention raises DirectoryReplaced (an
    OSError), a removal of uncommitted parts does nothing."""

    def __init__(self, root: str | os.PathLike, copy_of: str | None = None, *, claim: Claim | None = None) -> None:
        self.reader = read = RecordReader(root, copy_of)
        self.writer = write = RecordWriter(read, claim)
        self.retention = keep = Retention(read, write)
        self.root = read.root
        self.copy_of = copy_of
        self.claim = claim
        self.regions = read.regions
        # the read side: the gate
        self.is_committed = read.is_committed
        self.ranks_present = read.ranks_present
        self.incomplete = read.incomplete
        self.manifest = read.manifest
        self.manifests = read.manifests
        self.unreadable = read.unreadable
        self.part_summary = read.part_summary
        self.index_bytes = read.index_bytes
        self.read_index = read.read_index
        self.ranks_held = read.ranks_held
        self.partial = read.partial
        self.open_rank = read.open_rank
        self.read_rank = partial(read_rank, read)
        self.verify_record = partial(verify_record, read)
        # the write side
        self.owned = write.owned
        self.check_owned = write.check_owned
        self.ensure_writable = write.ensure_writable
        self.write_rank = write.write_rank
        self.begin_rank_file = write.begin_rank_file
        self.discard_rank = write.discard_rank
        self.mark_failed = write.mark_failed
        self.failed_ranks = write.failed_ranks
        self.abandon = write.abandon
        self.try_commit = write.try_commit
        self.adopt_manifest = write.adopt_manifest
        # retention
        self.remove = keep.remove
        self.prune = keep.prune
        self.sweep_incomplete = keep.sweep_incomplete

    @property
    def where(self) -> str:
        """What messages call this directory: the URL of the tier it copies, else its path."""
        return self.reader.where

    @classmethod
    def existing(cls, root: str | os.PathLike) -> Store:
        """The directory a reading command (ls, verify, restore) works on; an error if absent."""
        if not Path(root).is_dir():
            raise CkptrunError(f"no checkpoint directory at {root}; pass --dir", exit_code=2)
        return cls(root)
