"""Where each tensor's raw bytes live inside a staging slot and inside a data file.

The slot and the file share one layout (4 KiB-aligned offsets), so the engine writes a slot
to disk in one pass and a reader can map any tensor without parsing anything but JSON.

Importing it does not import torch: the engine, which only moves bytes, lays out and checks
records without it (torch costs an engine a second of start-up and a few hundred MB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ALIGN = 4096

# The dtypes a checkpoint may hold, by name, with their item size in bytes.
DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "uint16": 2, "uint32": 4, "uint64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise TypeError(f"cannot checkpoint tensors of dtype {name}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a name in DTYPE_SIZES (never any other attribute of torch)."""
    if name not in DTYPE_SIZES:
        raise ValueError(f"unknown dtype {name!r} in checkpoint index")
    import torch

    return getattr(torch, name)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorSpec:
    """One tensor's place: `offset` bytes from the start of the slot or file."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, key: str, d: dict) -> TensorSpec:
        return cls(key, d["dtype"], tuple(d["shape"]), int(d["offset"]), int(d["nbytes"]))


@dataclass(frozen=True)
class Layout:
    """An ordered set of TensorSpecs and the bytes they span (a multiple of ALIGN)."""

    specs: tuple[TensorSpec, ...]
    nbytes: int

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor], start: int = 0) -> Layout:
        specs, offset = [], align(start)
        for key, t in tensors.items():
            n = t.numel() * t.element_size()
            specs.append(TensorSpec(key, dtype_name(t.dtype), tuple(t.shape), offset, n))
            offset = align(offset + n)
        return cls(tuple(specs), offset)

    def signature(self) -> tuple:
        return tuple((s.key, s.dtype, s.shape) for s in self.specs)

    def __add__(self, other: Layout) -> Layout:
        return Layout(self.specs + other.specs, max(self.nbytes, other.nbytes))


def view(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A typed, shaped view of `spec`'s bytes inside a flat uint8 `buffer` (no copy)."""
    raw = buffer[spec.offset : spec.offset + spec.nbytes]
    return raw.view(dtype_from_name(spec.dtype)).view(spec.shape)


class ReadBuffer:
    """A data file's read buffer kept from one read to the next (`store_tensors.read_rank`'s
    `into`): a reader going through record after record reuses pages already faulted in instead
    of faulting in a fresh buffer's every page each time. It grows to the largest read, sized by
    the reads themselves (validated sizes), never by a number a manifest claims."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of the buffer, for a read that overwrites them; views of an earlier take must
        no longer be in use."""
        import torch

        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes]
