"""The engine's one connection to its worker: events and replies go out here, from any thread.

A worker hears events only once its Hello is answered (`attach`): what an old worker's jobs
report after that (a slot freed, a step durable) is not the new worker's. A worker gone is not
an error: what it would have heard is dropped, and the engine's jobs go on.
"""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection
from typing import Any

from ..ipc.messages import Message, Reply


class WorkerLink:
    """Where the engine's messages to its worker go (`conn` None: nowhere)."""

    def __init__(self) -> None:
        self.conn: Connection | None = None  # the worker events go to, once its Hello is answered
        self._lock = threading.Lock()

    def attach(self, conn: Connection | None) -> None:
        """The worker on `conn` hears the engine's events from now on."""
        with self._lock:
            self.conn = conn

    def detach(self) -> None:
        """The worker hears nothing more (it said goodbye, or its connection ended)."""
        self.attach(None)

    def send(self, msg: Message) -> None:
        """Send an event to the connected worker; a gone worker is not an error."""
        with self._lock:
            if self.conn is None:
                return
            try:
                self.conn.send(msg)
            except (OSError, EOFError, ValueError):
                self.conn = None

    def reply(self, req: Message, **fields: Any) -> None:
        self.send(Reply(id=req.id, body=fields))
