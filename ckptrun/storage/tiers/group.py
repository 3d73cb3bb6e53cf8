"""Who holds copies of whose part: replication groups with a jump across nodes (--replicas K,
--replica-jump J), torch-free, so the launcher checks a layout before anything starts.

Like NVIDIA's resiliency extension's clique replication: the nodes are cut into blocks of K*J
nodes; inside a block, node n's group is the K nodes n, n+J, ..., n+(K-1)J, and a rank's group is
the ranks of the same local rank on those nodes. Every member holds a copy of every other
member's part, so each engine holds exactly K-1 partners' copies (bounded memory), and no copy
of a rank shares its node (its failure domain). J > 1 spreads a group over nodes further apart
(racks, switches), where failures are less correlated.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UsageError


@dataclass(frozen=True)
class ReplicationGroup:
    """The groups of a world of `nnodes` nodes with `local` ranks each."""

    nnodes: int
    local: int
    replicas: int = 1
    jump: int = 1

    def __post_init__(self) -> None:
        check_flags(self.replicas, self.jump)
        block = self.replicas * self.jump
        if self.replicas > 1 and self.nnodes % block:
            raise UsageError(f"--replicas {self.replicas} --replica-jump {self.jump} needs a multiple of "
                             f"{block} nodes (replicas x jump); the run has {self.nnodes}")

    def node(self, rank: int) -> int:
        return rank // self.local

    def partners(self, rank: int) -> list[int]:
        """The ranks whose engines hold a copy of `rank`'s part, and whose parts it holds."""
        node, local = divmod(rank, self.local)
        block = self.replicas * self.jump
        base, pos = node - node % block, node % block
        first = base + pos % self.jump
        nodes = [first + i * self.jump for i in range(self.replicas)]
        return [n * self.local + local for n in nodes if n != node]


def check_flags(replicas: int, jump: int) -> None:
    if replicas < 1 or jump < 1:
        raise UsageError(f"--replicas and --replica-jump must be at least 1 (got {replicas}, {jump})")
