"""The engine's commit protocol in-process (no worker, no subprocess): records commit in step
order once they and their dependencies are durable, a failed record takes its dependents with
it, and every outcome reaches the worker as one typed event."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import pack

from ckptrun.engine.server import Engine
from ckptrun.ipc.messages import Committed, Durable, Message, RecordSpec, SaveError
from ckptrun.storage.store import Store, diff_name, full_name


@pytest.fixture
def engine(tmp_path: Path) -> tuple[Engine, list[Message]]:
    """A rank-0 engine over an empty store; what it would send the worker is collected."""
    eng = Engine(0, "unit", None)
    state = eng.state
    state.store = Store(tmp_path / "ckpts")
    state.store.ensure_writable()
    state.rank, state.world_size, state.keep, state.io_threads = 0, 1, 0, 1
    sent: list[Message] = []
    state.link.send = sent.append
    return eng, sent


def spec(kind: str, step: int, first: int | None = None, depends_on: tuple[str, ...] = ()) -> tuple[RecordSpec, bytes]:
    skeleton, data, tensors = pack({"w": torch.full((4,), float(step))})
    name = full_name(step) if kind == "full" else diff_name(first, step)
    return RecordSpec(record=name, kind=kind, step=step, first_step=first, depends_on=list(depends_on),
                      skeleton=skeleton, tensors=tensors, meta={"step": step}), data


def write(eng: Engine, rs: RecordSpec, data: bytes) -> None:
    eng.commits.write_part(rs, memoryview(data))


def test_a_record_waits_for_what_it_depends_on_then_both_commit_in_step_order(engine):
    eng, sent = engine
    base, base_data = spec("full", 4)
    diff, diff_data = spec("diff", 6, first=5, depends_on=(base.record,))
    write(eng, diff, diff_data)  # durable first, but its base is not committed yet
    assert eng.state.store.manifests() == [] and [type(m) for m in sent] == [Durable]
    write(eng, base, base_data)
    assert [m.name for m in eng.state.store.manifests()] == [base.record, diff.record]
    assert [(m.step, m.record) for m in sent if isinstance(m, Committed)] == [(4, base.record), (6, diff.record)]
    assert eng.commits.pending == {} and eng.state.committed_step == 6


def test_a_failed_record_abandons_its_dependents_and_leaves_the_last_commit(engine, monkeypatch):
    eng, sent = engine
    first, first_data = spec("full", 1)
    write(eng, first, first_data)
    base, base_data = spec("full", 2)
    diff, diff_data = spec("diff", 3, first=3, depends_on=(base.record,))
    write(eng, diff, diff_data)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(eng.state.store, "write_rank", full_disk)
    write(eng, base, base_data)
    monkeypatch.undo()
    eng.commits.commit_ready()
    assert [m.name for m in eng.state.store.manifests()] == [first.record]
    errors = {m.record: m.error for m in sent if isinstance(m, SaveError)}
    assert "No space left" in errors[base.record] and f"depends on {base.record}" in errors[diff.record]
    assert not (eng.state.store.root / diff.record).exists() and eng.commits.pending == {}


def test_a_committed_record_is_never_rewritten(engine):
    eng, sent = engine
    rs, data = spec("full", 5)
    write(eng, rs, data)
    before = {p.name: p.read_bytes() for p in (eng.state.store.root / rs.record).iterdir()}
    other, _ = spec("full", 5)
    write(eng, other, bytes(len(data)))  # a re-run reaching the same step: the same state, by exactness
    assert {p.name: p.read_bytes() for p in (eng.state.store.root / rs.record).iterdir()} == before
    assert [type(m) for m in sent] == [Durable, Committed, Durable, Committed]


def test_a_handler_that_cannot_give_up_what_it_holds_is_let_go_of_with_one_line(engine, capsys):
    """The worker came back as another rank (--replicas): what the handler cannot cut for the
    node that has its old rank now is left to the records; the Hello goes on."""
    from ckptrun.engine.handlers import EngineHandler

    eng, _ = engine
    closed = []

    class Failing(EngineHandler):
        def give_up(self, rank: int) -> list:
            raise RuntimeError("no room")

        def close(self) -> None:
            closed.append(True)

    eng.handler, eng.strategy = Failing(None), "lowdiff+"
    assert eng._give_up_handler(True) == []
    assert closed == [True] and eng.handler is None and eng.strategy is None
    said = [line for line in capsys.readouterr().err.splitlines() if "not kept" in line]
    assert said == ["ckptrun: rank 0: what the engine held of this rank is not kept for the node that has it now "
                    "(RuntimeError: no room); it resumes from --dir"], said
