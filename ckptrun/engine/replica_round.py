"""One rendezvous round of --replicas (engine/replicate.py): its gloo group among the engines,
who this rank's partners are, and the wire a copy crosses: a header of sizes, the manifest and
index together, the data."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..errors import CorruptCheckpoint
from ..storage.schema import MAX_FILE_BYTES, MAX_METADATA_BYTES, MAX_WORLD_SIZE
from ..storage.tiers.group import ReplicationGroup
from .round_board import Board

SHIP, FETCH = 1, 2  # gloo tags: a new copy for a partner; a copy sent back to its owner
THIN, HELD = 1, 2  # a copy's flags: its data lacks the shared tensors; it is of a step held in memory only
FORM_TIMEOUT_S = 60.0  # the round's engines meeting (all of them start their worker after rendezvous)
SEND_TIMEOUT_S = 30.0  # one copy to one partner; past it the partner counts as stalled
STOP = -1  # a header that ends the partner's receiving thread (a new round begins)
HEADER = 5  # int64s of a copy's first message: owner, flags, bytes of its manifest (or header), data and index


class Round:
    """One rendezvous round's process group and who this rank exchanges copies with."""

    def __init__(self, spec: dict, rank: int, world_size: int) -> None:
        import torch.distributed as dist

        self.key, self.rank, self.world_size = spec["prefix"], rank, world_size
        self.group = ReplicationGroup(world_size // spec["local"], spec["local"], spec["replicas"], spec["jump"])
        self.partners = self.group.partners(rank)
        tcp = dist.TCPStore(spec["addr"], spec["port"], is_master=False,
                            timeout=timedelta(seconds=FORM_TIMEOUT_S))
        self.store = dist.PrefixStore(f"{spec['prefix']}/replicas", tcp)
        self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timedelta(seconds=FORM_TIMEOUT_S))
        self.live = set(self.partners)  # partners not (yet) found dead or stalled
        self.threads: list[threading.Thread] = []  # receiving partners' copies

    def board(self, name: str) -> Board:
        """Exchange `name`'s keys in the round's job store."""
        return Board(self.store, self.rank, self.world_size, name, FORM_TIMEOUT_S)

    def send(self, dst: int, tag: int, owner: int, blobs: list[bytes | bytearray], flags: int = 0) -> None:
        """Send one copy: `blobs` = [manifest, data file, index] of rank `owner`'s part, or
        [header, data, index] of a step it holds (`flags` HELD; THIN: its data lacks the shared
        tensors, storage/tiers/dpshared.py). Three messages, whatever its size: a header of
        sizes, the manifest and index together, the data (a per-step thin copy's messages cost
        the engines more CPU in gloo than its bytes do)."""
        import torch

        manifest, data, index = blobs
        head = torch.tensor([owner, flags, len(manifest), len(data), len(index)], dtype=torch.int64)
        for t in [head, _bytes_tensor(bytearray(manifest) + index), *([_bytes_tensor(data)] if data else [])]:
            self.pg.send([t], dst, tag).wait(timedelta(seconds=SEND_TIMEOUT_S))

    def stop(self, dst: int, tag: int = SHIP) -> None:
        """No (more) copies to `dst` on `tag`."""
        import torch

        head = torch.tensor([STOP, 0, 0, 0, 0], dtype=torch.int64)
        self.pg.send([head], dst, tag).wait(timedelta(seconds=2))

    def close(self) -> None:
        """End the group: receives still waiting (a partner that never said STOP) fail now, and
        their threads end, rather than abort the process at exit."""
        with contextlib.suppress(RuntimeError):
            self.pg.abort()
        for t in self.threads:
            t.join(timeout=5)

    def recv(self, src: int, tag: int, timeout: float | None = None,
             on_manifest: Callable[[bytes], None] | None = None) -> tuple[int, int, list[bytes]] | None:
        """(owner, flags, [manifest, data, index]) of the next copy from `src`; None: it said STOP.
        The sizes are checked before anything is allocated; `on_manifest` sees the manifest
        before the data is received."""
        import torch

        wait = timedelta(seconds=timeout) if timeout else timedelta(days=365)
        head = torch.empty(HEADER, dtype=torch.int64)
        self.pg.recv([head], src, tag).wait(wait)
        owner, flags, n_manifest, n_data, n_index = head.tolist()
        if owner == STOP:
            return None
        if not (0 <= owner < MAX_WORLD_SIZE and 0 <= flags <= THIN | HELD and 0 < n_manifest <= MAX_METADATA_BYTES
                and 0 < n_index <= MAX_METADATA_BYTES and 0 <= n_data <= MAX_FILE_BYTES):
            raise CorruptCheckpoint(f"rank {src} sent a copy header out of range ({head.tolist()})")
        meta = self._recv_bytes(src, tag, n_manifest + n_index, wait)
        manifest, index = meta[:n_manifest], meta[n_manifest:]
        if on_manifest is not None:
            on_manifest(manifest)
        return owner, flags, [manifest, self._recv_bytes(src, tag, n_data, wait), index]

    def _recv_bytes(self, src: int, tag: int, n: int, wait: timedelta) -> bytes:
        import torch

        if n == 0:
            return b""
        buf = torch.empty(n, dtype=torch.uint8)
        self.pg.recv([buf], src, tag).wait(wait)
        return bytearray(buf.numpy())  # (writable: lowdiff+'s copies step tensors over it)


def _bytes_tensor(b: bytes | bytearray) -> Any:
    """`b` as a uint8 tensor (a bytearray shared, not copied)."""
    import torch

    return torch.frombuffer(b if isinstance(b, bytearray) else bytearray(b), dtype=torch.uint8)

