"""Which committed step the drain copies to the durable tier under `--durable-every N`: what
`--every N` means for --dir, the steps that are multiples of N. A drain that falls behind copies
the newest multiple reached, not the oldest one pending: a copy of an older step would only
delay the newer one, and the newest is what a resume wants. A multiple the strategy committed no
record at (its records end elsewhere) is stood for by the first committed step after it."""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from ..storage.schema import Manifest


@dataclass(frozen=True)
class Due:
    step: int  # the committed step to copy now
    skipped: tuple[int, ...]  # older multiples committed past the tier's newest step, left uncopied


def due(steps: Sequence[int], last: int, every: int) -> Due | None:
    """The step to copy now (None: none is due). `steps`: the committed steps, ascending;
    `last`: the tier's newest step (-1: none); `every`: N >= 1."""
    if not steps:
        return None
    target = steps[-1] // every * every  # the newest multiple reached
    if target <= max(last, 0):
        return None
    step = next(s for s in steps if s >= target)
    return Due(step, tuple(sorted({s for s in steps if last < s < target and s % every == 0})))


def next_multiple(after: int, every: int) -> int:
    """The first multiple of `every` past step `after`."""
    return (max(after, 0) // every + 1) * every


def needed(name: str, local: dict[str, Manifest], remote: Container[str]) -> list[str] | None:
    """Record `name` and the records it depends on that `remote` lacks; None when one of them is
    in neither `local` nor `remote`."""
    need, todo = [name], []
    while need:
        name = need.pop()
        if name in remote or name in todo:
            continue
        if name not in local:
            return None
        todo.append(name)
        need += local[name].depends_on
    return todo


def held_for_due(ms: list[Manifest], last: int, every: int, remote: Container[str]) -> frozenset[str]:
    """The records local retention keeps for the next copy (a shared --dir's leader): the newest
    committed multiple of `every` past the tier's newest step `last`, with what it needs there. A
    drain slower than the commits would otherwise find it pruned and copy the step after."""
    pick = due([m.step for m in ms], last, every)
    if pick is None:
        return frozenset()
    return records_for([m for m in ms if m.step == pick.step][-1].name, ms, remote)


def records_for(name: str, ms: list[Manifest], remote: Container[str]) -> frozenset[str]:
    """What local retention keeps for a copy of record `name` of `ms`: it and what it needs that
    `remote` lacks (nothing where a dependency is in neither)."""
    return frozenset(needed(name, {m.name: m for m in ms}, remote) or ())
