"""The worker's connection to its engine: requests with replies, plus pushed events."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection

from ..errors import CkptrunError
from .messages import ConnectionLost, Message, Reply

RX_JOIN_S = 5.0  # `close`: the receiving thread ends at once once the socket is shut down


class EngineLost(CkptrunError):
    """The engine process went away; the worker must restart (the launcher restarts the engine)."""


class EngineClient:
    """`on_event` may be given later (`listen`): events that come before are kept until then."""

    def __init__(self, address: str, authkey: bytes, on_event: Callable[[Message], None] | None = None,
                 connect_timeout: float = 60.0) -> None:
        self.conn = self._connect(address, authkey, connect_timeout)
        self.on_event = on_event
        self._early: list[Message] = []  # events before `listen`
        self._ids = itertools.count(1)
        self._replies: dict[int, Reply] = {}
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self.lost = False
        self._closing = False  # `close` began: the end of the connection is no loss
        self._rx = threading.Thread(target=self._receive, name="ckptrun-engine-rx", daemon=True)
        self._rx.start()

    @staticmethod
    def _connect(address: str, authkey: bytes, timeout: float) -> Connection:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return Client(address, family="AF_UNIX", authkey=authkey)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise EngineLost(f"no checkpoint engine answers at {address}") from None
                time.sleep(0.05)

    def _receive(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, Reply):
                with self._cond:
                    self._replies[msg.id] = msg
                    self._cond.notify_all()
            else:
                self._event(msg)
        with self._cond:
            self.lost = True
            self._cond.notify_all()
        if not self._closing:
            self._event(ConnectionLost())

    def _event(self, msg: Message) -> None:
        with self._cond:
            if self.on_event is None:
                self._early.append(msg)
                return
        self.on_event(msg)

    def listen(self, on_event: Callable[[Message], None]) -> None:
        """Hand events to `on_event` from now on, those kept so far first, in order (on this
        thread: the receiving thread keeps them until this returns)."""
        with self._cond:
            early, self._early = self._early, []
            for msg in early:
                on_event(msg)
            self.on_event = on_event

    def send(self, msg: Message) -> None:
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (OSError, ValueError) as e:
                raise EngineLost(f"checkpoint engine connection lost ({e})") from None

    def request(self, msg: Message, timeout: float | None = None) -> dict:
        """Send `msg` and wait for its reply's body."""
        return self.answer(self.ask(msg), msg.op.value, timeout)

    def ask(self, msg: Message) -> int:
        """Send request `msg` without waiting; its id, for `answer`."""
        msg.id = rid = next(self._ids)
        self.send(msg)
        return rid

    def answer(self, rid: int, op: str, timeout: float | None = None) -> dict:
        """The reply's body to request `rid` (an `op`), once it comes."""
        with self._cond:
            ok = self._cond.wait_for(lambda: rid in self._replies or self.lost, timeout)
            if rid in self._replies:
                return self._replies.pop(rid).body
        raise EngineLost("checkpoint engine went away" if ok else f"engine did not answer {op!r}")

    def close(self) -> None:
        """Shut the socket down first, so that the receiving thread, in a read, meets the end of
        the stream and stops before the connection is closed under it (a read that began on a
        closed `Connection` fails with a TypeError, printed as a traceback at a clean finish)."""
        self._closing = True
        try:
            with socket.socket(fileno=os.dup(self.conn.fileno())) as s:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if threading.current_thread() is not self._rx:
            self._rx.join(timeout=RX_JOIN_S)
        try:
            self.conn.close()
        except OSError:
            pass
