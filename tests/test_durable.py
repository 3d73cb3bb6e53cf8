"""The durable remote tier (--durable) against a real S3-compatible HTTP endpoint on loopback."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import (
    EXAMPLE,
    STEPS,
    TINY,
    assert_training_state,
    ckptrun,
    cli,
    error_line,
    load,
    ok,
    pack,
    restore,
    strategy_params,
    verify,
)
from s3server import moto_server

from ckptrun.engine import drain
from ckptrun.engine.drain import Drain
from ckptrun.engine.durable_due import Due, due
from ckptrun.errors import CorruptCheckpoint
from ckptrun.ipc.events import EventLog
from ckptrun.launcher.console.metrics_state import MetricsState
from ckptrun.storage.fsutil import _no_fault
from ckptrun.storage.store import Store, full_name
from ckptrun.storage.tiers import open_tier
from ckptrun.storage.tiers.dirtier import DirTier
from ckptrun.storage.tiers.parts import record_parts
from ckptrun.strategies import REGISTRY
from ckptrun.tuning.intervals import daly_interval
from ckptrun.tuning.levels import Layout, durable_every, failure_rates


@pytest.fixture(scope="session")
def s3():
    """The endpoint, with its credentials and URL in the environment (the client's standard
    chain), as a user's job would have them."""
    with moto_server() as ep:
        saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                                 "AWS_ENDPOINT_URL")}
        os.environ.update(AWS_ACCESS_KEY_ID=ep.key, AWS_SECRET_ACCESS_KEY=ep.secret, AWS_DEFAULT_REGION="us-east-1",
                          AWS_ENDPOINT_URL=ep.url)
        try:
            yield ep
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def durable_run(cwd: Path, strategy: str, url: str, *extra, fault: str | None = None) -> subprocess.CompletedProcess:
    return ckptrun(cwd, "--strategy", strategy, *REGISTRY[strategy].short_run_flags, "--dir", cwd / "ckpts",
                   "--durable", url, "--metrics-dir", cwd / "metrics", *extra, EXAMPLE, *TINY,
                   "--save-at", STEPS, "--save-path", cwd / "final.pt", fault=fault)


def engine_events(cwd: Path, kind: str) -> list[dict]:
    lines = (cwd / "metrics" / "engine-0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("type") == kind]


# Each layout's upload path: records and a diff chain (lowdiff), region slots (lightcheck), rank
# files (datastates); checkfreq's run with --durable is in the tests below.
@pytest.mark.parametrize("strategy", strategy_params(("lowdiff", "lightcheck", "datastates")))
def test_drained_steps_restore_from_the_url(strategy, s3, example_truth, tmp_path):
    """Every strategy's steps reach the store; `restore`/`verify`/`ls` read the URL like a
    directory, and --durable-keep holds there."""
    url = f"s3://{s3.bucket()}/run"
    ok(durable_run(tmp_path, strategy, url, "--endpoint", s3.url, "--durable-keep", "1"))
    ups = engine_events(tmp_path, "durable")
    assert ups and ups[-1]["step"] == STEPS and {"lag_steps", "lag_s", "upload_s", "bytes"} <= set(ups[-1])
    state, _ = restore(tmp_path, url, "latest")
    assert_training_state(state, example_truth(STEPS))
    checked = verify(tmp_path, url)
    assert checked.returncode == 0, checked.stdout
    fulls = [n for n in open_tier(url).committed() if n.startswith("step-")]
    assert len(fulls) == 1, f"--durable-keep 1 left {fulls}"
    feed = MetricsState()  # what the dashboard shows: the remote step, no lag once the run ended
    feed.apply_all(map(json.loads, (tmp_path / "metrics" / "engine-0.jsonl").read_text().splitlines()))
    assert feed.commits.remote["step"] == STEPS and feed.commits.remote_lag() == 0
    listed = ok(ckptrun(tmp_path, "ls", "--dir", url, "--json", "--durable-endpoint", s3.url))
    assert max(r["step"] for r in json.loads(listed.stdout)) == STEPS


def test_killed_run_resumes_from_the_store_without_its_dir(s3, example_truth, tmp_path):
    """A run killed at step 7 (its whole --dir lost with the machine) resumes from the store."""
    url = f"s3://{s3.bucket()}/run"
    killed = durable_run(tmp_path, "checkfreq", url, "--durable-every", "3", fault="kill:step=7")
    assert killed.returncode != 0
    remote = open_tier(url).committed()
    assert remote, "nothing reached the store before the kill"
    assert all(int(name.split("-")[1]) % 3 == 0 for name in remote), f"--durable-every 3 copied {remote}"
    shutil.rmtree(tmp_path / "ckpts")
    again = ok(durable_run(tmp_path, "checkfreq", url))
    assert "resuming from" in again.stderr
    assert_training_state(load(tmp_path / "final.pt"), example_truth(STEPS))


@pytest.mark.parametrize("at", ["part", "commit", "committed"])
def test_engine_killed_while_uploading(at, s3, tmp_path):
    """An engine dying at each point of an upload (inside a multipart upload, before the commit
    object, after it) leaves the previous remote step restorable; the next start sweeps."""
    store = _local_steps(tmp_path / "ckpts")
    url = f"s3://{s3.bucket()}/run"
    child = subprocess.run([sys.executable, "-c", UPLOADER, str(store.root), url, at], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 137, child.stderr
    tier = open_tier(url)
    assert tier.committed() == (["step-00000001", "step-00000002"] if at == "committed" else ["step-00000001"])
    pending = s3.client().list_multipart_uploads(Bucket=url.split("/")[2]).get("Uploads", [])
    assert bool(pending) == (at == "part")
    checked = verify(tmp_path, url)
    assert checked.returncode == 0, checked.stdout
    aborted, torn = tier.sweep()
    assert (aborted, torn) == ((1, []) if at == "part" else (0, ["step-00000002"])
                               if at == "commit" else (0, []))
    assert tier.listing()[0].keys() == set(tier.committed()), tier.listing()


def _weights(step: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s tensor at `step` in `_local_steps` (step 2's big enough to go up in parts)."""
    return torch.randn(9 << 18 if step == 2 else 1024, generator=torch.Generator().manual_seed(100 * step + rank))


def _local_steps(root: Path, steps: tuple[int, ...] = (1, 2), world_size: int = 1, run: int = 0) -> Store:
    """--dir with committed full steps of `world_size` ranks; `run` is in each index's meta (a
    step run again after a restart has the same tensors and another index: its snapshot times)."""
    store = Store(root)
    store.ensure_writable()
    for step in steps:
        for rank in range(world_size):
            state = {"models": {"model": {"w": _weights(step, rank)}},
                     "optimizers": {"optimizer": {"state": {0: {"step": torch.tensor(float(step))}},
                                                  "param_groups": [{"lr": 0.1, "params": [0]}]}}, "step": step}
            skeleton, data, specs = pack(state)
            store.write_rank(full_name(step), rank, memoryview(data), specs, skeleton, {"step": step, "run": run})
        assert store.try_commit(full_name(step), kind="full", step=step, first_step=step, world_size=world_size)
    return store


# The engine's upload of step 1, then of step 2 killed (os._exit) at the given point.
UPLOADER = """
import os, sys
from ckptrun.engine import drain
from ckptrun.engine.drain import Drain
from ckptrun.ipc.events import EventLog
from ckptrun.launcher.console.metrics_state import MetricsState
from ckptrun.storage.fsutil import _no_fault
from ckptrun.storage.store import Store, full_name
from ckptrun.storage.tiers import open_tier
from ckptrun.storage.tiers.dirtier import DirTier
from ckptrun.storage.tiers.parts import record_parts
store, tier, at = Store(sys.argv[1]), open_tier(sys.argv[2]), sys.argv[3]
for m in store.manifests():
    fault = (lambda p: os._exit(137) if p == at else None) if m.step == 2 else (lambda p: None)
    with record_parts(store, m) as (parts, manifest):
        tier.publish_record(m.name, parts, manifest, fault=fault)
"""


def test_engine_killed_at_upload_is_swept_by_the_next_engine(s3, example_truth, tmp_path):
    """The same kill in a real run (the engine dies before a commit object, during the run or
    at its final upload): the next engine (restarted, or the next run's) sweeps the torn
    record, and the final step reaches the store."""
    url = f"s3://{s3.bucket()}/run"
    durable_run(tmp_path, "checkfreq", url, "--max-restarts", "1", fault="kill-engine:step=3:phase=upload:at=commit")
    ok(durable_run(tmp_path, "checkfreq", url))
    swept = engine_events(tmp_path, "durable_sweep")
    assert swept and swept[0]["records"], "no engine swept the torn upload"
    tier = open_tier(url)
    assert tier.listing()[0].keys() == set(tier.committed())
    state, _ = restore(tmp_path, url, "latest")
    assert_training_state(state, example_truth(STEPS))


@pytest.mark.parametrize("case", ["credentials", "bucket", "endpoint"])
def test_unusable_store_is_one_line_at_start(case, s3, tmp_path):
    bucket = s3.bucket()
    url = f"s3://{bucket if case != 'bucket' else 'no-such-bucket'}/run"
    env_key = os.environ["AWS_ACCESS_KEY_ID"]
    endpoint = s3.url if case != "endpoint" else "http://127.0.0.1:9"
    if case == "credentials":
        os.environ["AWS_ACCESS_KEY_ID"] = "AKIAWRONGWRONGWRONG0"
    try:
        t0 = time.time()
        proc = cli(tmp_path, "--durable", url, "--durable-endpoint", endpoint, EXAMPLE, *TINY)
        took = time.time() - t0
    finally:
        os.environ["AWS_ACCESS_KEY_ID"] = env_key
    line = error_line(proc)
    assert proc.returncode == 2 and took < 10, (took, proc.stderr)
    assert {"credentials": "credentials refused", "bucket": "does not exist",
            "endpoint": "cannot reach"}[case] in line, line
    assert not (tmp_path / "metrics").exists()


def test_one_endpoint_flag_on_every_command(tmp_path, monkeypatch):
    """--endpoint is the name on every command, --durable-endpoint (run's old name) its alias,
    both shown in help and taken by a recipe; on `run` it needs --durable (else ignored)."""
    from ckptrun import cli as entry
    from ckptrun.launcher import run as launcher

    for command in ("run", "ls", "restore", "verify"):
        assert "--endpoint, --durable-endpoint" in cli(tmp_path, command, "--help").stdout, command
    seen = []
    monkeypatch.setattr(launcher, "run", lambda cfg, *a, **kw: seen.append(cfg.durable_endpoint) or 0)
    url, durable = "http://127.0.0.1:9", ["--durable", "s3://b/run"]
    (tmp_path / "new.yaml").write_text(f"endpoint: {url}\n")
    (tmp_path / "old.yaml").write_text(f"durable_endpoint: {url}\n")
    (tmp_path / "both.yaml").write_text(f"endpoint: {url}\ndurable-endpoint: {url}\n")
    for flags in (["--endpoint", url], ["--durable-endpoint", url], ["--recipe", str(tmp_path / "new.yaml")],
                  ["--recipe", str(tmp_path / "old.yaml")]):
        assert entry.main([*flags, *durable, str(EXAMPLE)]) == 0, flags
    assert seen == [url] * 4
    assert "durable-endpoint sets endpoint a second time" in error_line(cli(tmp_path, "--recipe", "both.yaml", EXAMPLE))
    assert "give --durable" in error_line(cli(tmp_path, "--endpoint", url, EXAMPLE))


def test_a_remote_dir_is_named_by_its_url_and_has_no_node_local_notes(s3, tmp_path):
    """`ls`, `restore` and `verify` of an s3:// --dir read a private copy of it: what they say
    names the URL given (not the copy's temporary folder), and a listing says nothing that
    applies only to a node-local --dir (each record's parts are the store's, not a node's)."""
    store = _local_steps(tmp_path / "ckpts", world_size=2)
    url = f"s3://{s3.bucket()}/run"
    tier = open_tier(url)
    for m in store.manifests():
        with record_parts(store, m) as (parts, manifest):
            tier.publish_record(m.name, parts, manifest)
    listed = cli(tmp_path, "ls", "--dir", url)
    assert listed.returncode == 0 and "step-00000002" in listed.stdout, listed.stderr
    assert "node-local" not in listed.stdout + listed.stderr and "note:" not in listed.stdout, listed.stdout
    assert [r["ranks_here"] for r in json.loads(cli(tmp_path, "ls", "--dir", url, "--json").stdout)] == [None, None]
    missing = error_line(cli(tmp_path, "restore", "--dir", url, "--step", "10", "--out", tmp_path / "o.pt"))
    assert f"step 10 is not committed in {url}; available steps: 1-2" in missing, missing
    no_bucket = error_line(cli(tmp_path, "verify", "--dir", "s3://no-such-bucket/run"))
    assert no_bucket.endswith("s3://no-such-bucket/run: bucket no-such-bucket does not exist"), no_bucket


def test_crafted_listings_are_refused(s3, tmp_path):
    """Keys outside the record/file pattern (`..`), sizes out of range and a commit object
    naming missing data are refused as a crafted directory's are."""
    store = _local_steps(tmp_path / "ckpts")
    bucket = s3.bucket()
    url = f"s3://{bucket}/run"
    tier = open_tier(url)
    m = store.manifests()[0]
    with record_parts(store, m) as (parts, manifest):
        tier.publish_record(m.name, parts, manifest)
    c = s3.client()
    c.put_object(Bucket=bucket, Key="run/step-00000001/../../escape/MANIFEST.json", Body=manifest)
    c.put_object(Bucket=bucket, Key="run/step-00000003/rank-00000.json", Body=b"{}")
    c.put_object(Bucket=bucket, Key="run/step-00000003/rank-00000.data/x", Body=b"")
    body = {**json.loads(manifest), "name": "step-00000005", "step": 5, "first_step": 5}
    from ckptrun.storage.schema import Manifest

    body.pop("checksum")
    body.pop("format")
    forged = json.dumps(Manifest(**body).to_json()).encode()
    c.put_object(Bucket=bucket, Key="run/step-00000005/MANIFEST.json", Body=forged)
    records, refused = tier.listing()
    assert set(records) == {"step-00000001", "step-00000003", "step-00000005"}
    assert any(".." in k for k in refused) and any("rank-00000.data/x" in k for k in refused)
    checked = verify(tmp_path, url)
    assert checked.returncode == 1 and "step-00000005" in checked.stdout, checked.stdout
    state_file = tmp_path / "out.pt"
    proc = ckptrun(tmp_path, "restore", "--dir", url, "--step", "5", "--out", state_file)
    assert proc.returncode != 0 and not state_file.exists()
    assert not (tmp_path.parent / "escape").exists()


def test_crafted_sizes_are_refused_before_reading(tmp_path):
    """A listed size out of range (a 65 MiB manifest: sparse here) is refused by the listing,
    whichever tier lists it; a link is never followed."""
    remote = tmp_path / "remote"
    (remote / "step-00000003").mkdir(parents=True)
    with open(remote / "step-00000003" / "MANIFEST.json", "wb") as f:
        f.truncate((64 << 20) + 1)
    (remote / "step-00000004").symlink_to(tmp_path)
    records, refused = open_tier(str(remote)).listing()
    assert records == {} and len(refused) == 2, refused


def test_s3_url_without_the_extra_names_it(tmp_path):
    """Without boto3, an s3:// URL is one line naming the extra to install (exit 2)."""
    code = ("import sys; sys.modules['boto3'] = None; from ckptrun import cli; "
            "sys.exit(cli.main(['ls', '--dir', 's3://bucket/run']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "pip install 'ckptrun[s3]'" in error_line(proc), proc.stderr


def test_plain_path_tier_is_a_checkpoint_directory(tmp_path):
    """--durable on a plain path goes through the same code and leaves what --dir holds: `verify`
    reads it as a directory; its sweep removes a torn record and a killed writer's temporary."""
    store = _local_steps(tmp_path / "ckpts")
    tier = open_tier(str(tmp_path / "remote"))
    tier.probe()
    for m in store.manifests():
        with record_parts(store, m) as (parts, manifest):
            tier.publish_record(m.name, parts, manifest)
    checked = verify(tmp_path, tmp_path / "remote")
    assert checked.returncode == 0 and "2 committed record(s)" in checked.stdout, checked.stdout
    torn = tmp_path / "remote" / "step-00000003"
    torn.mkdir()
    (torn / "rank-00000.data").write_bytes(b"x")
    (torn / ".rank-00000.json.part-1").write_bytes(b"x")
    assert tier.sweep() == (1, ["step-00000003"]) and not torn.exists()
    assert tier.committed() == ["step-00000001", "step-00000002"]


class _SlowTier(DirTier):
    """A plain-path tier whose uploads wait for `go`: a slow store."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.go, self.waiting = threading.Event(), threading.Event()

    def put(self, key, src, fault=_no_fault) -> None:
        self.waiting.set()
        assert self.go.wait(60)
        super().put(key, src, fault)


def test_local_retention_holds_a_step_until_the_tier_has_it(tmp_path):
    """--keep spares the records an upload under way reads, says so once (a `durable_hold`
    event), and removes them once the tier has them."""
    store = _local_steps(tmp_path / "ckpts", steps=(1,))
    tier = _SlowTier(tmp_path / "remote")
    tier.probe()
    metrics = tmp_path / "metrics"
    d = Drain(store, tier, 0, 0, EventLog(str(metrics), "engine-0"), lambda step: _no_fault)
    upload = threading.Thread(target=d.round)
    upload.start()
    assert tier.waiting.wait(60)
    _local_steps(store.root, steps=(3, 4))  # committed meanwhile: --keep 1 keeps step 4 only
    assert d.retain_local(1) == [full_name(3)] and d.retain_local(1) == []
    assert store.is_committed(full_name(1))
    d.log.flush()
    holds = [e for e in map(json.loads, (metrics / "engine-0.jsonl").read_text().splitlines())
             if e["type"] == "durable_hold"]
    assert [h["records"] for h in holds] == [[full_name(1)]], holds
    tier.go.set()
    upload.join(timeout=60)
    assert tier.committed() == [full_name(1)]
    assert d.retain_local(1) == [full_name(1)]


def test_local_retention_keeps_the_due_multiple_until_the_tier_has_it(tmp_path):
    """--durable-every 3, a drain slower than the commits: --keep 1 does not take step 3 (the
    multiple due) before the round copies it, so the tier gets step 3, not the step after."""
    store = _local_steps(tmp_path / "ckpts", steps=(1, 2, 3, 4, 5))
    tier = open_tier(str(tmp_path / "remote"))
    tier.probe()
    d = Drain(store, tier, 3, 0, EventLog(str(tmp_path / "metrics"), "engine-0"), lambda step: _no_fault)
    assert d.retain_local(1) == [full_name(s) for s in (1, 2, 4)]
    d.round()
    assert tier.committed() == [full_name(3)]
    assert d.retain_local(1) == [full_name(3)]


# ---- several ranks: each engine uploads its own rank's part, rank 0's commit object last ----

def _drain(store: Store, url: str, rank: int, metrics: Path) -> Drain:
    """One engine's drain (not started: the test runs its rounds), its events in `metrics`;
    the tier probed, as at the start of a run."""
    tier = open_tier(url)
    tier.probe()
    return Drain(store, tier, 0, 0, EventLog(str(metrics), f"engine-{rank}"), lambda step: _no_fault, rank)


def _parts_by(metrics: Path, rank: int) -> list[tuple[str, int, int]]:
    """(record, rank of the part, engine's rank) of every part engine `rank` uploaded."""
    lines = (metrics / f"engine-{rank}.jsonl").read_text().splitlines()
    return [(e["record"], e["rank"], e["by"]) for e in map(json.loads, lines) if e["type"] == "durable_part"]


def _node_local(tmp_path: Path, run: int = 0) -> tuple[Store, Store]:
    """Two nodes' --dir, each holding the committed manifests and only its own rank's files."""
    node0 = _local_steps(tmp_path / "node0", world_size=2, run=run)
    shutil.copytree(node0.root, tmp_path / "node1")
    for node, other in ((0, 1), (1, 0)):
        for f in (tmp_path / f"node{node}").glob(f"step-*/rank-{other:05d}.*"):
            f.unlink()
    return node0, Store(tmp_path / "node1")


def test_each_engine_uploads_its_own_ranks_part(tmp_path):
    """Node-local --dir on two nodes: each engine uploads the part its node holds; the leader
    (rank 0) uploads the commit object only once the tier lists every rank's part, then
    removes what a dead attempt left uncommitted."""
    node0, node1 = _node_local(tmp_path)
    url, metrics = str(tmp_path / "remote"), tmp_path / "metrics"
    leader, follower = _drain(node0, url, 0, metrics), _drain(node1, url, 1, metrics)
    tier = open_tier(url)
    with record_parts(node1, node1.manifests()[0], [1]) as (parts, _):  # a dead attempt's, never committed
        tier.put_part(full_name(1), parts[0])
    lead = threading.Thread(target=leader.round)
    lead.start()
    deadline = time.monotonic() + 60
    while tier.ranks_up(tier.listing()[0].get(full_name(2), {})) != {0}:
        assert time.monotonic() < deadline and lead.is_alive(), tier.listing()
        time.sleep(0.05)
    time.sleep(0.3)  # the leader polls the listing meanwhile
    assert tier.committed() == [] and lead.is_alive(), "committed without rank 1's part"
    assert _parts_by(metrics, 0) == [(full_name(2), 0, 0)]
    follower.round()
    lead.join(timeout=60)
    assert tier.committed() == [full_name(2)] and tier.listing()[0].keys() == {full_name(2)}
    assert _parts_by(metrics, 1) == [(full_name(2), 1, 1)]
    checked = verify(tmp_path, url)
    assert checked.returncode == 0, checked.stdout
    for rank in (0, 1):  # each rank's own state, from the node that held it
        state, _ = restore(tmp_path, url, 2, rank)
        assert torch.equal(state["model"]["w"], _weights(2, rank))


def _lead_and_follow(leader: Drain, follower: Drain, name: str, meanwhile: Callable[[], object] = lambda: None
                     ) -> Exception | None:
    """The leader's round, `meanwhile` and the follower's once rank 0's part of `name` is in the
    tier; the leader's error, if any."""
    errors: list[Exception] = []

    def lead() -> None:
        try:
            leader.round()
        except Exception as e:  # noqa: BLE001 - returned to the test
            errors.append(e)

    thread = threading.Thread(target=lead)
    thread.start()
    deadline = time.monotonic() + 60
    while thread.is_alive() and leader.tier.ranks_up(leader.tier.listing()[0].get(name, {})) != {0}:
        assert time.monotonic() < deadline, leader.tier.listing()
        time.sleep(0.05)
    meanwhile()
    follower.round()
    thread.join(timeout=60)
    return errors[0] if errors else None


def test_a_part_of_another_run_of_the_step_is_never_committed(tmp_path):
    """Node 1 replaced: the job resumes from an older step and runs step 2 again, which node 1
    commits anew (same tensors, another index), while the leader's round begun before the
    restart still uploads step 2 as first committed. The leader never publishes a commit object
    over a rank-1 index it does not name (the step would be unreadable there): it removes the
    record and the round fails, found by the index read back, or, where node 0's --dir holds
    the re-run's step 2 by then, by that; the next round commits a readable one."""
    node0, _ = _node_local(tmp_path / "before")
    rerun0, node1 = _node_local(tmp_path / "rerun", run=1)
    url, metrics = str(tmp_path / "remote"), tmp_path / "metrics"
    leader, follower = _drain(node0, url, 0, metrics), _drain(node1, url, 1, metrics)

    def rerun_on_node0() -> None:
        shutil.rmtree(node0.root / full_name(2))
        shutil.copytree(rerun0.root / full_name(2), node0.root / full_name(2))

    for meanwhile, said in ((lambda: None, "rank 1's index"), (rerun_on_node0, "holds another run")):
        error = _lead_and_follow(leader, follower, full_name(2), meanwhile)
        assert isinstance(error, CorruptCheckpoint) and said in str(error), error
        assert open_tier(url).listing()[0] == {}, "a record of two runs of the step left in the tier"
    assert _lead_and_follow(leader, follower, full_name(2)) is None
    assert open_tier(url).committed() == [full_name(2)]
    checked = verify(tmp_path, url)
    assert checked.returncode == 0, checked.stdout
    state, _ = restore(tmp_path, url, 2, 1)
    assert torch.equal(state["model"]["w"], _weights(2, 1))


def test_a_missing_part_is_uploaded_by_the_leader_where_it_can(tmp_path, monkeypatch):
    """A rank whose engine never uploads: on a shared --dir the leader uploads its part itself;
    on a node-local one the round fails and no commit object names the missing part."""
    monkeypatch.setattr(drain, "PART_WAIT_S", 0.3)
    shared = _local_steps(tmp_path / "shared", world_size=2)
    url, metrics = str(tmp_path / "remote"), tmp_path / "metrics"
    _drain(shared, url, 0, metrics).round()
    assert open_tier(url).committed() == [full_name(2)]
    assert _parts_by(metrics, 0) == [(full_name(2), 0, 0), (full_name(2), 1, 0)]
    node0, _ = _node_local(tmp_path / "local")
    url = str(tmp_path / "remote-local")
    with pytest.raises(RuntimeError, match="rank 1's part did not reach"):
        _drain(node0, url, 0, tmp_path / "metrics-local").round()
    assert open_tier(url).committed() == []


def test_two_ranks_each_upload_their_own_part(s3, tmp_path):
    """A run of two ranks: each engine uploads only its own rank's parts, every remote step
    holds both, and each rank's state restores from the URL as the script saved it."""
    url = f"s3://{s3.bucket()}/run"
    ok(ckptrun(tmp_path, "--nproc-per-node", "2", "--strategy", "checkfreq", "--dir", tmp_path / "ckpts",
               "--durable", url, "--metrics-dir", tmp_path / "metrics", EXAMPLE, *TINY, "--save-at", STEPS,
               "--save-path", tmp_path / "own-{rank}.pt"))
    metrics = tmp_path / "metrics"
    parts = {rank: _parts_by(metrics, rank) for rank in (0, 1)}
    for rank, uploaded in parts.items():
        assert uploaded and {(r, by) for _, r, by in uploaded} == {(rank, rank)}, parts
    committed = open_tier(url).committed()
    assert committed and set(committed) <= {name for name, _, _ in parts[1]}, (committed, parts)
    for rank in (0, 1):
        state, _ = restore(tmp_path, url, "latest", rank)
        assert state["step"] == STEPS
        assert_training_state(state, load(tmp_path / f"own-{rank}.pt"))


def test_ls_shows_each_steps_tiers(tmp_path, monkeypatch):
    """`ls --dir` lists the remote tier the run's --dir records (or `--durable`) beside it, with
    each step's tiers, readable at 80 columns; a recorded tier that cannot be read, or a crafted
    record of one, is one line and --dir is listed alone."""
    from rich.console import Console

    from ckptrun import cli as entry
    from ckptrun.storage.tiers.recorded import NAME, record

    ckpts = _local_steps(tmp_path / "ckpts").root
    remote = tmp_path / "remote"
    tier = open_tier(str(remote))
    tier.probe()
    for store in (Store(ckpts), _local_steps(tmp_path / "later", steps=(3,))):
        m = store.manifests()[-1]
        with record_parts(store, m) as (parts, manifest):
            tier.publish_record(m.name, parts, manifest)

    def listed(*args: str) -> dict[int, list[str] | None]:
        proc = cli(tmp_path, "ls", "--dir", ckpts, "--json", *args)
        assert proc.returncode == 0, proc.stderr
        return {r["step"]: r.get("tiers") for r in json.loads(proc.stdout)}

    both = {1: ["local"], 2: ["local", "remote"], 3: ["remote"]}
    assert listed() == {1: None, 2: None} and listed("--durable", str(remote)) == both
    record(ckpts, str(remote), "")
    assert listed() == both
    console = Console(file=io.StringIO(), width=80)
    monkeypatch.setattr(entry, "out", console)
    assert entry.main(["ls", "--dir", str(ckpts)]) == 0
    lines = console.file.getvalue().splitlines()
    assert all(len(ln) <= 80 for ln in lines) and "tiers" in lines[1], lines
    assert any(" local+remote" in ln and "step-00000002" in ln for ln in lines), lines
    monkeypatch.undo()
    shutil.rmtree(remote)
    for crafted, said in ((None, "not read"), ('{"url": 3}', "not a record of a --durable URL")):
        if crafted:
            (ckpts / NAME).write_text(crafted)
        proc = cli(tmp_path, "ls", "--dir", ckpts)
        line = " ".join(proc.stderr.split())
        assert proc.returncode == 0 and said in line and f"listing {ckpts} alone" in line, proc.stderr
        assert "step-00000002" in proc.stdout and "tiers" not in proc.stdout
    assert error_line(cli(tmp_path, "ls", "--dir", ckpts, "--durable", str(remote))).startswith("ckptrun")


@pytest.mark.parametrize(("steps", "last", "every", "expected"), [
    ([2, 4, 6], -1, 10, None),  # no multiple reached: nothing, not the first step (it was)
    (list(range(1, 13)), -1, 10, Due(10, ())),
    (list(range(1, 13)), 10, 10, None),  # the next is 20
    (list(range(1, 36)), 10, 10, Due(30, (20,))),  # behind: the newest multiple, 20 skipped
    ([3, 6, 9, 12, 15, 18, 21, 24], -1, 10, Due(21, ())),  # no record at 20: the first after it
    ([3, 6, 9, 12, 15, 18, 21, 24], 21, 10, None),  # (21 stood for 20)
    ([30, 40], 37, 10, Due(40, ())),  # a resumed run's tier ends at the last run's final step
])
def test_durable_every_copies_the_multiples(steps, last, every, expected):
    """--durable-every N means what --every N means: the committed multiples of N (before: the
    newest step once N past the last copy: 2, 12, 25, 35 for N = 10)."""
    assert due(steps, last, every) == expected


def test_a_drain_behind_copies_the_newest_multiple_and_says_so_once(tmp_path):
    """A drain that finds two multiples of --durable-every committed copies the newer, says the
    skip once (a warning and a `durable_skip` event), and the run's final step at close."""
    store = _local_steps(tmp_path / "ckpts", steps=(1, 2, 3, 4, 5, 6, 7))
    metrics = tmp_path / "metrics"
    d = _drain(store, str(tmp_path / "remote"), 0, metrics)
    d.every = 3
    d.round()
    assert d.tier.committed() == [full_name(6)]
    _local_steps(store.root, steps=(8, 9, 10, 11, 12, 13))
    d.round()
    d.round()  # nothing due
    assert d.tier.committed() == [full_name(6), full_name(12)]
    _local_steps(store.root, steps=(14,))
    d.round(final=True)  # what close() runs once the thread has stopped
    assert d.tier.committed() == [full_name(6), full_name(12), full_name(14)]
    d.log.flush()
    said = [e for e in map(json.loads, (metrics / "engine-0.jsonl").read_text().splitlines())
            if e["type"] == "durable_skip"]
    assert [(e["step"], e["skipped"]) for e in said] == [(6, [3])], said


def test_auto_interval_follows_bandwidth_and_failure_rate(tmp_path):
    """--durable-every auto: as soon as the last upload is done until the bandwidth and the step
    time are measured, then the tiers' model (`levels.durable_every`, as tune prints it):
    Daly's interval for an upload against the failures that lose --dir (with --node-local-dir,
    node and job failures: half of --mtbf's by default; else job failures), never more often
    than the uploads drain; an explicit value wins."""
    store = _local_steps(tmp_path / "ckpts", steps=(1,))
    metrics = tmp_path / "metrics"
    d = _drain(store, str(tmp_path / "remote"), 0, metrics)
    d.round()
    assert d.tier.committed() == [full_name(1)] and d.upload_Bps
    _local_steps(store.root, steps=(3, 4))
    d.round()  # uploads take far longer than these steps: not due yet
    assert d.tier.committed() == [full_name(1)]
    d.every = 2
    d.round()
    assert d.tier.committed() == [full_name(1), full_name(4)]
    # 1 s a step and 1 MB a step, as measured:
    ms = [dataclasses.replace(m, committed_at=float(m.step), bytes=1 << 20, rank_bytes=[1 << 20])
          for m in store.manifests()]
    d.upload_Bps, d.rates = 1 << 20, failure_rates(3600.0, {})  # 1 s an upload, 1 h between failures
    d.layout = local = Layout(node_local_dir=True)  # a failure losing --dir every 2 h
    assert d.auto_every(ms) == round(daly_interval(1.0, 7200.0)) == durable_every(1.0, 1.0, d.rates, local)[0]
    d.layout = Layout(replicas=2, node_local_dir=True)  # a lost node comes back from partners: only job failures
    assert d.auto_every(ms) == round(daly_interval(1.0, 36000.0)) > 2 * round(daly_interval(1.0, 7200.0))
    d.layout = Layout()  # a shared --dir outlives a lost node: the same
    assert d.auto_every(ms) == round(daly_interval(1.0, 36000.0))
    d.upload_Bps, d.rates, d.layout = 1 << 14, failure_rates(30.0, {}), local  # 64 s an upload: the bound
    assert d.auto_every(ms) == 64
    d.log.flush()
    said = [e for e in map(json.loads, (metrics / "engine-0.jsonl").read_text().splitlines())
            if e["type"] == "durable_interval"]
    assert [e["reason"].split()[0] for e in said[-3:]] == ["Daly's", "Daly's", "as"], said

