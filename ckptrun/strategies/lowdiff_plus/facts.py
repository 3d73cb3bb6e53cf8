"""What a `Base` says of data parallelism, which every later step of the replica obeys: the
parameters one rank writes (`replicated`) and those every rank holds alike (`shared`), and
whether the replica is bit-exact; from them, whether the short-cut of perrank.py applies."""

from __future__ import annotations

import dataclasses

from ...ipc.messages import RecordSpec
from ...storage import writeonce
from ...storage.tree import TENSOR
from .copies import REPLICA_META
from .replica import Replica


@dataclasses.dataclass
class BaseFacts:
    replicated: list[int] = dataclasses.field(default_factory=list)  # (Base.replicated: one rank writes)
    shared: list[int] = dataclasses.field(default_factory=list)  # (Base.shared: every rank writes, in the index)
    exact: bool = True  # (Base.exact)

    def thin(self, r: Replica | None) -> bool:
        """Every optimizer parameter of replica `r` is data-parallel: the short-cut applies."""
        return r is not None and bool(self.shared) and \
            sorted(self.shared) == list(range(len(r.meta["optimizers"]["optimizer"]["params"])))

    def replicated_keys(self, r: Replica) -> list[str]:
        """The keys of `r`'s tensors every data-parallel rank holds alike."""
        return writeonce.shared_keys(r.full_state(), self.shared, r.meta["optimizers"]["optimizer"]["params"])

    def made(self) -> dict:
        """A whole replica's index meta: how its Base made it (REPLICA_META)."""
        return {REPLICA_META: {"exact": self.exact, "replicated": self.replicated, "shared": self.shared}}

    def diff_meta(self, spec: RecordSpec, r: Replica | None) -> dict:
        """A diff's index meta: under the short-cut its gradients named shared (left out of what
        partners get: theirs are the same)."""
        if not self.thin(r):
            return spec.meta
        return {**spec.meta, "shared": [g[TENSOR] for g in spec.skeleton["grads"] if g is not None]}
