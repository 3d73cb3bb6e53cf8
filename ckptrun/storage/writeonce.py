"""Replicated state written once across data-parallel ranks.

Under DDP every rank holds the same parameters and the same optimizer state over them; writing
them from every rank writes N copies. Instead each replicated tensor is written by one rank,
chosen so that every rank writes about 1/N of their bytes (`owners`: largest first, each to the
rank with the fewest bytes so far, ties to the lowest rank). Every rank computes the same choice
from the tensors' keys and sizes alone, without communication. A rank's skeleton names the
owner of each replicated tensor it did not write (`{"__remote__": [rank, key]}`, storage/tree.py);
restore reads that tensor from the owner's part of the same record (restore/recovery.py).
"""

from __future__ import annotations

import heapq
from typing import Any

from .tree import REMOTE, TENSOR, tagged


def owners(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """The rank that writes each tensor (`sizes`: key -> bytes), balancing the bytes per rank to
    within one tensor of each other."""
    heap = [(0, r) for r in range(world_size)]
    out = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        load, rank = heapq.heappop(heap)
        out[key] = rank
        heapq.heappush(heap, (load + sizes[key], rank))
    return out


def leave_out(skeleton: Any, owner: dict[str, int]) -> Any:
    """`skeleton` with each tensor of `owner` (key -> the rank that writes it) named as remote."""
    if isinstance(skeleton, list):
        return [leave_out(v, owner) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if TENSOR in skeleton:
        key = skeleton[TENSOR]
        return {REMOTE: [owner[key], key]} if key in owner else skeleton
    return {k: leave_out(v, owner) for k, v in skeleton.items()}


def remote_refs(skeleton: Any) -> list[tuple[int, str]]:
    """Every (owner rank, key) a checked skeleton names as written by another rank."""
    return [tuple(ref) for ref in tagged(skeleton, REMOTE)]
