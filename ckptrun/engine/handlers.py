"""Engine-side halves of strategies: where a strategy's own messages are handled.

A strategy that keeps state inside the engine (a CPU replica updated every step, gradient
batches held in host memory, a double-buffered persistent region) names a handler class in the
registry; the engine looks it up by strategy name at `hello`, importing nothing else.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..ipc.messages import StrategyMessage


class EngineHandler:
    """Default: the strategy sends only the shared messages (Persist, Flush, ...)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def handle(self, msg: StrategyMessage) -> None:
        raise RuntimeError(f"strategy has no engine-side handler for {type(msg).__name__}")

    def flush(self) -> None:
        """Hand everything held in memory to the writers (before a flush or a new worker)."""


def engine_handler(strategy: str, engine: Any) -> EngineHandler:
    from ..strategies import REGISTRY

    spec = REGISTRY[strategy].engine_handler
    if spec is None:
        return EngineHandler(engine)
    module, _, cls = spec.partition(":")
    return getattr(importlib.import_module(module), cls)(engine)
