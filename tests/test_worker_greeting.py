"""A worker says Hello to its engine before it imports torch (worker/greeting.py): the engine's
answer (a flush; with --replicas, meeting the round's engines and a replaced node's parts taken
back from partners) runs while the worker imports, instead of after."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Listener

import pytest

from ckptrun.config import ENV, RunConfig
from ckptrun.ipc.client import EngineClient
from ckptrun.ipc.messages import Committed, Hello, Reply, SlotFree

ASK = (  # the worker's side of the engine connection, in the worker process: what is in when the Hello goes
    "import socket, sys\n"
    "from ckptrun.worker import bootstrap, greeting\n"
    "assert 'torch' not in sys.modules, 'importing the bootstrap imported torch'\n"
    "class Engine:\n"
    "    def __init__(self, address, authkey):\n"
    "        pass\n"
    "    def ask(self, msg):\n"
    "        store = msg.node_local or msg.replication\n"
    "        up = store is not None and socket.create_connection((store['addr'], store['port'])).close() is None\n"
    "        print('torch' in sys.modules, 'ckptrun.worker.runtime' in sys.modules, up)\n"
    "        raise SystemExit(0)\n"
    "greeting.EngineClient = Engine\n"
    "sys.argv = ['bootstrap', 'train.py']\n"
    "bootstrap.main()\n")


@pytest.mark.parametrize("nodes", [1, 2])
def test_bootstrap_says_hello_before_its_imports(nodes, tmp_path):
    """`main` sends the Hello before it imports the runtime (and, on one node, before torch).
    On several nodes the engine meets its round through the job store that rank 0's worker
    hosts: that store is up when the Hello goes (torch.distributed is imported for it)."""
    flags = {"replicas": 2, "node_local_dir": True} if nodes > 1 else {}
    cfg = RunConfig(strategy="checkfreq", dir=str(tmp_path), engine_dir=str(tmp_path), **flags)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, ENV: cfg.to_env(), "RANK": "0", "WORLD_SIZE": str(nodes), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": str(nodes == 1)}
    proc = subprocess.run([sys.executable, "-c", ASK], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(nodes > 1), "False", str(nodes > 1)], proc.stdout


def test_events_before_the_worker_listens_are_kept_in_order():
    """The Hello is answered before the Runtime exists to take events: the client keeps what
    comes meanwhile and hands it over, in order, once the Runtime listens."""
    address, key = f"\0ckptrun-test-greeting-{os.getpid()}", os.urandom(16)
    listener = Listener(address, family="AF_UNIX", authkey=key)
    got: list = []

    def engine() -> None:
        conn = listener.accept()
        hello = conn.recv()
        conn.send(Reply(id=hello.id, body={"pid": 1}))
        conn.send(SlotFree(slot=3))
        conn.send(Committed(step=7, record="full-7"))
        got.append(conn.recv())  # (the worker's next message: the events were sent first)
        conn.send(SlotFree(slot=4))
        conn.close()

    t = threading.Thread(target=engine)
    t.start()
    client = EngineClient(address, key)
    rid = client.ask(Hello(rank=0, world_size=1, restart_count=0, dir="d", keep=1, strategy="checkfreq",
                           writers=1, io_threads=1))
    assert client.answer(rid, "hello") == {"pid": 1}
    events: list = []
    client.send(Committed(step=0, record="ping"))
    t.join(10)
    client._rx.join(10)  # the connection closed: every event is in
    client.listen(events.append)
    listener.close()
    kinds = [(type(e).__name__, getattr(e, "slot", getattr(e, "step", None))) for e in events]
    assert kinds == [("SlotFree", 3), ("Committed", 7), ("SlotFree", 4), ("ConnectionLost", None)], kinds


def test_an_event_after_the_worker_closes_its_connection_ends_the_receiver_quietly():
    """A clean finish: the worker closes its connection while its receiver waits in a read, and the
    engine's last event comes after. The receiver ends without an exception (it once read on, on
    the closed connection, and printed a TypeError's traceback) and reports no lost engine."""
    address, key = f"\0ckptrun-test-close-{os.getpid()}", os.urandom(16)
    listener = Listener(address, family="AF_UNIX", authkey=key)
    closed, raised, events = threading.Event(), [], []
    hook, threading.excepthook = threading.excepthook, lambda args: raised.append(args.exc_value)

    def engine() -> None:
        conn = listener.accept()
        closed.wait(10)
        try:
            conn.send(Committed(step=9, record="full-9"))
        except OSError:
            pass  # (the worker's end is shut down: the event has nowhere to go)
        conn.close()

    t = threading.Thread(target=engine)
    t.start()
    try:
        client = EngineClient(address, key, on_event=events.append)
        client.close()
        closed.set()
        t.join(10)
        client._rx.join(10)
    finally:
        threading.excepthook = hook
        listener.close()
    assert not raised and not client._rx.is_alive(), raised
    assert not any(type(e).__name__ == "ConnectionLost" for e in events), events
