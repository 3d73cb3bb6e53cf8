"""The slotted-region layout: one preallocated file per rank, checkpoints written into reused
slots, committed by moving a pointer (pccheck.txt §4.1, with the commit order of DESIGN §5).

File `region-rRRRRR-gGGGG.ckpt` (rank R, generation G: a checkpoint that outgrows the slots
starts a bigger generation):

    [0, 4 KiB)             superblock: JSON geometry + checksum, written once at creation
    [4 KiB, 4 KiB + 1 KiB) two pointer copies (counter, slot, step, checksum); the valid copy
                           with the larger counter is the pointer, so a torn pointer write
                           leaves the previous pointer readable
    nslots × meta_bytes    per-slot metadata: state, counter, step and the rank's index (the
                           same JSON as a record directory's rank-NNNNN.json), checksummed
    nslots × slot_bytes    tensor data, 4 KiB-aligned

Writer call order for one checkpoint (`RegionWriter`): `acquire()` a slot (never the one the
pointer names) -> `invalidate(slot)` (its old metadata stops counting, durably) -> `write(slot,
offset, bytes)` from any number of threads -> `sync()` (data durable) -> `write_meta(slot,
...)` (durable) -> `publish(counter, slot, step)`: the pointer moves only forward (compare on
the counter under a lock, one writer process per file), written then made durable -> the
caller `release`s the slot that stopped being needed. A reader counts a slot committed when
its metadata is complete and its step is at most the pointer's step; a step is committed for
the run when every rank holds it (`Regions`).
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import CorruptCheckpoint
from .fsutil import open_regular
from .iowriter import OutFile, open_out
from .layout import ALIGN, align
from .schema import FORMAT, MAX_METADATA_BYTES, MAX_STEP, MAX_WORLD_SIZE, Manifest, checksum, full_name

REGION_FILE = re.compile(r"region-r([0-9]{5})-g([0-9]{4})\.ckpt")
SUPER_BYTES = 4096
POINTER_AT, POINTER_BYTES = 4096, 512
META_AT = 8192
MAX_SLOTS = 1024
_POINTER = struct.Struct("<8sQQQ")  # magic, counter, slot, step
_POINTER_MAGIC = b"CKPTPTR1"
_META_HEAD = struct.Struct("<8sQ")  # magic, JSON length
_META_MAGIC = b"CKPTSLT1"


def region_name(rank: int, generation: int) -> str:
    return f"region-r{rank:05d}-g{generation:04d}.ckpt"


@dataclass(frozen=True)
class Geometry:
    nslots: int
    slot_bytes: int
    meta_bytes: int

    def meta_at(self, slot: int) -> int:
        return META_AT + slot * self.meta_bytes

    def data_at(self, slot: int) -> int:
        return align(META_AT + self.nslots * self.meta_bytes) + slot * self.slot_bytes

    @property
    def file_bytes(self) -> int:
        return self.data_at(self.nslots)

    def check(self) -> Geometry:
        if not (1 <= self.nslots <= MAX_SLOTS and 0 < self.slot_bytes and self.slot_bytes % ALIGN == 0
                and _META_HEAD.size < self.meta_bytes <= MAX_METADATA_BYTES and self.meta_bytes % ALIGN == 0):
            raise CorruptCheckpoint(f"region geometry out of range: {self}")
        return self


@dataclass(frozen=True)
class Pointer:
    counter: int  # 0: nothing published yet
    slot: int
    step: int


NO_POINTER = Pointer(0, 0, 0)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        offset, view = offset + n, view[n:]


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise CorruptCheckpoint(f"region file ends at {offset + len(data)}, inside its own geometry")
    return data


def _same_file(out: OutFile, fd: int) -> OutFile:
    """`out`, opened by path, if it writes the file `fd` is open on (else the path was swapped)."""
    if not os.path.samestat(os.fstat(out.fd), os.fstat(fd)):
        out.close()
        raise CorruptCheckpoint(f"{out.path} was replaced while it was created")
    return out


def _encode_pointer(p: Pointer) -> bytes:
    body = _POINTER.pack(_POINTER_MAGIC, p.counter, p.slot, p.step)
    return body + bytes.fromhex(checksum(body))


def _decode_pointer(raw: bytes, geometry: Geometry) -> Pointer | None:
    body, stored = raw[: _POINTER.size], raw[_POINTER.size : _POINTER.size + 8]
    if stored != bytes.fromhex(checksum(body)):
        return None
    magic, counter, slot, step = _POINTER.unpack(body)
    if magic != _POINTER_MAGIC or slot >= geometry.nslots or step >= MAX_STEP:
        return None
    return Pointer(counter, slot, step)


# ---- reading (untrusted input: DESIGN invariant 7) ------------------------------------------
class RegionFile:
    """One region file opened for reading: every field checked before it is used."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd, self.name = fd, name
        head = os.pread(fd, SUPER_BYTES, 0)
        try:
            length = int.from_bytes(head[:4], "little")
            if length > SUPER_BYTES - 20:
                raise ValueError
            body, stored = head[4 : 4 + length], head[4 + length : 4 + length + 16].decode()
            if checksum(body) != stored:
                raise CorruptCheckpoint(f"{name}: superblock checksum mismatch")
            sb = json.loads(body)
            self.rank, self.generation = int(sb["rank"]), int(sb["generation"])
            self.geometry = Geometry(int(sb["nslots"]), int(sb["slot_bytes"]), int(sb["meta_bytes"])).check()
            if sb["format"] != FORMAT or sb["magic"] != "ckptrun-region":
                raise ValueError
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
            raise CorruptCheckpoint(f"{name}: not a ckptrun region superblock") from None
        m = REGION_FILE.fullmatch(name)
        if m is None or (int(m[1]), int(m[2])) != (self.rank, self.generation):
            raise CorruptCheckpoint(f"{name}: superblock names rank {self.rank} generation {self.generation}")
        size = os.fstat(fd).st_size
        if size < self.geometry.file_bytes:
            raise CorruptCheckpoint(f"{name}: {size} bytes, its geometry needs {self.geometry.file_bytes} (truncated)")

    def pointer(self) -> Pointer:
        """The valid pointer copy with the larger counter (NO_POINTER if neither is valid)."""
        return self.pointer_copy()[0]

    def pointer_copy(self) -> tuple[Pointer, int]:
        """(pointer, index of the copy holding it; -1 if none)."""
        raw = _pread_exact(self.fd, 2 * POINTER_BYTES, POINTER_AT)
        copies = [(_decode_pointer(raw[i * POINTER_BYTES :], self.geometry), i) for i in (0, 1)]
        return max(((p, i) for p, i in copies if p is not None), key=lambda c: c[0].counter,
                   default=(NO_POINTER, -1))

    def slot_meta(self, slot: int) -> tuple[dict, bytes] | None:
        """(metadata, raw index JSON) of a complete slot; None for a free, torn or foreign one."""
        g = self.geometry
        head = _pread_exact(self.fd, _META_HEAD.size, g.meta_at(slot))
        magic, length = _META_HEAD.unpack(head)
        if magic != _META_MAGIC or length > g.meta_bytes - _META_HEAD.size - 16:
            return None
        raw = _pread_exact(self.fd, length + 16, g.meta_at(slot) + _META_HEAD.size)
        body, stored = raw[:length], raw[length:]
        if stored != checksum(body).encode():
            return None
        try:
            meta = json.loads(body)
            index_raw = meta["index"].encode()
            float(meta.get("written_at", 0.0))
            ok = (meta["state"] == "complete" and meta["slot"] == slot and isinstance(meta["step"], int)
                  and 0 <= meta["step"] < MAX_STEP and isinstance(meta["world_size"], int)
                  and 1 <= meta["world_size"] <= MAX_WORLD_SIZE and isinstance(meta["data_nbytes"], int)
                  and 0 <= meta["data_nbytes"] <= g.slot_bytes and isinstance(meta["counter"], int))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError):
            return None
        return (meta, index_raw) if ok else None

    def close(self) -> None:
        os.close(self.fd)


@dataclass(frozen=True)
class SlotCopy:
    """Where one rank's part of a committed region step lies."""

    file: str
    slot: int
    meta_offset: int
    data_offset: int
    data_nbytes: int
    index_raw: bytes


def _open_region(root: Path, name: str) -> RegionFile:
    fd = open_regular(root / name, f"{name}:")
    try:
        return RegionFile(fd, name)
    except CorruptCheckpoint:
        os.close(fd)
        raise


class Regions:
    """The committed steps held in a directory's region files, as manifests (layout "region")."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.where: dict[str, dict[int, SlotCopy]] = {}  # record name -> rank -> its copy

    def files(self) -> list[str]:
        if not self.root.is_dir():
            return []
        with os.scandir(self.root) as it:
            return sorted(e.name for e in it if REGION_FILE.fullmatch(e.name))

    def scan(self) -> tuple[list[Manifest], dict[str, str]]:
        """(committed steps, {file: problem}): a step is committed when every rank holds it in a
        complete slot at or below that rank's pointer; torn or foreign slots are not counted."""
        per_rank: dict[int, dict[int, tuple[SlotCopy, dict]]] = {}
        bad: dict[str, str] = {}
        for name in self.files():
            try:
                region = _open_region(self.root, name)
            except CorruptCheckpoint as e:
                bad[name] = str(e)
                continue
            try:
                ptr = region.pointer()
                for slot in range(region.geometry.nslots):
                    found = region.slot_meta(slot)
                    if found is None or ptr.counter == 0 or found[0]["step"] > ptr.step:
                        continue
                    meta, index_raw = found
                    copy = SlotCopy(name, slot, region.geometry.meta_at(slot), region.geometry.data_at(slot),
                                    meta["data_nbytes"], index_raw)
                    held = per_rank.setdefault(region.rank, {})
                    order = (region.generation, meta["counter"])  # counters restart in each generation
                    if meta["step"] not in held or held[meta["step"]][1]["_order"] < order:
                        held[meta["step"]] = (copy, {**meta, "_order": order})
            except CorruptCheckpoint as e:
                bad[name] = str(e)
            finally:
                region.close()
        self.where = {}
        manifests = []
        for step, (_, meta0) in sorted(per_rank.get(0, {}).items()):
            ws = meta0["world_size"]
            copies = {r: per_rank.get(r, {}).get(step) for r in range(ws)}
            if any(c is None or c[1]["world_size"] != ws for c in copies.values()):
                continue
            try:
                sizes = [copies[r][0].data_nbytes for r in range(ws)]
                m = Manifest(full_name(step), "full", step, step, ws, sum(sizes),
                             [], meta0.get("meta", {}), {str(r): checksum(c.index_raw) for r, (c, _) in copies.items()},
                             float(meta0.get("written_at", 0.0)), layout="region", rank_bytes=sizes)
            except (ValueError, TypeError, OverflowError) as e:
                bad[full_name(step)] = f"region step {step}: {e}"
                continue
            manifests.append(m)
            self.where[m.name] = {r: c for r, (c, _) in copies.items()}
        return manifests, bad

    def copy(self, m: Manifest, rank: int) -> SlotCopy:
        if m.name not in self.where:
            self.scan()
        try:
            return self.where[m.name][rank]
        except KeyError:
            raise CorruptCheckpoint(f"{m.name}: no committed region slot of rank {rank} (reused since?)") from None

    def open_data(self, m: Manifest, rank: int, data_nbytes: int) -> tuple[int, int]:
        """(descriptor, offset) of rank `rank`'s bytes of `m` in its region file."""
        c = self.copy(m, rank)
        if data_nbytes != c.data_nbytes:
            raise CorruptCheckpoint(f"{m.name}: rank {rank} slot holds {c.data_nbytes} bytes, its index says "
                                    f"{data_nbytes}")
        region = _open_region(self.root, c.file)
        return region.fd, c.data_offset


# ---- writing (the engine of one rank) -------------------------------------------------------
class RegionWriter:
    """One rank's region file, created and written by that rank's engine only. The slot the
    pointer names is never handed out by `acquire`."""

    def __init__(self, root: Path, rank: int, generation: int, geometry: Geometry, *, direct: bool = False) -> None:
        """`direct`: no process maps the file (pccheck's; lightcheck's unless --copy-to region),
        so its data goes through the engine's file writer (storage/iowriter.py: with the native
        one, O_DIRECT: no copy into the page cache and no writeback of it, half the engine's CPU
        at every step); else through the page cache, coherent with the mappings."""
        self.root, self.rank, self.generation, self.geometry = root, rank, generation, geometry.check()
        self.path = root / region_name(rank, generation)
        self._lock = threading.Condition()
        self.pointer, self._copy = NO_POINTER, -1  # the pointer and the copy holding it
        self.steps: dict[int, int] = {}  # slot -> step it holds complete (committed or not)
        self.free: list[int] = list(range(geometry.nslots))
        self.users = 0  # jobs writing into this file (its owner retires it only at zero)
        self._map: mmap.mmap | None = None
        self._out: OutFile | None = None  # `direct`: the data's writer
        tmp = root / f".{self.path.name}.tmp-{os.getpid()}"
        self.fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            self._create()
            if direct:
                self._out = _same_file(open_out(tmp, existing=True), self.fd)
            os.rename(tmp, self.path)  # whole and durable, or absent
            from .fsutil import fsync_dir

            fsync_dir(root)
        except BaseException:
            self.close()
            tmp.unlink(missing_ok=True)
            raise

    def _create(self) -> None:
        """Allocate the whole file once (fallocate), superblock and empty pointers, durably."""
        g = self.geometry
        try:
            os.posix_fallocate(self.fd, 0, g.file_bytes)
        except OSError as e:
            if e.errno not in (95, 22):  # EOPNOTSUPP/EINVAL (e.g. tmpfs quirks): a sparse file still works
                raise
            os.ftruncate(self.fd, g.file_bytes)
        body = json.dumps({"magic": "ckptrun-region", "format": FORMAT, "rank": self.rank,
                           "generation": self.generation, "nslots": g.nslots, "slot_bytes": g.slot_bytes,
                           "meta_bytes": g.meta_bytes}).encode()
        _pwrite_all(self.fd, len(body).to_bytes(4, "little") + body + checksum(body).encode(), 0)
        _pwrite_all(self.fd, bytes(2 * POINTER_BYTES), POINTER_AT)
        for slot in range(g.nslots):
            _pwrite_all(self.fd, bytes(_META_HEAD.size), g.meta_at(slot))
        os.fsync(self.fd)

    @classmethod
    def existing(cls, root: Path, name: str) -> RegionWriter:
        """Reopen a region file written by an earlier engine of this rank, to retire it: its
        complete slots and pointer as the file says (nothing new is written into it)."""
        region = _open_region(root, name)
        try:
            self = cls.__new__(cls)
            self.root, self.rank, self.generation, self.geometry = root, region.rank, region.generation, region.geometry
            self.path = root / name
            self._lock = threading.Condition()
            self.pointer, self._copy = region.pointer_copy()
            self.users = 0
            self._map, self._out = None, None
            self.steps = {}
            for slot in range(region.geometry.nslots):
                found = region.slot_meta(slot)
                if found is not None and self.pointer.counter and found[0]["step"] <= self.pointer.step:
                    self.steps[slot] = found[0]["step"]
            self.free = []
            self.fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            return self
        finally:
            region.close()

    @property
    def direct(self) -> bool:
        """Whether the data bypasses the page cache through the engine's writer (`__init__`)."""
        return self._out is not None

    def view(self, slot: int) -> memoryview:
        """The slot's data bytes, mapped read-only (for slots filled through another mapping of
        this file, e.g. a trainer copying straight into it)."""
        if self._map is None:
            self._map = mmap.mmap(self.fd, self.geometry.file_bytes, prot=mmap.PROT_READ)
        at = self.geometry.data_at(slot)
        return memoryview(self._map)[at : at + self.geometry.slot_bytes]

    def read_meta(self, slot: int) -> tuple[dict, bytes] | None:
        """(metadata, raw index) of a complete slot, read back from the file."""
        fd = os.dup(self.fd)
        try:
            region = RegionFile(fd, self.path.name)
        except BaseException:
            os.close(fd)
            raise
        try:
            return region.slot_meta(slot)
        finally:
            region.close()

    def fits(self, data_nbytes: int, meta_nbytes: int) -> bool:
        g = self.geometry
        return data_nbytes <= g.slot_bytes and meta_nbytes + _META_HEAD.size + 16 <= g.meta_bytes

    # ---- slots ---------------------------------------------------------------------------
    def acquire(self, timeout: float | None = None) -> int | None:
        """A free slot (waiting for one to be released), never the pointer's."""
        with self._lock:
            if not self._lock.wait_for(lambda: self.free, timeout):
                return None
            return self.free.pop(0)

    def release(self, slot: int) -> None:
        """Return a slot to the free queue; a step it held stops being listed (durably) first.
        Never the pointer's slot (the latest checkpoint)."""
        with self._lock:
            if self.pointer.counter and slot == self.pointer.slot:
                raise RuntimeError(f"region slot {slot} holds the latest checkpoint; it is never freed")
            if self.steps.pop(slot, None) is not None:
                self.invalidate(slot)
            if slot not in self.free:
                self.free.append(slot)
            self._lock.notify_all()

    def invalidate(self, slot: int) -> None:
        """The slot's previous contents stop counting before any byte of them is overwritten."""
        _pwrite_all(self.fd, bytes(_META_HEAD.size), self.geometry.meta_at(slot))
        os.fdatasync(self.fd)

    def write(self, slot: int, offset: int, data: memoryview) -> None:
        if offset + len(data) > self.geometry.slot_bytes:
            raise ValueError(f"write of {len(data)} bytes at {offset} overflows a {self.geometry.slot_bytes}-byte slot")
        at = self.geometry.data_at(slot) + offset
        if self._out is not None:
            self._out.write_at(data, at)
        else:
            _pwrite_all(self.fd, data, at)

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def write_meta(self, slot: int, *, counter: int, step: int, world_size: int, data_nbytes: int,
                   index_raw: bytes, meta: dict, written_at: float) -> None:
        body = json.dumps({"state": "complete", "slot": slot, "counter": counter, "step": step,
                           "world_size": world_size, "data_nbytes": data_nbytes, "meta": meta,
                           "written_at": written_at, "index": index_raw.decode()}).encode()
        if len(body) + _META_HEAD.size + 16 > self.geometry.meta_bytes:
            raise ValueError(f"slot metadata of {len(body)} bytes exceeds {self.geometry.meta_bytes}")
        _pwrite_all(self.fd, _META_HEAD.pack(_META_MAGIC, len(body)) + body + checksum(body).encode(),
                    self.geometry.meta_at(slot))
        os.fdatasync(self.fd)
        with self._lock:
            self.steps[slot] = step

    def publish(self, counter: int, slot: int, step: int) -> tuple[bool, Pointer]:
        """Compare-and-swap on the counter: move the pointer to (counter, slot, step) if that is
        newer than the pointer, durably. Returns (moved, the pointer before)."""
        with self._lock:
            before = self.pointer
            if counter <= before.counter:
                return False, before
            new = Pointer(counter, slot, step)
            target = 1 - self._copy if self._copy >= 0 else 0  # never the copy holding the pointer
            _pwrite_all(self.fd, _encode_pointer(new), POINTER_AT + target * POINTER_BYTES)
            os.fdatasync(self.fd)
            self.pointer, self._copy = new, target
            if before.counter and before.slot != slot and before.slot not in (*self.steps, *self.free):
                self.free.append(before.slot)  # emptied by `retract` while the pointer named it
                self._lock.notify_all()
            return True, before

    def retract(self, newest: int, counter: int) -> list[int]:
        """Steps after `newest` stop counting and their slots go back to the free queue (a restart
        abandoned them, uncommitted). The pointer's bound moves back to `newest` first, durably,
        naming newest's slot if this file holds it; a retracted slot the pointer still names is
        emptied and freed once the pointer moves on. The steps retracted."""
        with self._lock:
            gone = {slot: step for slot, step in self.steps.items() if step > newest}
            if not gone:
                return []
            if self.pointer.counter and self.pointer.step > newest:
                home = next((slot for slot, step in self.steps.items() if step == newest), self.pointer.slot)
                self.publish(max(counter, self.pointer.counter + 1), home, max(newest, 0))
            for slot in gone:
                del self.steps[slot]
                self.invalidate(slot)
                if slot != self.pointer.slot and slot not in self.free:
                    self.free.append(slot)
            self._lock.notify_all()
            return sorted(gone.values())

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still held somewhere: the mapping goes with it
                pass
        if self._out is not None:
            self._out.close()
        os.close(self.fd)
