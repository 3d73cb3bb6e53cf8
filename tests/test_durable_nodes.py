"""The durable tier on two real nodes (network namespaces, with tests/test_two_nodes.py's
fixtures): each node's engine uploads its own rank's part and rank 0's engine the commit object
once both are there. The tier is a plain path here, through the same code as `s3://` (the
loopback S3 endpoint of tests/s3server.py is not reachable from inside a namespace)."""

from __future__ import annotations

import json

from conftest import assert_training_state, load, ok, restore, verify
from test_two_nodes import STOP, _finish, _logs, nodes  # noqa: F401 - `nodes`: the fixture

from ckptrun.storage.store import Store


def test_each_node_uploads_its_own_ranks_part(request, tmp_path):
    two_nodes = request.getfixturevalue("nodes")
    remote = tmp_path / "remote"
    head, _ = two_nodes
    procs = [node.start(tmp_path, head.addr, "checkfreq", extra=("--durable", str(remote))) for node in two_nodes]
    assert _finish(procs, tmp_path) == [0, 0], _logs(tmp_path)
    for node in two_nodes:
        lines = (tmp_path / f"metrics-node{node.rank}" / "engine-0.jsonl").read_text().splitlines()
        parts = [e for e in map(json.loads, lines) if e["type"] == "durable_part"]
        assert parts and {(e["rank"], e["by"]) for e in parts} == {(node.rank, node.rank)}, parts
    ok(verify(tmp_path, remote))
    newest = Store(remote).manifests()[-1]
    assert (newest.step, newest.world_size) == (STOP, 2)
    for rank in (0, 1):
        state, _ = restore(tmp_path, remote, "latest", rank)
        assert_training_state(state, load(tmp_path / f"own-{rank}.pt"))
