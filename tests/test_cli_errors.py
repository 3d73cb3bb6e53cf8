"""Bad input gets a one-line error naming the problem and the fix, a non-zero exit, no traceback,
and leaves nothing half-written."""

from __future__ import annotations

from pathlib import Path

from conftest import EXAMPLE, TINY, ckptrun, error_line, ok

from ckptrun.storage.dirlock import LOCK
from ckptrun.storage.store import Store
from ckptrun.strategies import names


def files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` with its size and modification time (but the run lock, which every
    run takes and releases)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(LOCK)}


def test_unknown_strategy(tmp_path):
    proc = ckptrun(tmp_path, "--strategy", "nope", "--dir", "ckpts", EXAMPLE, *TINY)
    line = error_line(proc)
    assert proc.returncode == 2 and "nope" in line
    assert all(name in line for name in names()), line
    assert not (tmp_path / "ckpts").exists()


def test_missing_script(tmp_path):
    proc = ckptrun(tmp_path, "--dir", "ckpts", "no_such_train.py", "--steps", "3")
    line = error_line(proc)
    assert proc.returncode == 2 and "no_such_train.py" in line and "not found" in line
    assert not (tmp_path / "ckpts").exists()


def test_unwritable_dir(tmp_path):
    (tmp_path / "plain-file").write_text("not a directory")
    proc = ckptrun(tmp_path, "--dir", "plain-file/ckpts", EXAMPLE, *TINY)
    line = error_line(proc)
    assert proc.returncode == 2 and "plain-file/ckpts" in line and "--dir" in line
    assert (tmp_path / "plain-file").read_text() == "not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain-file"]


def test_restore_of_a_missing_step(example_run, tmp_path):
    ckpt = example_run("sync")
    proc = ckptrun(tmp_path, "restore", "--dir", ckpt, "--step", "99", "--out", "r.pt")
    line = error_line(proc)
    assert proc.returncode == 2 and "step 99" in line
    assert "available steps: 1-12" in line or "available steps: 1, 2" in line, line
    assert list(tmp_path.iterdir()) == []


def test_resume_with_another_model(tmp_path):
    ok(ckptrun(tmp_path, "--dir", "ckpts", EXAMPLE, *TINY, "--d-model", "64", "--steps", "2"))
    before = files(tmp_path / "ckpts")
    assert [m.step for m in Store(tmp_path / "ckpts").manifests()] == [1, 2]

    proc = ckptrun(tmp_path, "--dir", "ckpts", EXAMPLE, *TINY, "--steps", "2")
    line = error_line(proc)
    assert "another model" in line and "(256, 64) there, (256, 32) here" in line, line
    assert "--dir" in line, "the error names the fix"
    assert files(tmp_path / "ckpts") == before
