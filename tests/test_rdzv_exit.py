"""A clean multi-node finish (launcher/rdzv_exit.py): the node hosting the rendezvous store outlives
the other nodes' last use of it. The two-node runs of tests/test_two_nodes.py check that neither
node prints an error at the end; here, the check-in itself, with a real TCPStore."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.agent.server import api
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dynamic

from ckptrun.launcher import rdzv_exit


def _stores(n: int) -> list[PrefixStore]:
    """A hosted store and `n - 1` clients of it, under one round's prefix (as the agents see it)."""
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    clients = [TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=10)) for _ in range(n - 1)]
    return [PrefixStore("torch.rendezvous.run.0", s) for s in (host, *clients)]


def test_the_hosting_node_ends_only_once_every_other_node_has_closed_its_side() -> None:
    host, *others = _stores(3)
    ended = threading.Event()
    waiting = threading.Thread(target=lambda: (rdzv_exit.finish(host, 3, hosting=True), ended.set()))
    waiting.start()
    rdzv_exit.finish(others[0], 3, hosting=False)
    assert not ended.wait(0.3), "the hosting node ended while a node still used its store"
    rdzv_exit.finish(others[1], 3, hosting=False)
    assert ended.wait(10)
    waiting.join()


def test_a_node_that_never_checks_in_holds_the_host_for_the_grace_period_only() -> None:
    host, _ = _stores(2)
    t0 = time.monotonic()
    rdzv_exit.finish(host, 2, hosting=True, grace_s=0.3)  # (no exception: the run itself ended well)
    assert 0.2 < time.monotonic() - t0 < 5
    rdzv_exit.finish(host, 1, hosting=True)  # one node: nobody to wait for


def test_installed_once_by_the_launcher() -> None:
    saved = (backend.TCPStore, api.SimpleElasticAgent._exit_barrier, dynamic.DynamicRendezvousHandler.shutdown)
    try:
        rdzv_exit.install()
        patched = (backend.TCPStore, api.SimpleElasticAgent._exit_barrier, dynamic.DynamicRendezvousHandler.shutdown)
        assert all(p is not s for p, s in zip(patched, saved, strict=True))
        rdzv_exit.install()
        assert dynamic.DynamicRendezvousHandler.shutdown is patched[2]
    finally:
        backend.TCPStore, api.SimpleElasticAgent._exit_barrier, dynamic.DynamicRendezvousHandler.shutdown = saved
