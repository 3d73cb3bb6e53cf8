"""A clean multi-node finish, said by nothing: the node that hosts the rendezvous store outlives
the other nodes' last use of it.

At the end of a run torch elastic's agents meet at an exit barrier in the rendezvous store, then
each closes the rendezvous there (`DynamicRendezvousHandler.shutdown`). The store lives in the
launcher of the node that hosts it, which ended as soon as it was through both: another node
still waiting on the barrier, closing, or sending a keep-alive then lost its connection and
printed a traceback (`Error waiting on exit barrier ... DistNetworkError: Failed to recv, got 0
bytes`), C++ stack dumps and shutdown errors, about 60 lines after a run both nodes ended 0.
Here every other node, once it has closed its side, checks in under the round's key; the
hosting node waits for all of them (GRACE_S at most) before its launcher goes on to end. Only
after an exit barrier every node reached: a run that failed ends as before, and says so.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

from ..log import log

GRACE_S = 30.0  # the hosting node waits this long at most for the others' check-in
_CLOSED = "ckptrun/closed"  # the nodes that closed their side, counted (in the round's store)
_ALL_CLOSED = "ckptrun/all-closed"


class _Finish:
    """This launcher's part: whether it hosts the store, and, once every node reached the exit
    barrier, the round's store and node count."""

    hosting = False
    passed: tuple[Any, int] | None = None


def install() -> None:
    """Patch torch elastic (in the launcher, before the rendezvous): record whether this process
    hosts the c10d rendezvous store, whether the exit barrier passed, and check in or wait after
    the rendezvous's shutdown."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dynamic

    if getattr(dynamic.DynamicRendezvousHandler.shutdown, "ckptrun_finish", False):
        return
    make_store = backend.TCPStore

    @functools.wraps(make_store)
    def tcp_store(*args: Any, **kwargs: Any) -> Any:
        store = make_store(*args, **kwargs)
        _Finish.hosting = _Finish.hosting or bool(kwargs.get("is_master"))
        return store

    barrier = api.SimpleElasticAgent._exit_barrier

    @functools.wraps(barrier)
    def exit_barrier(self: Any) -> None:
        barrier(self)
        _Finish.passed = None
        try:  # every node checked in (torch's barrier says so by this key, `store_util.barrier`)
            if self._store.check([f"{api._TERMINAL_STATE_SYNC_ID}/last_member"]):
                _Finish.passed = (self._store, self._worker_group.group_world_size)
        except Exception:  # noqa: BLE001 - the store is gone: a failure torch has said already
            pass

    shutdown = dynamic.DynamicRendezvousHandler.shutdown

    @functools.wraps(shutdown)
    def shutdown_then_finish(self: Any) -> bool:
        closed = shutdown(self)
        if _Finish.passed is not None:
            store, nodes = _Finish.passed
            _Finish.passed = None
            finish(store, nodes, hosting=_Finish.hosting)
        return closed

    shutdown_then_finish.ckptrun_finish = True  # type: ignore[attr-defined]
    backend.TCPStore = tcp_store
    api.SimpleElasticAgent._exit_barrier = exit_barrier
    dynamic.DynamicRendezvousHandler.shutdown = shutdown_then_finish


def finish(store: Any, nodes: int, *, hosting: bool, grace_s: float = GRACE_S) -> None:
    """After this node's rendezvous shutdown: the other nodes check in; the hosting node waits
    until all `nodes - 1` have (`grace_s` at most: a node killed since then never does)."""
    if nodes <= 1:
        return
    try:
        if not hosting:
            if store.add(_CLOSED, 1) == nodes - 1:
                store.set(_ALL_CLOSED, "1")
            return
        store.wait([_ALL_CLOSED], timedelta(seconds=grace_s))
    except Exception as e:  # noqa: BLE001 - the run has ended well; this only keeps the store up
        log.debug(f"the rendezvous store's last check-in did not complete ({type(e).__name__}: {e})")
