"""The bytes of one object a tier is given, read in order and checked as they stream out.

A tier is handed a `Source`, never a path: the bytes come from an open descriptor (a record's
data file, a region slot, a rank file) or from memory (an index), and the per-tensor xxh3 of the
rank's index are recomputed over exactly the bytes sent. A slot reused or a file changed while it
was read fails `check()`, and its record is never published (checksums end to end).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import xxhash

from ...errors import CorruptCheckpoint

CHECK_CHUNK = 8 << 20  # bytes hashed at a time by `checked`


@dataclass(frozen=True)
class Span:
    """`nbytes` bytes at `offset` (of the source) whose xxh3 must be `xxh3`."""

    offset: int
    nbytes: int
    xxh3: str


@dataclass
class Source:
    """`nbytes` bytes given by `read(offset, n)`; `spans` sorted and disjoint; `what` names it."""

    read: Callable[[int, int], bytes | memoryview]
    nbytes: int
    spans: list[Span]
    what: str
    whole: bytes | None = None  # all of it, where it is one immutable buffer in memory already
    _hashes: list = field(default_factory=list)
    _next: int = 0

    @classmethod
    def of_bytes(cls, data: bytes, xxh3: str, what: str) -> Source:
        return cls.of_buffer(data, [Span(0, len(data), xxh3)], what)

    @classmethod
    def of_buffer(cls, data: bytes | bytearray, spans: list[Span], what: str) -> Source:
        view = memoryview(data)  # chunks are views: nothing is copied to be checked
        return cls(lambda off, n: view[off : off + n], len(data), sorted(spans, key=lambda s: s.offset), what,
                   data if isinstance(data, bytes) else None)

    def checked(self) -> bytes:
        """All of it, once every span hashed right: `whole` itself where there is one (no copy)."""
        if self.whole is None:
            return b"".join(self.chunks(CHECK_CHUNK))
        for _ in self.chunks(CHECK_CHUNK):
            pass
        return self.whole

    @classmethod
    def of_fd(cls, fd: int, base: int, nbytes: int, spans: list[Span], what: str) -> Source:
        return cls(lambda off, n: os.pread(fd, n, base + off), nbytes, sorted(spans, key=lambda s: s.offset), what)

    def chunks(self, size: int) -> Iterator[bytes]:
        """All the bytes, in order, `size` at a time; each passes through the span hashes."""
        self._hashes, self._next = [xxhash.xxh3_64() for _ in self.spans], 0
        pos = 0
        while pos < self.nbytes:
            b = self.read(pos, min(size, self.nbytes - pos))
            if not b:
                raise CorruptCheckpoint(f"{self.what} shrank while it was read")
            self._feed(pos, b)
            pos += len(b)
            yield b
        self.check()

    def _feed(self, pos: int, b: bytes) -> None:
        end = pos + len(b)
        i = self._next
        while i < len(self.spans) and self.spans[i].offset < end:
            s = self.spans[i]
            lo, hi = max(s.offset, pos), min(s.offset + s.nbytes, end)
            if hi > lo:
                self._hashes[i].update(b[lo - pos : hi - pos])
            if s.offset + s.nbytes > end:
                break
            i += 1
        self._next = i

    def check(self) -> None:
        """CorruptCheckpoint unless every span hashed to its xxh3 (all bytes have been read)."""
        for s, h in zip(self.spans, self._hashes, strict=True):
            if h.hexdigest() != s.xxh3:
                raise CorruptCheckpoint(f"{self.what}: bytes at {s.offset} changed while uploaded (checksum)")
