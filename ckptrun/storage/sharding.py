"""Sharded tensors (DTensor: FSDP2, tensor parallel) in a checkpoint, without torch.distributed.

Each rank stores its own shard of a DTensor as an ordinary tensor, and next to it in its
skeleton where that shard lies: the global shape, the mesh shape, the rank's coordinate in the
mesh and the placements (`R` replicate, `S<dim>` shard). Restore needs no process group: the
placement arithmetic below (DTensor's own rule, that of `torch.chunk`) says which slice of the
global tensor each shard is, so that shards assemble into full tensors (`assemble`) and a full
tensor splits for another mesh (`shard_of`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from .schema import MAX_NDIM, MAX_WORLD_SIZE, short

DTENSOR = "__dtensor__"
FIELDS = {"local", "shape", "mesh", "coord", "placements"}
_PLACEMENT = re.compile(r"R|S[0-9]{1,2}")


def placement_names(placements: Any) -> list[str]:
    """`R`/`S<dim>` for DTensor placements; ValueError for those a checkpoint cannot hold (Partial:
    a pending reduction, not state; _StridedShard: FSDP2 over tensor parallel)."""
    out = []
    for p in placements:
        kind = type(p).__name__
        if kind == "Replicate":
            out.append("R")
        elif kind == "Shard":
            out.append(f"S{p.dim}")
        else:
            raise ValueError(f"placement {p} (only Shard(dim) and Replicate are checkpointed)")
    return out


def local_box(shape: tuple[int, ...], mesh: tuple[int, ...], coord: tuple[int, ...],
              placements: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, size) per dimension of the shard at mesh coordinate `coord`: each `S<d>` mesh
    dimension cuts what is left of tensor dimension d into mesh-size chunks of ceil(n/k) (the
    last ones shorter or empty), in mesh-dimension order."""
    offset, size = [0] * len(shape), list(shape)
    for k, c, p in zip(mesh, coord, placements, strict=True):
        if p == "R":
            continue
        d = int(p[1:])
        chunk = -(-size[d] // k)
        start = min(c * chunk, size[d])
        offset[d] += start
        size[d] = min(start + chunk, size[d]) - start
    return tuple(offset), tuple(size)


def check_meta(meta: Any, local: dict) -> None:
    """ValueError unless `meta` (a skeleton's DTENSOR node) describes a shard that `local` (its
    tensor's index entry: dtype, shape) is: well-formed fields, a coordinate inside the mesh,
    placements naming dimensions the tensor has, and the shard's shape by the placement rule."""
    if not isinstance(meta, dict) or set(meta) != FIELDS:
        raise ValueError(f"{DTENSOR} needs exactly the fields {sorted(FIELDS)}")
    shape, mesh, coord, places = meta["shape"], meta["mesh"], meta["coord"], meta["placements"]
    for name, v, low in (("shape", shape, 0), ("mesh", mesh, 1), ("coord", coord, 0)):
        if not (isinstance(v, list) and len(v) <= MAX_NDIM
                and all(type(x) is int and low <= x <= 2**48 for x in v)):
            raise ValueError(f"{DTENSOR} {name} {short(v)} is not a list of integers >= {low}")
    if not (isinstance(places, list) and all(isinstance(p, str) and _PLACEMENT.fullmatch(p) for p in places)):
        raise ValueError(f"{DTENSOR} placements {short(places)} are not R or S<dim>")
    if not 1 <= len(mesh) == len(coord) == len(places) or math.prod(mesh) > MAX_WORLD_SIZE:
        raise ValueError(f"{DTENSOR} mesh {short(mesh)}, coordinate and placements do not match")
    if any(c >= k for c, k in zip(coord, mesh, strict=True)) \
            or any(p != "R" and int(p[1:]) >= len(shape) for p in places):
        raise ValueError(f"{DTENSOR} coordinate {coord} or placements {places} lie outside mesh {mesh} "
                         f"or shape {shape}")
    expect = list(local_box(tuple(shape), tuple(mesh), tuple(coord), tuple(places))[1])
    if list(local["shape"]) != expect:
        raise ValueError(f"{DTENSOR} shard is {local['shape']}, its placements make it {expect}")


@dataclass
class Sharded:
    """A DTensor as read from a checkpoint: one rank's shard (`local`), or the whole tensor
    (`full`) once assembled from every rank's. The worker turns it back into a DTensor on the
    live mesh (ckptrun/worker/sharded.py); restore writes `full`."""

    shape: tuple[int, ...]
    mesh: tuple[int, ...]
    coord: tuple[int, ...]
    placements: tuple[str, ...]
    local: torch.Tensor
    key: str  # its shard's tensor key: the same on every rank
    full: torch.Tensor | None = None

    @classmethod
    def of(cls, meta: dict, local: torch.Tensor) -> Sharded:
        return cls(tuple(meta["shape"]), tuple(meta["mesh"]), tuple(meta["coord"]), tuple(meta["placements"]), local,
                   meta["local"]["__tensor__"])

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return local_box(self.shape, self.mesh, self.coord, self.placements)


def find(obj: Any) -> list[Sharded]:
    """Every `Sharded` inside nested state (dicts, lists, tuples)."""
    if isinstance(obj, Sharded):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in find(v)]
    return []


def as_full(obj: Any) -> Any:
    """Nested state with each `Sharded` replaced by its assembled full tensor."""
    if isinstance(obj, Sharded):
        if obj.full is None:
            raise ValueError(f"sharded tensor {short(obj.key)} was not assembled")
        return obj.full
    if isinstance(obj, dict):
        return {k: as_full(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(as_full(v) for v in obj)
    return obj


def shard_of(full: torch.Tensor, mesh: tuple[int, ...], coord: tuple[int, ...],
             placements: tuple[str, ...]) -> torch.Tensor:
    """The shard of `full` that mesh coordinate `coord` holds (a contiguous copy)."""
    offset, size = local_box(tuple(full.shape), mesh, coord, placements)
    out = full
    for d, (o, n) in enumerate(zip(offset, size, strict=True)):
        out = out.narrow(d, o, n)
    return out.contiguous()


def choose(pieces: list[Sharded], where: str) -> list[Sharded]:
    """The shards that make the whole tensor, one per mesh coordinate (a replicated mesh dimension
    holds the same values everywhere: coordinate 0 of it; a coordinate held twice, as by ranks
    outside the mesh's dimensions, is taken from the first). ValueError unless `pieces` (every
    rank's shard of one DTensor, in rank order) agree on the global shape, dtype, mesh and
    placements and hold every coordinate. Reads no tensor values: restore assembles what this
    chooses, `verify` calls it on the index alone (shards on the meta device)."""
    first = pieces[0]
    if any((p.shape, p.dtype, p.mesh, p.placements) != (first.shape, first.dtype, first.mesh, first.placements)
           for p in pieces):
        raise ValueError(f"{where}: ranks disagree on its global shape, dtype, mesh or placements")
    by_coord: dict[tuple[int, ...], Sharded] = {}
    for p in pieces:
        by_coord.setdefault(p.coord, p)
    needed = product(*(range(k) if p != "R" else range(1) for k, p in zip(first.mesh, first.placements,
                                                                          strict=True)))
    out = []
    for coord in needed:
        if coord not in by_coord:
            raise ValueError(f"{where}: no rank holds mesh coordinate {list(coord)} of mesh {list(first.mesh)}")
        out.append(by_coord[coord])
    return out


def assemble(pieces: list[Sharded], where: str) -> torch.Tensor:
    """The full tensor out of every rank's shard of one DTensor (see `choose`)."""
    chosen = choose(pieces, where)
    import torch  # (the engine, which imports this module, never assembles)

    full = torch.empty(chosen[0].shape, dtype=chosen[0].dtype)
    for piece in chosen:
        target = full
        for d, (o, n) in enumerate(zip(*piece.box(), strict=True)):
            target = target.narrow(d, o, n)
        target.copy_(piece.local)
    return full
