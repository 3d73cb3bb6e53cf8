"""Two nodes on one machine: each a network namespace of its own (and a host name of its own),
joined by a veth pair, so that each runs its own launcher, engine and worker and they meet over
a real network link (c10d rendezvous, gloo). `ckptrun bench --nodes 2` and the two-node tests
run on them. Needs root (CAP_NET_ADMIN), `ip` and `unshare`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ..errors import CkptrunError


class NetnsUnavailable(CkptrunError):
    """This machine cannot make network namespaces (the reason is the message)."""

    exit_code = 2


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Node:
    """One node: a network namespace with one end of the veth pair, at `addr`."""

    rank: int
    netns: str
    link: str
    addr: str
    other_addr: str  # a second address of its own (a replacement node that sorts elsewhere)

    def popen(self, argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
        """Run `argv` in this node, under the host name `node<rank>`, its output appended to
        `log`; gloo talks over the node's link. The process is `argv`'s own (exec, no fork)."""
        wrapped = ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c",
                   f'hostname node{self.rank} && exec "$@"', "sh", *argv]
        with open(log, "ab") as out:
            return subprocess.Popen(wrapped, cwd=cwd, env={**env, "GLOO_SOCKET_IFNAME": self.link},
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def kill(self) -> None:
        """SIGKILL every process in the namespace at one moment (launcher, engine, worker): a
        node failure. Stopped first, so that nothing starts another process meanwhile."""
        pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True,
                                               text=True).stdout.split()]
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)


def why_not() -> str | None:
    """Why this machine cannot run two nodes (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


N = TypeVar("N", bound=Node)


@contextlib.contextmanager
def node_pair(make: Callable[..., N] = Node) -> Iterator[tuple[N, N]]:
    """Two namespaces joined by a veth pair, names and subnet unique to this call; torn down
    (processes killed, namespaces deleted, which deletes the veth pair) however the block ends.
    NetnsUnavailable when this machine cannot make them."""
    if why := why_not():
        raise NetnsUnavailable(why)
    tag = secrets.token_hex(3)
    net = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    # Node 1 sorts after node 0 at its first address and before it at its other one.
    pair = (make(0, f"ckptrun-{tag}-0", f"ck{tag}0", f"{net}.3", f"{net}.4"),
            make(1, f"ckptrun-{tag}-1", f"ck{tag}1", f"{net}.5", f"{net}.2"))
    made: list[Node] = []
    try:
        for node in pair:
            _ip("netns", "add", node.netns)
            made.append(node)
        _ip("link", "add", pair[0].link, "type", "veth", "peer", "name", pair[1].link)
        for node in pair:
            _ip("link", "set", node.link, "netns", node.netns)
            for addr in (node.addr, node.other_addr):
                _ip("-n", node.netns, "addr", "add", f"{addr}/24", "dev", node.link)
            _ip("-n", node.netns, "link", "set", node.link, "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        for node in made:
            _ip("netns", "del", node.netns)
        if made:
            raise
        raise NetnsUnavailable(f"cannot make a network namespace ({e.stderr.strip()})") from None
    try:
        yield pair
    finally:
        for node in made:
            node.kill()
            subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)
