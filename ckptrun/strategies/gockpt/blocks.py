"""How gockpt cuts the state into transfer blocks (gockpt.txt §4.2.2, §4.4.2: ~4 MB chunks, a
parameter block together with its optimizer block).

A block is a list of pieces, each a slice [start, stop) of one parameter's elements (flattened)
with the same slice of each optimizer-state tensor shaped like it. Large parameters are split
across blocks, small ones share a block. Split points are multiples of SPLIT elements and the
last piece ends at the parameter's end, so the engine's elementwise update of a piece runs the
same (vectorised) code on every element as the trainer's update of the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SPLIT = 4096  # elements


@dataclass(frozen=True)
class Piece:
    index: int  # the parameter's position among the optimizer's parameters
    group: int  # its param group
    start: int
    stop: int


def block_states(param: torch.Tensor, state: dict) -> set[str]:
    """The optimizer-state entries sliced with the parameter: tensors of its shape (a 0-d
    parameter's state travels whole, like every scalar such as Adam's `step`)."""
    if param.dim() == 0:
        return set()
    return {n for n, v in state.items() if isinstance(v, torch.Tensor) and v.shape == param.shape}


def plan(params: list[torch.Tensor], groups: list[int], sliced: list[set[str]], block_bytes: int) -> list[list[Piece]]:
    """Blocks of about `block_bytes` (parameter plus sliced state bytes), in parameter order."""
    blocks: list[list[Piece]] = []
    block: list[Piece] = []
    used = 0
    for i, p in enumerate(params):
        per = p.element_size() * (1 + len(sliced[i]))  # (state of another dtype: about right)
        start, n = 0, p.numel()
        while start < n:
            room = (block_bytes - used) // per
            if n - start <= room:
                stop = n
            else:
                stop = start + room // SPLIT * SPLIT
                if stop == start and block:  # no whole split unit fits: next block
                    blocks.append(block)
                    block, used = [], 0
                    continue
                stop = min(n, max(stop, start + SPLIT))
            block.append(Piece(i, groups[i], start, stop))
            used += (stop - start) * per
            start = stop
            if used >= block_bytes:
                blocks.append(block)
                block, used = [], 0
    if block:
        blocks.append(block)
    return blocks


def shares(blocks: list[list[Piece]], k: int) -> list[list[Piece]]:
    """The pieces handed over at each of the k steps: the blocks in order, as evenly as whole blocks allow."""
    return [[p for b in blocks[len(blocks) * j // k: len(blocks) * (j + 1) // k] for p in b] for j in range(k)]
