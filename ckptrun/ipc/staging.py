"""Preallocated staging slots shared by a worker and its engine.

A slot is a file in shared memory (/dev/shm) that the engine creates and owns, so its bytes
outlive a crashed worker; the worker maps it as a flat uint8 tensor and copies state into it.
On a GPU the worker page-locks its mapping so device-to-host copies run asynchronously.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path


def shm_root() -> Path:
    root = Path("/dev/shm")
    return root if root.is_dir() and os.access(root, os.W_OK) else Path(tempfile.gettempdir())


def create_slot(path: Path, nbytes: int) -> None:
    """Create (or resize) a slot file; the engine's job."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, max(nbytes, 1))
    finally:
        os.close(fd)


class EngineSlot:
    """The engine's read view of a slot."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path, self.nbytes = path, nbytes
        create_slot(path, nbytes)
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        self.view = memoryview(self._map)

    def close(self, unlink: bool = True) -> None:
        self.view.release()
        self._map.close()
        if unlink:
            self.path.unlink(missing_ok=True)


def map_slot(path: str, nbytes: int, pin: bool = False):
    """The worker's view: a flat uint8 tensor over the slot file (page-locked if `pin`)."""
    import torch

    buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    if pin and torch.cuda.is_available():
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of staging slot failed with CUDA error {int(err)}")
    return buf
