"""`--strategy pccheck` beyond the registry's contract tests: the slotted region's persist order
(a crash at any point leaves the newest fully durable step and never a half-written slot), the
pointer only moving forward, the latest slot never reused, a slow rank holding the commit back,
chunks persisted before the checkpoint is sealed, and `--keep K` holding exactly K steps in the
region, each restoring exactly, damaged slots falling back."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest
from conftest import (
    EXAMPLE,
    TINY,
    assert_training_state,
    ckptrun,
    cli,
    copy_dir,
    flip_tensor_byte,
    ok,
    restore,
    tear,
    verify,
)

from ckptrun.ipc.messages import RecordSpec
from ckptrun.storage.region import Geometry, Regions, RegionWriter
from ckptrun.storage.schema import full_name
from ckptrun.storage.store import Store
from ckptrun.strategies.pccheck.engine import PCcheckHandler
from ckptrun.strategies.pccheck.messages import Begin, Ready, Seal

GEOMETRY = Geometry(nslots=4, slot_bytes=8192, meta_bytes=8192)


def committed(root: Path) -> list[int]:
    return [m.step for m in Regions(root).scan()[0]]


def index(step: int, rank: int, nbytes: int) -> bytes:
    return (b'{"format": 1, "record": "%s", "rank": %d, "data": "rank-%05d.data", "data_nbytes": %d, '
            b'"tensors": {}, "skeleton": {}, "meta": {}}') % (full_name(step).encode(), rank, rank, nbytes)


def persist(w: RegionWriter, counter: int, step: int, *, upto: str = "pointer") -> int:
    """One checkpoint through the persist order, stopping (a crash) after stage `upto`."""
    slot = w.acquire(timeout=1)
    w.invalidate(slot)
    w.write(slot, 0, memoryview(bytes([step % 256]) * 4096))
    if upto == "data":
        return slot
    w.sync()
    w.write_meta(slot, counter=counter, step=step, world_size=1, data_nbytes=4096,
                 index_raw=index(step, w.rank, 4096), meta={}, written_at=time.time())
    if upto == "meta":
        return slot
    w.publish(counter, slot, step)
    return slot


@pytest.mark.parametrize("upto", ["data", "meta", "pointer"])
def test_a_crash_anywhere_in_the_persist_order_keeps_the_newest_durable_step(tmp_path, upto):
    w = RegionWriter(tmp_path, 0, 0, GEOMETRY)
    persist(w, 1, 10)
    persist(w, 2, 20, upto=upto)  # the process dies here
    assert committed(tmp_path) == ([10, 20] if upto == "pointer" else [10])


def test_a_torn_pointer_write_leaves_the_previous_pointer(tmp_path):
    w = RegionWriter(tmp_path, 0, 0, GEOMETRY)
    persist(w, 1, 10)
    persist(w, 2, 20)
    with open(w.path, "r+b") as f:  # the second publish went to the second copy: tear it
        f.seek(4096 + 512 + 10)
        f.write(b"\xff\xff")
    assert committed(tmp_path) == [10]


def test_a_torn_pointer_write_never_takes_the_current_pointer_with_it(tmp_path):
    """Counters have gaps (a cancelled or failed checkpoint took one): the write still goes to
    the copy that does not hold the current pointer."""
    w = RegionWriter(tmp_path, 0, 0, GEOMETRY)
    persist(w, 1, 10)
    persist(w, 3, 30)
    with open(w.path, "r+b") as f:  # counter 1 went to the first copy, counter 3 to the second: tear it
        f.seek(4096 + 512 + 10)
        f.write(b"\xff\xff")
    assert committed(tmp_path) == [10]


def test_the_pointer_only_moves_forward_and_its_slot_is_never_reused(tmp_path):
    w = RegionWriter(tmp_path, 0, 0, GEOMETRY)
    newer = persist(w, 3, 30)
    older = persist(w, 2, 20, upto="meta")  # finished after a newer checkpoint did
    moved, before = w.publish(2, older, 20)
    assert not moved and before.step == 30 and w.pointer.step == 30
    with pytest.raises(RuntimeError, match="latest checkpoint"):
        w.release(newer)
    w.release(older)
    taken = [w.acquire(timeout=0.01) for _ in range(GEOMETRY.nslots)]
    assert newer not in taken and taken[-1] is None  # the free queue never holds the pointer's slot
    assert committed(tmp_path) == [30]


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_region_written_direct_holds_the_bytes_of_each_slot(tmp_path, engine, monkeypatch):
    """pccheck's region (`direct`: no process maps it) takes its data through the engine's file
    writer, the native one with O_DIRECT where it can run: chunks written from several threads
    land exactly, and a reader of the file finds each slot's bytes once it is committed."""
    from ckptrun.storage import iowriter

    monkeypatch.setattr(iowriter, "_current", None)
    iowriter.select(engine)
    g = Geometry(nslots=3, slot_bytes=3 << 20, meta_bytes=8192)
    w = RegionWriter(tmp_path, 0, 0, g, direct=True)
    data = {step: random.Random(step).randbytes(g.slot_bytes - 5) for step in (10, 20)}
    for counter, (step, payload) in enumerate(data.items(), 1):
        slot = w.acquire(timeout=1)
        w.invalidate(slot)
        cuts = [0, 4096, 1 << 20, (1 << 20) + 3, len(payload)]
        threads = [threading.Thread(target=w.write, args=(slot, a, memoryview(payload)[a:b]))
                   for a, b in zip(cuts, cuts[1:], strict=False)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        w.sync()
        w.write_meta(slot, counter=counter, step=step, world_size=1, data_nbytes=len(payload),
                     index_raw=index(step, 0, len(payload)), meta={}, written_at=time.time())
        w.publish(counter, slot, step)
        with open(w.path, "rb") as f:
            f.seek(g.data_at(slot))
            assert f.read(len(payload)) == payload, step
    w.close()
    assert committed(tmp_path) == [10, 20]


class FakeEngine:
    """The EngineContext surface the pccheck handler uses, for one rank, in-process."""

    def __init__(self, root: Path, rank: int, world_size: int, keep: int = 1) -> None:
        self.root, self.rank, self.world_size, self.keep = str(root), rank, world_size, keep
        self.staging = {0: bytearray(8192), 1: bytearray(8192), 2: bytearray(8192)}
        self.events: list[tuple] = []
        self.threads: list[threading.Thread] = []

    def run(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args)
        t.start()
        self.threads.append(t)

    def slot_view(self, slot: int) -> memoryview:
        return memoryview(self.staging[slot])

    def free_slot(self, slot: int) -> None:
        self.events.append(("free", slot))

    def fault_hook(self, step: int):
        return lambda point: None

    def durable(self, step: int, record: str, nbytes: int, write_s: float) -> None:
        self.events.append(("durable", step))

    def committed(self, step: int, record: str, nbytes: int = 0, snapshot_time: float | None = None) -> None:
        self.events.append(("committed", step))

    def save_error(self, step: int, record: str, error: str) -> None:
        raise AssertionError(error)

    def write_now(self, spec: RecordSpec, data: memoryview) -> int:
        raise AssertionError("nothing outgrows the region here")

    def join(self) -> None:
        for t in self.threads:
            t.join(10)

    def of(self, kind: str) -> list[int]:
        return [v for k, v in self.events if k == kind]


def checkpoint(handler: PCcheckHandler, step: int, slot: int, *, seal: bool = True) -> None:
    ctx = handler.ctx
    ctx.staging[slot][:4096] = bytes([step]) * 4096
    handler.handle(Begin(step=step, slot=slot, capacity=8192, meta_hint=1024, chunk=4096, writers=2, inflight=2))
    handler.handle(Ready(step=step, upto=4096))
    if seal:
        handler.handle(Seal(slot=slot, nbytes=4096, chunk=4096, writers=2, inflight=2,
                            spec=RecordSpec(record=full_name(step), kind="full", step=step, skeleton={},
                                            tensors={}, meta={})))


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def test_chunks_persist_before_the_seal_and_a_slow_rank_holds_the_commit_back(tmp_path):
    ranks = [PCcheckHandler(FakeEngine(tmp_path, r, 2)) for r in range(2)]
    for h in ranks:
        checkpoint(h, 1, 0)
    for h in ranks:
        h.ctx.join()
    for h in ranks:
        h.tick()
        assert h.ctx.of("committed") == [1]
    fast, slow = ranks
    checkpoint(fast, 2, 1)
    checkpoint(slow, 2, 1, seal=False)  # rank 1 copies step 2 but has not sealed it yet
    wait_for(lambda: slow.writer is not None and len(slow.writer.steps) == 1
             and open(slow.writer.path, "rb").read()[slow.writer.geometry.data_at(1):][:1] == b"\x02")
    fast.ctx.join()
    fast.tick()
    # Rank 0 has step 2 durable, rank 1 only its first chunk: the run's newest step stays 1,
    # and rank 0 keeps step 1's slot, since it is still the only step every rank holds.
    assert committed(tmp_path) == [1] and fast.ctx.of("committed") == [1] and fast.ctx.of("durable") == [1, 2]
    assert sorted(fast.writer.steps.values()) == [1, 2]
    slow.handle(Seal(slot=1, nbytes=4096, chunk=4096, writers=2, inflight=2,
                     spec=RecordSpec(record=full_name(2), kind="full", step=2, skeleton={}, tensors={}, meta={})))
    slow.ctx.join()
    for h in ranks:
        h.tick()
        assert h.ctx.of("committed") == [1, 2]
        assert sorted(h.writer.steps.values()) == [2]  # --keep 1: step 1's slot is free again
    assert committed(tmp_path) == [2]


def test_an_unsealed_checkpoint_of_a_dead_worker_is_dropped(tmp_path):
    h = PCcheckHandler(FakeEngine(tmp_path, 0, 1))
    checkpoint(h, 1, 0)
    checkpoint(h, 2, 1, seal=False)
    wait_for(lambda: h.writer is not None and 2 not in h.jobs or h.jobs[2].ready)
    h.flush()  # a new worker connects
    h.ctx.join()
    assert h.ctx.of("free") == [0]  # the unsealed job's staging slot belongs to the new worker
    assert committed(tmp_path) == [1]


def alone_after_step_1(root: Path, steps: tuple[tuple[int, int], ...]) -> tuple[PCcheckHandler, PCcheckHandler]:
    """Handlers of ranks 0 and 1: both commit step 1, then rank 0 alone makes `steps` ((step,
    staging slot) pairs) durable, as if rank 1 had died."""
    rank0, rank1 = (PCcheckHandler(FakeEngine(root, r, 2)) for r in range(2))
    for h in (rank0, rank1):
        checkpoint(h, 1, 0)
        h.ctx.join()
    for step, slot in steps:
        checkpoint(rank0, step, slot)
        rank0.ctx.join()
    return rank0, rank1


def ends_in_time(fn, what: str) -> None:
    """`fn()` returns within 10 s, even with a job waiting for a region slot."""
    t = threading.Thread(target=fn)
    t.start()
    t.join(10)
    assert not t.is_alive(), f"{what} waited for a region slot forever"


def test_a_restarted_worker_retracts_steps_a_dead_rank_never_wrote(tmp_path):
    """Rank 1 died after step 1: rank 0's steps 2-4 can never commit and hold every free region
    slot, and step 5 waits for one. The new worker's Hello must not wait for it forever: step 5
    gives up, steps 2-4 are retracted (the pointer's bound goes back to step 1, their slots are
    free), and the steps the new workers write again commit."""
    rank0, rank1 = alone_after_step_1(tmp_path, ((2, 1), (3, 2), (4, 0)))
    assert rank0.ctx.of("durable") == [1, 2, 3, 4] and not rank0.writer.free
    checkpoint(rank0, 5, 1)
    wait_for(lambda: 5 in rank0.jobs)
    ends_in_time(rank0.restart, "the new worker's Hello")
    assert committed(tmp_path) == [1] and rank0.writer.pointer.step == 1
    assert sorted(rank0.writer.steps.values()) == [1] and len(rank0.writer.free) == GEOMETRY.nslots - 1
    for h in (rank0, rank1):  # the new workers write step 2 again
        checkpoint(h, 2, 1)
        h.ctx.join()
    rank0.tick()
    assert committed(tmp_path) == [2] and rank0.ctx.of("committed") == [1, 2]


def test_a_new_engine_retracts_what_the_dead_engine_left_uncommitted(tmp_path):
    """A replaced node: rank 0's engine died with steps 2-3 durable in its region file, which rank
    1 never wrote. The new engine's first Hello (before its worker writes anything) retracts
    them, so rank 1 writing step 2 of the resumed run does not commit it beside the dead run's
    part; step 1 stays committed until the new parts of step 2 commit."""
    dead0, rank1 = alone_after_step_1(tmp_path, ((2, 1), (3, 2)))
    assert committed(tmp_path) == [1]
    new0 = PCcheckHandler(FakeEngine(tmp_path, 0, 2))
    new0.restart()  # its worker's Hello
    assert sorted(new0.old[0].steps.values()) == [1] and new0.old[0].pointer.step == 1
    checkpoint(rank1, 2, 1)
    rank1.ctx.join()
    rank1.tick()
    assert committed(tmp_path) == [1] and rank1.ctx.of("committed") == [1]
    checkpoint(new0, 2, 1)
    new0.ctx.join()
    rank1.tick()
    assert committed(tmp_path) == [2] and rank1.ctx.of("committed") == [1, 2]


def test_a_handler_given_up_lets_go_of_its_region_file_untouched(tmp_path):
    """Rank 0's worker came back as another rank (the rendezvous ranked the nodes anew): its
    engine gives the handler up, even with a job waiting for a region slot, and leaves rank 0's
    file as it was (steps 2-4 included) for the engine now holding rank 0, which retracts them."""
    rank0, _ = alone_after_step_1(tmp_path, ((2, 1), (3, 2), (4, 0)))
    checkpoint(rank0, 5, 1)
    wait_for(lambda: 5 in rank0.jobs)
    path = rank0.writer.path
    before = path.read_bytes()
    ends_in_time(rank0.close, "giving the handler up")
    assert path.read_bytes() == before and rank0.writer is None and not rank0.old
    adopter = PCcheckHandler(FakeEngine(tmp_path, 0, 2))
    adopter.restart()
    assert sorted(adopter.old[0].steps.values()) == [1] and committed(tmp_path) == [1]


@pytest.fixture(scope="module")
def keep3(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("keep3")
    ok(ckptrun(cwd, "--strategy", "pccheck", "--max-inflight", "3", "--chunk-mb", "1", "--keep", "3",
               "--dir", "ckpts", EXAMPLE, *TINY))
    return cwd / "ckpts"


def test_keep_holds_that_many_steps_in_the_region_each_exact(keep3, example_truth, tmp_path):
    steps = int(TINY[TINY.index("--steps") + 1])
    manifests = Store(keep3).manifests()
    assert [(m.step, m.layout) for m in manifests] == [(s, "region") for s in range(steps - 2, steps + 1)]
    assert sorted(p.name for p in keep3.iterdir() if p.name.startswith(("step-", "region-"))) == \
        ["region-r00000-g0000.ckpt"]
    for step in (steps - 2, steps):
        state, _ = restore(tmp_path, keep3, step)
        assert_training_state(state, example_truth(step))


@pytest.mark.parametrize("how", ["no-manifest", "truncated", "bad-manifest"])
def test_a_damaged_newest_slot_falls_back_to_the_previous_step(keep3, example_truth, tmp_path, how):
    ckpt = copy_dir(keep3, tmp_path / "ckpts")
    newest = Store(ckpt).manifests()[-1].step
    tear(ckpt, newest, how)
    state, _ = restore(tmp_path, ckpt, "latest")
    assert state["step"] == newest - 1
    assert_training_state(state, example_truth(newest - 1))


def test_verify_reports_a_flipped_byte_in_a_slot(keep3, tmp_path):
    ckpt = copy_dir(keep3, tmp_path / "ckpts")
    newest = Store(ckpt).manifests()[-1]
    key = flip_tensor_byte(ckpt, newest.step)
    proc = verify(tmp_path, ckpt)
    assert proc.returncode == 1
    bad = [line for line in proc.stdout.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1 and newest.name in bad[0] and key in bad[0], proc.stdout
    listing = ok(cli(tmp_path, "ls", "--dir", ckpt, "--json"))
    assert {row["layout"] for row in json.loads(listing.stdout)} == {"region"}


def test_a_newer_step_finishing_first_keeps_the_pointer_on_it(tmp_path):
    """Counters follow the order checkpoints are announced in, not the order their jobs finish."""
    h = PCcheckHandler(FakeEngine(tmp_path, 0, 1, keep=2))
    checkpoint(h, 1, 0, seal=False)
    checkpoint(h, 2, 1)
    wait_for(lambda: 2 in h.ctx.of("durable"))
    h.handle(Seal(slot=0, nbytes=4096, chunk=4096, writers=2, inflight=2,
                  spec=RecordSpec(record=full_name(1), kind="full", step=1, skeleton={}, tensors={}, meta={})))
    h.ctx.join()
    h.tick()
    assert h.writer.pointer.step == 2 and committed(tmp_path) == [1, 2]
