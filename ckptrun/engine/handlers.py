"""Engine-side halves of strategies: where a strategy's own messages are handled.

A strategy that keeps state inside the engine (a CPU replica updated every step, gradient
batches held in host memory, a double-buffered persistent region) names a handler class in the
registry; the worker passes that import path in its `Hello`, and the engine imports nothing
else. A handler sees the engine only through its `EngineContext`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..ipc.messages import Message, RecordSpec, SlotFree, StrategyMessage

if TYPE_CHECKING:
    from ..faults import Fault
    from .server import Engine


class EngineContext:
    """The one surface an engine-side handler may use.

    Call order for a message naming a staging slot: `read_slot` (copy the bytes out), then
    `free_slot` at once (the worker reuses the slot; it waits for it under back-pressure), then
    `write` a record (queued on the writer threads; the worker hears `Durable`, then `Committed`
    from the commit protocol, or `SaveError`). A request is answered with `reply`.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def read_slot(self, slot: int, start: int, stop: int) -> bytes:
        return bytes(self._engine.slots[slot].view[start:stop])

    def free_slot(self, slot: int) -> None:
        self._engine.send(SlotFree(slot=slot))

    def write(self, spec: RecordSpec, data: memoryview) -> None:
        """Persist this rank's part of record `spec` and hand it to the committer."""
        self._engine.submit(self._engine.write_record, spec, data)

    def reply(self, request: Message, **body: Any) -> None:
        self._engine.reply(request, **body)

    def emit(self, **event: Any) -> None:
        """Append an event to the engine's metrics log."""
        self._engine.log.emit(**event)

    @property
    def fault(self) -> Fault | None:
        """The injected fault of the crash-matrix tests, if any."""
        return self._engine.fault


class EngineHandler:
    """Default: the strategy sends only the shared messages (Persist, Flush, ...)."""

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx

    def handle(self, msg: StrategyMessage) -> None:
        raise RuntimeError(f"strategy has no engine-side handler for {type(msg).__name__}")

    def flush(self) -> None:
        """Hand everything held in memory to the writers (before a flush or a new worker)."""


def engine_handler(spec: str | None, engine: Engine) -> EngineHandler:
    """The handler class at `spec` ("module:Class", from the registry via the worker's Hello)."""
    ctx = EngineContext(engine)
    if spec is None:
        return EngineHandler(ctx)
    module, _, cls = spec.partition(":")
    return getattr(importlib.import_module(module), cls)(ctx)
