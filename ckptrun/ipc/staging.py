"""Preallocated staging slots shared by a worker and its engine.

A slot is a file in shared memory (/dev/shm, or CKPTRUN_STAGING_DIR: a container's /dev/shm is
often too small) that the engine creates and owns, so its bytes
outlive a crashed worker; the worker maps it as a flat uint8 tensor and copies state into it.
On a GPU the worker page-locks its mapping so device-to-host copies run asynchronously; it
faults the mapping in and page-locks it off the training thread (ckptrun/worker/slots.py).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UsageError

if TYPE_CHECKING:
    import torch

ENV = "CKPTRUN_STAGING_DIR"


def shm_root() -> Path:
    """Where staging files live: CKPTRUN_STAGING_DIR when set, else /dev/shm where writable, else
    the temporary folder."""
    if chosen := os.environ.get(ENV):
        root = Path(chosen)
        if not (root.is_dir() and os.access(root, os.W_OK)):
            raise UsageError(f"{ENV}={chosen} is not a writable folder; create it (a tmpfs mount keeps "
                             "staging in memory) or unset it")
        return root
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


# The CUDA runtime's errors that page-locking host memory can meet (cudaError_t values), by name.
CUDA_ERRORS = {1: "cudaErrorInvalidValue", 2: "cudaErrorMemoryAllocation", 3: "cudaErrorInitializationError",
               46: "cudaErrorDevicesUnavailable", 100: "cudaErrorNoDevice", 101: "cudaErrorInvalidDevice",
               304: "cudaErrorOperatingSystem", 712: "cudaErrorHostMemoryAlreadyRegistered",
               713: "cudaErrorHostMemoryNotRegistered", 801: "cudaErrorNotSupported", 999: "cudaErrorUnknown"}


def cuda_error(code: int, text: str = "") -> str:
    """A CUDA error by name and number, with the runtime's own `text` if any."""
    name = CUDA_ERRORS.get(code, "cudaError")
    return f"{name} ({code}: {text})" if text else f"{name} ({code})"


def page_lock(ptr: int, nbytes: int) -> str | None:
    """cudaHostRegister `nbytes` at `ptr`, so device-to-host copies into them run asynchronously;
    None, or the error by name. Linux refuses to page-lock a writable file mapping outside
    shared memory (tmpfs): a slot or region on a disk's file system gets cudaErrorInvalidValue."""
    import torch

    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) == 0:
        return None
    _consume_last_error()
    try:
        text = str(cudart.cudaGetErrorString(err))
    except (AttributeError, TypeError):  # (a binding without it: the name says enough)
        text = ""
    return cuda_error(int(err), text)


def _consume_last_error() -> None:
    """A failed runtime call also leaves its error as this thread's last error, and torch's next
    kernel-launch check (cudaGetLastError) raises it from an unrelated operation: on an H200, a
    refused cudaHostRegister made the next `.to("cuda")` fail. torch binds no cudaGetLastError;
    a one-element kernel on this thread takes the error, which is dropped here."""
    import torch

    try:
        torch.zeros(1, device=torch.cuda.current_device())
    except RuntimeError:  # torch.AcceleratorError: the stale error, now consumed
        pass


def page_unlock(ptr: int) -> None:
    """cudaHostUnregister what `page_lock` registered at `ptr`, before its memory is unmapped: the
    registration outlives the mapping, and a later mapping at that address could not be locked."""
    import torch

    if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
        _consume_last_error()


def map_slot(path: str, nbytes: int, pin: bool = False) -> tuple[torch.Tensor, str | None]:
    """The worker's view: a flat uint8 tensor over the slot file, page-locked if `pin` (then
    `page_unlock(buf.data_ptr())` before dropping it), and why it is not where `pin` failed: it is
    then used pageable, and device-to-host copies into it wait for the device. Mapping alone
    touches no page."""
    import torch

    buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    return buf, (page_lock(buf.data_ptr(), nbytes) if pin else None)


MADV_POPULATE_WRITE = 23  # Linux 5.14 (asm-generic/mman-common.h)


def populate(ptr: int, nbytes: int) -> bool:
    """Fault in every page of the mapping at `ptr` writable, without writing to it: a new slot's
    pages are allocated and zeroed now rather than by the first copy into it, and a slot the
    engine kept (its bytes held) is mapped without changing a byte. False where the kernel
    cannot (before 5.14) or the pages cannot be had (a full /dev/shm: an error here, never a
    SIGBUS); the first copy then faults them in, as without it."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    page = mmap.PAGESIZE
    start = ptr - ptr % page
    return madvise(start, nbytes + ptr - start, MADV_POPULATE_WRITE) == 0
