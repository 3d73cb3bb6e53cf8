"""The store's commit protocol (DESIGN invariant 2): a crash between any two steps of a commit
leaves the previous step restorable, checksums catch any flipped byte, retention never drops the
newest committed record."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, assert_same, logged, pack, run_cmd, verify

from ckptrun.errors import CorruptCheckpoint
from ckptrun.restore.recovery import newest_good
from ckptrun.storage import store_read
from ckptrun.storage.schema import Manifest
from ckptrun.storage.store import MANIFEST, Store, full_name, rank_files
from ckptrun.storage.tree import unflatten

FAULT_POINTS = [f"{file}:{point}" for file in ("data", "index", "manifest")
                for point in ("open", "written", "synced", "renamed", "dir-synced")]
# The record exists for readers once the manifest's rename is done, not before.
COMMITTED_AFTER = {"manifest:renamed", "manifest:dir-synced"}


def make_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "models": {"model": {"w": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
                             "n": torch.tensor(step)}},
        "optimizers": {"optimizer": {"state": {0: {"step": torch.tensor(float(step))}},
                                     "param_groups": [{"lr": 0.1 * step, "betas": (0.9, 0.999), "params": [0]}]}},
        "step": step,
    }


def write(store: Store, step: int, state: dict, **kwargs) -> None:
    skeleton, data, specs = pack(state)
    store.write_rank(full_name(step), 0, memoryview(data), specs, skeleton, {"step": step}, **kwargs)


def commit(store: Store, step: int, state: dict) -> None:
    write(store, step, state)
    assert store.try_commit(full_name(step), kind="full", step=step, first_step=step, world_size=1) is not None


def stored(store: Store, step: int) -> dict:
    """The state of committed `step`, read through the checksummed path."""
    index, tensors = store.read_rank(store.manifest(full_name(step)), 0)
    return unflatten(index["skeleton"], tensors)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "ckpts")
    s.ensure_writable()
    return s


def test_a_written_part_summarises_itself_as_the_files_read_back_do(store):
    """The engine reports a part's summary from what it wrote (`WrittenPart.summary`), not by
    reading its index back: the two must be what a manifest pins."""
    skeleton, data, specs = pack(make_state(3))
    part = store.write_rank(full_name(3), 0, memoryview(data), specs, skeleton, {"step": 3})
    assert part.summary() == store.part_summary(full_name(3), 0)


def test_fault_points_are_every_step_of_a_commit(store):
    seen: list[str] = []
    write(store, 1, make_state(1), fault=seen.append)
    store.try_commit(full_name(1), kind="full", step=1, first_step=1, world_size=1, fault=seen.append)
    assert seen == FAULT_POINTS


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_crash_mid_commit_keeps_previous_step(point, store, tmp_path):
    commit(store, 1, make_state(1))
    skeleton, data, specs = pack(make_state(2))
    payload = tmp_path / "payload"
    payload.with_suffix(".data").write_bytes(data)
    payload.with_suffix(".json").write_text(json.dumps({"tensors": specs, "skeleton": skeleton}))

    proc = run_cmd([sys.executable, SCRIPTS / "crash_commit.py", store.root, 2, payload, point], tmp_path)
    assert proc.returncode == 137, f"fault point {point} never reached\n{proc.stderr}"

    committed = point in COMMITTED_AFTER
    assert [m.step for m in store.manifests()] == ([1, 2] if committed else [1])
    assert newest_good(store).step == (2 if committed else 1)
    assert_same(stored(store, 1), make_state(1))
    report = verify(tmp_path, store.root)
    if committed:
        assert_same(stored(store, 2), make_state(2))
        assert report.returncode == 0, report.stdout
        return
    notes = [line for line in report.stdout.splitlines() if line.startswith(("BAD", "note"))]
    assert report.returncode == 0 and notes == [f"note: {full_name(2)}: incomplete (no manifest; torn or still "
                                                "being written), not committed"], report.stdout
    # A restarted writer publishes the same step over the torn leftovers.
    commit(store, 2, make_state(2))
    assert store.incomplete() == []
    assert_same(stored(store, 2), make_state(2))


def _bump_last_digit(path: Path, field: str) -> None:
    """Change one digit of a JSON number field: still valid JSON, different bytes."""
    text = path.read_text()
    m = re.search(rf'"{field}":\s*-?\d*(\d)', text)
    assert m, f"no {field} in {path}"
    i = m.start(1)
    path.write_text(text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:])


def _flip_data(store: Store) -> str:
    index = json.loads((store.root / full_name(2) / rank_files(0)[1]).read_text())
    spec = index["tensors"]["models/model/w"]
    path = store.root / full_name(2) / rank_files(0)[0]
    raw = bytearray(path.read_bytes())
    raw[spec["offset"] + 17] ^= 0x80
    path.write_bytes(bytes(raw))
    return "tensor 'models/model/w' checksum mismatch"


def _flip_index(store: Store) -> str:
    _bump_last_digit(store.root / full_name(2) / rank_files(0)[1], "offset")
    return "index checksum mismatch"


def _flip_manifest(store: Store) -> str:
    _bump_last_digit(store.root / full_name(2) / MANIFEST, "bytes")
    return "manifest"


@pytest.mark.parametrize("flip", [_flip_data, _flip_index, _flip_manifest], ids=["data", "index", "manifest"])
def test_flipped_byte_is_detected(flip, store, tmp_path):
    commit(store, 1, make_state(1))
    commit(store, 2, make_state(2))
    problem = flip(store)

    with pytest.raises(CorruptCheckpoint, match=problem):
        stored(store, 2)
    with logged() as lines:
        assert newest_good(store).step == 1
    assert any("step 2" in line or "step-00000002" in line for line in lines), lines
    assert_same(stored(store, 1), make_state(1))
    report = verify(tmp_path, store.root)
    bad = [line for line in report.stdout.splitlines() if line.startswith("BAD")]
    assert report.returncode == 1 and len(bad) == 1 and full_name(2) in bad[0] and problem in bad[0], \
        report.stdout + report.stderr


def test_a_scan_parses_again_only_the_manifests_changed_since_the_last_one(store, monkeypatch):
    """The engine lists --dir at every commit and retention (a lowdiff chain: hundreds of
    records): an unchanged manifest is not parsed again, one rewritten in place (same size, its
    modified time put back) is, and so is any written under RACY_S ago."""
    for step in (1, 2, 3):
        commit(store, step, make_state(step))
    parsed: list[str] = []
    real = Manifest.from_json
    monkeypatch.setattr(Manifest, "from_json", staticmethod(lambda body: parsed.append(body["name"]) or real(body)))
    store.manifests()
    assert parsed == [full_name(s) for s in (1, 2, 3)]  # written just now: racy, parsed every time
    store.manifests()
    assert len(parsed) == 6

    monkeypatch.setattr(store_read, "RACY_S", 0.0)
    store.manifests()
    parsed.clear()
    assert [m.step for m in store.manifests()] == [1, 2, 3] and parsed == []

    path = store.root / full_name(2) / MANIFEST
    before = path.stat()
    time.sleep(0.05)  # past the filesystem's timestamp granularity
    _flip_manifest(store)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns
    assert [m.step for m in store.manifests(warn=False)] == [1, 3] and parsed == [full_name(2)]
    assert "checksum mismatch" in store.unreadable()[full_name(2)]

    store.remove(full_name(3))
    parsed.clear()
    assert [m.step for m in store.manifests(warn=False)] == [1] and parsed == [full_name(2)]


def test_prune_keeps_the_newest_k(store):
    for step in range(1, 6):
        commit(store, step, make_state(step))
    assert store.prune(0) == []
    assert store.prune(2) == [full_name(s) for s in (1, 2, 3)]
    assert [m.step for m in store.manifests()] == [4, 5]
    for step in (4, 5):
        assert_same(stored(store, step), make_state(step))
    assert not any((store.root / full_name(s)).exists() for s in (1, 2, 3))


def test_prune_never_drops_the_newest_committed_for_a_torn_newer_one(store):
    for step in (1, 2, 3):
        commit(store, step, make_state(step))
    write(store, 4, make_state(4))  # its files are durable, its manifest never came
    store.prune(1, incomplete_grace_s=0)
    assert [m.step for m in store.manifests()] == [3]
    assert newest_good(store).step == 3
    assert_same(stored(store, 3), make_state(3))
    assert store.incomplete() == [full_name(4)]  # newer than every commit: maybe still being written


def test_prune_drops_old_torn_records_after_the_grace_period(store):
    commit(store, 1, make_state(1))
    write(store, 2, make_state(2))
    commit(store, 3, make_state(3))
    assert store.prune(0) == []
    assert store.incomplete() == [full_name(2)]
    assert store.prune(0, incomplete_grace_s=0) == [full_name(2)]
    assert store.incomplete() == [] and [m.step for m in store.manifests()] == [1, 3]


def test_a_part_whose_data_was_removed_is_not_committed(store):
    """A resume's sweep of records without a manifest once removed a part's data file while its
    index stayed (two-node pccheck, ranks swapped): the commit then pinned an index whose data
    was gone. An index alone is not a part; written again, the part commits."""
    write(store, 1, make_state(1))
    name = full_name(1)
    data = store.root / name / rank_files(0)[0]
    data.unlink()
    assert store.try_commit(name, kind="full", step=1, first_step=1, world_size=1) is None
    assert not (store.root / name / MANIFEST).exists()
    commit(store, 1, make_state(1))
    assert_same(stored(store, 1), make_state(1))


def test_abandon_removes_an_uncommitted_record_and_never_a_committed_one(store, monkeypatch):
    """`abandon` checks that a record is not committed, then removes it: a commit landing between
    the two (the check made before it) finds the record put back whole, and a leftover of an
    abandon cut short is swept once no writer is left."""
    write(store, 1, make_state(1))
    store.abandon(full_name(1))
    assert not (store.root / full_name(1)).exists() and store.incomplete() == []
    commit(store, 2, make_state(2))
    files = sorted(p.name for p in (store.root / full_name(2)).iterdir())
    monkeypatch.setattr(store.reader, "is_committed", lambda name: False)  # the check ran before the commit
    store.abandon(full_name(2))
    monkeypatch.undo()
    assert sorted(p.name for p in (store.root / full_name(2)).iterdir()) == files
    assert_same(stored(store, 2), make_state(2))
    left = store.root / ".abandoned-step-00000003-1"
    left.mkdir()
    (left / "rank-00000.data").write_bytes(b"x")
    store.sweep_incomplete()
    assert not left.exists() and [m.step for m in store.manifests()] == [2]
