"""Retention on a checkpoint directory: committed records pruned beyond --keep, torn ones swept.

The only code that removes a committed record. It decides from what the read side lists
(`store_read.py`) and removes through the write side's refusals (`store_write.py`): nothing
is removed once the path names another directory than the one the run locked.
"""

from __future__ import annotations

import shutil
import time
from typing import TYPE_CHECKING

from ..errors import CkptrunError
from .fsutil import fsync_dir
from .schema import MANIFEST, Manifest, is_record_name
from .store_write import ABANDONED

if TYPE_CHECKING:
    from .store_read import RecordReader
    from .store_write import RecordWriter


class Retention:
    """Removes records of the directory `reader` lists; `writer` says whether the run still
    owns it (its claim) and removes uncommitted records safely (`abandon`)."""

    def __init__(self, reader: RecordReader, writer: RecordWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.root = reader.root

    def remove(self, name: str) -> None:
        """Unpublish (manifest first, so a crash never leaves a half-deleted committed record)."""
        rdir = self.root / name
        if not is_record_name(name) or rdir.is_symlink():
            raise CkptrunError(f"refusing to remove {rdir}: not a record directory")
        (rdir / MANIFEST).unlink(missing_ok=True)
        fsync_dir(rdir)
        shutil.rmtree(rdir, ignore_errors=True)

    def prune(self, keep: int, *, incomplete_grace_s: float = 60.0, protect: frozenset[str] = frozenset(),
              upto: int | None = None) -> list[str]:
        """Drop full checkpoints beyond the newest `keep` (0 keeps all) and what only they need.

        Runs after a commit: the newest committed record is never a candidate, and a record a
        kept one depends on is kept, as is one in `protect` (being copied to --durable). With
        `upto`, only records of steps up to it count (a node-local --dir: the newest step every
        node has committed), and every newer one is kept. Torn directories older than the newest
        commit go too.
        """
        self.writer.check_owned()
        ms = self.reader.manifests(warn=False)
        removed: list[str] = []
        if not ms:
            return removed
        counted = ms if upto is None else [m for m in ms if m.step <= upto]
        if keep > 0 and counted:
            kept = retained(counted, keep) | protect | {m.name for m in ms[len(counted):]}
            for m in ms:  # region slots are reused by their writer, never removed from here
                if m.name not in kept and m.layout != "region":
                    self.remove(m.name)
                    removed.append(m.name)
        newest = ms[-1].step
        for name in self.reader.incomplete():
            rdir = self.root / name
            last = int(name.split("-")[-1])
            if last < newest and time.time() - rdir.stat().st_mtime > incomplete_grace_s:
                shutil.rmtree(rdir, ignore_errors=True)
                removed.append(name)
        return removed

    def sweep_incomplete(self) -> list[str]:
        """Remove every record directory without a manifest. Only when no writer is left (the
        run is over), since a record being written has no manifest yet either."""
        if not self.writer.owned():
            return []
        names = self.reader.incomplete()
        for name in names:
            self.writer.abandon(name)
        for left in self.root.glob(f"{ABANDONED}*"):  # an abandon cut short by a kill
            if left.is_dir() and not left.is_symlink():
                shutil.rmtree(left, ignore_errors=True)
        return names


def retained(ms: list[Manifest], keep: int) -> set[str]:
    """The records retention keeps of `ms` (oldest first): the newest `keep` full checkpoints,
    what depends on them, the newest record, and the whole ancestry of each kept one."""
    fulls = [m for m in ms if m.kind == "full"]
    kept = {m.name for m in fulls[-keep:]}
    kept |= {m.name for m in ms if m.kind != "full" and set(m.depends_on) & kept}
    kept.add(ms[-1].name)
    for m in reversed(ms):  # newest first, so chains pull in their whole ancestry
        if m.name in kept:
            kept |= set(m.depends_on)
    return kept
