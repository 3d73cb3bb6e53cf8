"""The strategy registry: name -> where its trainer side (and engine side, if any) lives.

Entries are import paths so that neither the CLI nor the engine imports torch to list them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    trainer: str
    summary: str
    engine_handler: str | None = None

    def load(self):
        module, _, cls = self.trainer.partition(":")
        return getattr(importlib.import_module(module), cls)


REGISTRY: dict[str, Entry] = {
    "sync": Entry("ckptrun.strategies.sync:Sync",
                  "blocking write on the training path (the torch.save baseline)"),
    "checkfreq": Entry("ckptrun.strategies.checkfreq:CheckFreq",
                       "snapshot to host overlapped with the next forward/backward; persist in the engine"),
    "lowdiff": Entry("ckptrun.strategies.lowdiff.trainer:LowDiff",
                     "every step's gradient as a batched differential checkpoint; full every F; exact replay",
                     engine_handler="ckptrun.strategies.lowdiff.engine:LowDiffHandler"),
}


def names() -> list[str]:
    return list(REGISTRY)
