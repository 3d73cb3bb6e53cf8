"""Where each tensor's raw bytes live inside a staging slot and inside a data file.

The slot and the file share one layout (4 KiB-aligned offsets), so the engine writes a slot
to disk in one pass and a reader can map any tensor without parsing anything but JSON.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 4096

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"cannot checkpoint tensors of dtype {name}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} in checkpoint index") from None


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
