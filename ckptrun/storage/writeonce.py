"""Replicated state written once across data-parallel ranks.

Under DDP every rank holds the same parameters and the same optimizer state over them; writing
them from every rank writes N copies. Instead each replicated tensor is written by one rank,
chosen so that every rank writes about 1/N of their bytes (`owners`: largest first, each to the
rank with the fewest bytes so far, ties to the lowest rank). Every rank computes the same choice
from the tensors' keys and sizes alone, without communication. A rank's skeleton names the
owner of each replicated tensor it did not write (`{"__remote__": [rank, key]}`, storage/tree.py);
restore reads that tensor from the owner's part of the same record (restore/recovery.py).

The trainer splits what it captures (`split`, with the replicated tensors found by storage in
worker/runtime.py); an engine that writes a state it built itself (lowdiff+'s replica, gockpt's
rolled blocks) splits it by the optimizer positions the trainer named (`split_state`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

import torch

from .layout import align
from .tree import REMOTE, TENSOR, flatten, tagged


def owners(sizes: dict[str, int], world_size: int, rotate: int = 0) -> dict[str, int]:
    """The rank that writes each tensor (`sizes`: key -> bytes), balancing the bytes per rank to
    within one tensor of each other. `rotate` shifts every choice by that many ranks (records of
    consecutive steps, batched into one, do not all leave their one-tensor surplus on rank 0)."""
    heap = [(0, r) for r in range(world_size)]
    out = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        load, rank = heapq.heappop(heap)
        out[key] = (rank + rotate) % world_size
        heapq.heappush(heap, (load + sizes[key], rank))
    return out


def split(skeleton: Any, tensors: dict[str, torch.Tensor], replicated: Iterable[str], rank: int,
          world_size: int, rotate: int = 0) -> tuple[Any, dict[str, torch.Tensor]]:
    """(`skeleton`, `tensors`) less the `replicated` tensors (keys) another rank writes: balanced
    as written, each tensor taking whole ALIGN blocks; empty tensors stay with every rank."""
    sizes = {k: align(tensors[k].numel() * tensors[k].element_size()) for k in replicated if tensors[k].numel()}
    owner = {k: r for k, r in owners(sizes, world_size, rotate).items() if r != rank}
    if not owner:
        return skeleton, tensors
    return leave_out(skeleton, owner), {k: t for k, t in tensors.items() if k not in owner}


def split_state(state: dict, positions: Iterable[int], aliases: list[list[list[str]]], rank: int,
                world_size: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """`flatten(state)` of a full state (worker/runtime.py's `early_state` shape, one optimizer)
    less what another rank writes of the parameters at optimizer `positions` (under each of
    their `aliases`, the index meta's [model, key] pairs) and the optimizer's state of them."""
    skeleton, tensors = flatten(state)
    return split(skeleton, tensors, _keys_at(state, tensors, positions, aliases), rank, world_size)


def shared_keys(state: dict, positions: Iterable[int], aliases: list[list[list[str]]]) -> list[str]:
    """The keys, in `flatten(state)`, of the parameters at optimizer `positions` and the
    optimizer's state of them (what `split_state` would leave to one rank)."""
    return _keys_at(state, flatten(state)[1], positions, aliases)


def with_shared_keys(meta: dict, state: dict, positions: list[int], aliases: list[list[list[str]]]) -> dict:
    """The index meta of a record an engine built from `state`: the worker's `meta` less the
    "shared" it named for its own message's tensors, with this record's own (`shared_keys` of
    `positions`) where there are any."""
    shared = shared_keys(state, positions, aliases) if positions else []
    return {**{k: v for k, v in meta.items() if k != "shared"}, **({"shared": shared} if shared else {})}


def _keys_at(state: dict, tensors: dict[str, torch.Tensor], positions: Iterable[int],
             aliases: list[list[list[str]]]) -> list[str]:
    saved = state["optimizers"]["optimizer"]["state"]
    ids = set()
    for i in positions:
        ids |= {id(state["models"][model][key]) for model, key in aliases[i]}
        ids |= {id(v) for v in saved.get(i, {}).values() if isinstance(v, torch.Tensor)}
    return [k for k, t in tensors.items() if id(t) in ids]


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
