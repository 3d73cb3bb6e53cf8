"""A checkpoint directory is untrusted input (DESIGN invariant 7): a damaged, hand-edited or
crafted record gives `verify` a BAD line and `restore` a one-line error naming it, `restore
latest` falls back past it, nothing outside --dir is read or touched, no module the checkpoint
names is imported, and no field makes a reader hang or allocate what the field says.

One small lowdiff checkpoint (full records at steps 0 and 5, diff records 1-3, 4-5 on step 0 and
6-8 on step 5) is copied per case and damaged one way. Every case's commands run in one
interpreter (tests/scripts/cli_batch.py) to import torch once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash
from conftest import EXAMPLE, SCRIPTS, TINY, ckptrun, clean_env, copy_dir, error_line, ok, verify

from ckptrun.restore.recovery import optimizer_classes, restorable, verify_problems
from ckptrun.storage.store import MANIFEST, Store, checksum, diff_name, full_name, rank_files

LOWDIFF = ["--strategy", "lowdiff", "--full-every", "5", "--batch", "3", "--keep", "0"]
STEPS = 8
BASE, DIFF = full_name(5), diff_name(6, 8)
GiB = 1 << 30


def tiny(steps: int) -> list[str]:
    """conftest's TINY example arguments with another number of steps."""
    return [*TINY[: TINY.index("--steps")], "--steps", str(steps), "--threads", "1"]


# ---- the checkpoint and ways to damage it -------------------------------------------------
@pytest.fixture(scope="module")
def lowdiff_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("untrusted-run")
    ok(ckptrun(cwd, *LOWDIFF, "--dir", "ckpts", "--no-dashboard", EXAMPLE, *tiny(STEPS)))
    assert restorable(Store(cwd / "ckpts")) == list(range(STEPS + 1))
    return cwd / "ckpts"


def reseal(ckpt: Path, record: str) -> None:
    """Make a hand-edited record consistent again: index checksums and manifest checksum, as a
    forger would (xxh3 is a checksum, not a signature)."""
    path = ckpt / record / MANIFEST
    body = json.loads(path.read_text())
    body.pop("checksum")
    for rank in list(body.get("index_checksums") or {}):
        index = ckpt / record / rank_files(int(rank))[1]
        if index.is_file() and not index.is_symlink():
            body["index_checksums"][rank] = checksum(index.read_bytes())
    body["checksum"] = checksum(json.dumps(body, sort_keys=True).encode())
    path.write_text(json.dumps(body))


def edit_manifest(record: str, **fields) -> Callable[[Path, Path], None]:
    def mutate(ckpt: Path, root: Path) -> None:
        path = ckpt / record / MANIFEST
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
        reseal(ckpt, record)

    return mutate


def edit_index(record: str, edit: Callable[[dict], None]) -> Callable[[Path, Path], None]:
    def mutate(ckpt: Path, root: Path) -> None:
        path = ckpt / record / rank_files(0)[1]
        index = json.loads(path.read_text())
        edit(index)
        path.write_text(json.dumps(index))
        reseal(ckpt, record)

    return mutate


def first_tensor(**fields) -> Callable[[dict], None]:
    def edit(index: dict) -> None:
        next(iter(index["tensors"].values())).update(fields)

    return edit


def repeated_largest_tensor(times: int) -> Callable[[dict], None]:
    """The index names its largest tensor's bytes `times` more times, under new keys: a reader
    giving each tensor storage of its own would allocate them all."""
    def edit(index: dict) -> None:
        key, entry = max(index["tensors"].items(), key=lambda item: item[1]["nbytes"])
        for i in range(times):
            index["tensors"][f"{key}.again{i}"] = dict(entry)

    return edit


def set_path(path: tuple, value) -> Callable[[dict], None]:
    def edit(index: dict) -> None:
        node = index
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def replace_data(make: Callable[[Path], None]) -> Callable[[Path, Path], None]:
    def mutate(ckpt: Path, root: Path) -> None:
        path = ckpt / DIFF / rank_files(0)[0]
        path.unlink()
        make(path)

    return mutate


def sparse(size: int, *, index_says_so: bool) -> Callable[[Path, Path], None]:
    def mutate(ckpt: Path, root: Path) -> None:
        os.truncate(ckpt / DIFF / rank_files(0)[0], size)
        if index_says_so:
            edit_index(DIFF, set_path(("data_nbytes",), size))(ckpt, root)

    return mutate


def symlinked_record(ckpt: Path, root: Path) -> None:
    (ckpt / DIFF).rename(root / "outside" / DIFF)
    (ckpt / DIFF).symlink_to(root / "outside" / DIFF)


def renamed_diff(ckpt: Path, root: Path) -> None:
    huge = diff_name(6, 10**9)
    (ckpt / DIFF).rename(ckpt / huge)
    edit_manifest(huge, name=huge, step=10**9)(ckpt, root)


def oversized_manifest(ckpt: Path, root: Path) -> None:
    os.truncate(ckpt / DIFF / MANIFEST, 65 << 20)


def two_ranks_one_file(ckpt: Path, root: Path) -> None:
    path = ckpt / DIFF / MANIFEST
    body = json.loads(path.read_text())
    edit_manifest(DIFF, world_size=2, index_checksums={"0": "0" * 16, "1": body["index_checksums"]["0"]})(ckpt, root)


@dataclass(frozen=True)
class Case:
    id: str
    mutate: Callable[[Path, Path], None]
    record: str = DIFF  # the record every message must name
    bad_step: int = 7  # `restore --step` of it fails
    latest: int = 5  # what `restore latest` falls back to


CASES = [
    Case("manifest-name-victim", edit_manifest(BASE, name="../victim"), record=BASE),
    Case("manifest-depends-outside", edit_manifest(DIFF, depends_on=["../victim"])),
    Case("index-data-dotdot", edit_index(DIFF, set_path(("data",), "../../x"))),
    Case("index-data-absolute", edit_index(DIFF, set_path(("data",), "/etc/hostname"))),
    Case("record-dir-symlink", symlinked_record),
    Case("data-symlink-dev-zero", replace_data(lambda p: p.symlink_to("/dev/zero"))),
    Case("data-fifo", replace_data(os.mkfifo)),
    Case("data-sparse-2g-matching", sparse(2 * GiB, index_says_so=True)),
    Case("data-sparse-2g-not-matching", sparse(2 * GiB, index_says_so=False)),
    Case("world-size-1e9", edit_manifest(DIFF, world_size=10**9)),
    Case("world-size-negative", edit_manifest(DIFF, world_size=-1)),
    Case("world-size-more-than-rank-files", two_ranks_one_file),
    Case("bytes-not-a-number", edit_manifest(DIFF, bytes="abc")),
    Case("diff-step-1e9", renamed_diff, record=diff_name(6, 10**9)),
    Case("manifest-over-64MiB", oversized_manifest),
    Case("tensor-offset-beyond-file", edit_index(DIFF, first_tensor(offset=1 << 40))),
    Case("shape-times-itemsize-not-nbytes", edit_index(DIFF, first_tensor(shape=[3]))),
    Case("dtype-unknown", edit_index(DIFF, first_tensor(dtype="object"))),
    Case("tensor-bytes-named-1000-times", edit_index(BASE, repeated_largest_tensor(1000)), record=BASE, bad_step=5,
         latest=4),
    Case("dtype-tag-torch-load", edit_index(BASE, set_path(("skeleton", "extra", "x"), {"__dtype__": "load"})),
         record=BASE, bad_step=5, latest=4),
    Case("dtype-tag-os", edit_index(BASE, set_path(("skeleton", "extra", "x"), {"__dtype__": "os"})),
         record=BASE, bad_step=5, latest=4),
    Case("skeleton-missing-tensor",
         edit_index(BASE, set_path(("skeleton", "models", "model", "tok.weight"), {"__tensor__": "nope"})),
         record=BASE, bad_step=5, latest=4),
    Case("optimizer-class-module", edit_index(BASE, set_path(("meta", "optimizers", "optimizer", "class"),
                                                             "evilmod.Opt")), record=BASE),
    Case("optimizer-class-builtins-print", edit_index(BASE, set_path(("meta", "optimizers", "optimizer", "class"),
                                                                     "builtins.print")), record=BASE),
]

EVILMOD = "from pathlib import Path\nPath(__file__).with_name('IMPORTED').write_text('x')\nOpt = print\n"


def prepare(src: Path, root: Path, case: Case) -> Path:
    """A copy of `src` at root/ckpts damaged by `case`, next to sentinels it must not touch."""
    ckpt = copy_dir(src, root / "ckpts")
    (root / "victim").mkdir()
    (root / "victim" / "keep.txt").write_text("victim")
    (root / "outside").mkdir()
    (root / "outside" / "secret.txt").write_text("secret")
    (root / "x").write_text("x")
    case.mutate(ckpt, root)
    return ckpt


def outside(root: Path) -> dict[str, tuple]:
    """Every entry outside the checkpoint dir and the output folder, with its content."""
    return {str(p.relative_to(root)): (p.is_symlink(), p.is_dir(), p.read_bytes() if p.is_file() else b"")
            for p in sorted(root.rglob("*")) if p.parts[len(root.parts)] not in ("ckpts", "out")}


def commands(root: Path, case: Case) -> list[list[str]]:
    d, out = str(root / "ckpts"), root / "out"
    return [["verify", "--dir", d], ["restore", "--dir", d, "--step", str(case.bad_step), "--out", str(out / "bad.pt")],
            ["restore", "--dir", d, "--out", str(out / "latest.pt")]]


def run_batch(cwd: Path, argvs: list[list[str]], pythonpath: list[Path], timeout: float) -> list[dict]:
    env = clean_env(None)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, SCRIPTS / "cli_batch.py", json.dumps(argvs)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def pylib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder on the commands' PYTHONPATH with `evilmod`, whose import leaves IMPORTED behind."""
    path = tmp_path_factory.mktemp("pylib")
    (path / "evilmod.py").write_text(EVILMOD)
    return path


@pytest.fixture(scope="module")
def outcomes(lowdiff_dir: Path, pylib: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Per case: (root, outside before, outside after, [verify, restore --step, restore latest])."""
    roots, before = {}, {}
    for case in CASES:
        roots[case.id] = root = tmp_path_factory.mktemp(case.id)
        prepare(lowdiff_dir, root, case)
        before[case.id] = outside(root)
    argvs = [argv for case in CASES for argv in commands(roots[case.id], case)]
    results = run_batch(roots[CASES[0].id], argvs, [pylib], timeout=30 * len(CASES))
    return {case.id: (roots[case.id], before[case.id], outside(roots[case.id]), results[3 * i : 3 * i + 3])
            for i, case in enumerate(CASES)}


def completed(result: dict) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], result["rc"], result["stdout"], result["stderr"])


# ---- the tests ----------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_crafted_record_is_reported_skipped_and_contained(case, outcomes, pylib):
    root, before, after, (verify, bad, latest) = outcomes[case.id]
    assert "Traceback" not in verify["stderr"], verify["stderr"]
    lines = [line for line in verify["stdout"].splitlines() if line.startswith("BAD")]
    assert verify["rc"] == 1 and any(case.record in line for line in lines), verify["stdout"]

    line = error_line(completed(bad))
    assert case.record in line, line
    assert max(r["seconds"] for r in (verify, bad, latest)) < 20
    assert not (root / "out" / "bad.pt").exists()

    assert latest["rc"] == 0 and f"restored step {case.latest} " in latest["stderr"], latest["stderr"]
    assert after == before, "something outside --dir changed"
    assert not (pylib / "IMPORTED").exists(), "a module named in a checkpoint was imported"


def edit_step(step: str, edit: Callable[[dict], None]) -> Callable[[Path, Path], None]:
    """Edit one recorded step of the diff record DIFF."""
    return edit_index(DIFF, lambda index: edit(index["skeleton"]["steps"][step]))


# Records that pass their own checks but do not fit together, and harmless edits.
NEAR_MISSES = [
    Case("harmless-committed-at", edit_manifest(DIFF, committed_at=1.0)),
    Case("one-gradient-fewer", edit_step("7", lambda s: s["grads"].pop())),
    Case("one-group-more", edit_step("7", lambda s: s["groups"].append(dict(s["groups"][0])))),
    Case("gradient-shape-transposed", edit_index(DIFF, first_tensor(shape=[32, 256]))),
    Case("sparse-gradient-without-tensors", edit_step("7", lambda s: s["grads"].__setitem__(2, {"idx": None,
                                                                                              "val": None}))),
    Case("finishes-an-unknown-optimizer", edit_step("8", lambda s: s["param_groups"].update(other=[]))),
    Case("parameter-alias-missing", edit_index(BASE, set_path(("meta", "optimizers", "optimizer", "params", 1),
                                                              [["model", "nope"]])), record=BASE),
    Case("state-without-models", edit_index(BASE, lambda index: index["skeleton"].pop("models")), record=BASE),
    Case("tensor-named-twice", edit_index(BASE, set_path(("skeleton", "models", "model", "pos.weight"),
                                                         {"__tensor__": "models/model/tok.weight"})), record=BASE),
]


@pytest.mark.parametrize("case", CASES + NEAR_MISSES, ids=[c.id for c in CASES + NEAR_MISSES])
def test_verify_ok_means_every_step_restores(case, lowdiff_dir, tmp_path):
    """The rule behind `verify`: no case passes it and then fails to restore (in either format)."""
    from ckptrun.restore.export import export

    prepare(lowdiff_dir, tmp_path, case)
    store = Store(tmp_path / "ckpts")
    problems = verify_problems(store, optimizer_classes())
    if case.id.startswith("harmless"):
        assert problems == []
    else:
        assert any(case.record in p for p in problems), problems
    if not problems:
        for step in restorable(store):
            for fmt in ("torch", "safetensors"):
                export(store.root, step, tmp_path / "out", fmt)


def test_run_never_touches_a_directory_a_manifest_names(lowdiff_dir, tmp_path):
    """Retention and the damaged-record sweep work on listed names only: a manifest naming
    ../victim neither deletes nor moves the victim."""
    case = Case("old-manifest-names-victim", edit_manifest(full_name(0), name="../victim"), record=full_name(0))
    ckpt = prepare(lowdiff_dir, tmp_path, case)
    before = outside(tmp_path)
    proc = ckptrun(tmp_path, *LOWDIFF[:-2], "--keep", "1", "--dir", ckpt, "--no-dashboard", EXAMPLE, *tiny(12))
    ok(proc)  # resumed from step 8 (step 5 + diff 6-8); the crafted record was moved aside
    assert "moving step-00000000 (not restorable) aside" in proc.stderr
    assert outside(tmp_path) == before
    assert (tmp_path / "victim" / "keep.txt").read_text() == "victim"


def _sparse_record(root: Path, step: int, nbytes: int) -> None:
    """A committed full record holding one zero tensor of `nbytes` (a sparse file: no disk used)."""
    name, (data, index) = full_name(step), rank_files(0)
    (root / name).mkdir(parents=True)
    (root / name / data).write_bytes(b"")
    os.truncate(root / name / data, nbytes)
    h, zeros = xxhash.xxh3_64(), bytes(1 << 20)
    for _ in range(nbytes >> 20):
        h.update(zeros)
    (root / name / index).write_text(json.dumps({
        "format": 1, "record": name, "rank": 0, "data": data, "data_nbytes": nbytes,
        "tensors": {"w": {"dtype": "uint8", "shape": [nbytes], "offset": 0, "nbytes": nbytes, "xxh3": h.hexdigest()}},
        "skeleton": {"models": {"model": {"w": {"__tensor__": "w"}}}, "optimizers": {}, "rng": {}, "schedulers": [],
                     "scalers": [], "extra": {}},
        "meta": {}}))
    assert Store(root).try_commit(name, kind="full", step=step, first_step=step, world_size=1)


def _verify_peak_rss_mib(cwd: Path, ckpt: Path) -> float:
    code = ("import resource, sys\nfrom ckptrun.cli import main\nrc = main(['verify', '--dir', sys.argv[1]])\n"
            "print(rc, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    proc = subprocess.run([sys.executable, "-c", code, str(ckpt)], cwd=cwd, env=clean_env(None), capture_output=True,
                          text=True, timeout=120)
    rc, mib = proc.stdout.split()[-2:]
    assert rc == "0", proc.stdout + proc.stderr
    return float(mib)


def test_verify_streams_data_in_bounded_memory(tmp_path):
    _sparse_record(tmp_path / "small", 1, 1 << 20)
    _sparse_record(tmp_path / "large", 1, 256 << 20)
    small = _verify_peak_rss_mib(tmp_path, tmp_path / "small")
    large = _verify_peak_rss_mib(tmp_path, tmp_path / "large")
    assert large - small < 32, f"verify of a 256 MiB record peaked {large - small:.0f} MiB above a 1 MiB one"


def test_run_refuses_a_format_marker_that_is_not_a_file(tmp_path):
    """The directory's format marker is read like any record file: a FIFO is never waited on."""
    (tmp_path / "ckpts").mkdir()
    os.mkfifo(tmp_path / "ckpts" / "ckptrun.json")
    line = error_line(ckptrun(tmp_path, "--dir", "ckpts", "--no-dashboard", EXAMPLE, *TINY))
    assert "ckptrun.json is not a regular file" in line, line


TRUSTED_SCRIPT = """
import torch
import ckptrun
from myopt import MyOpt

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = MyOpt(model.parameters(), lr=0.1)
for step in range(ckptrun.resume_step(), 5):
    opt.zero_grad()
    model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).square().mean().backward()
    opt.step()
"""


def test_optimizer_class_named_on_the_command_line_is_trusted(tmp_path):
    """Replay with a class that is not torch.optim's needs the user's word (--optimizer-class),
    and the checkpoint's name of it is matched against that, never imported by itself."""
    (tmp_path / "myopt.py").write_text("import torch\n\nclass MyOpt(torch.optim.SGD):\n    pass\n")
    (tmp_path / "train.py").write_text(TRUSTED_SCRIPT)
    ok(ckptrun(tmp_path, "--strategy", "lowdiff", "--full-every", "3", "--batch", "2", "--keep", "0", "--dir", "ckpts",
               "--no-dashboard", "train.py"))
    report = verify(tmp_path, "ckpts")
    assert report.returncode == 1 and "'myopt.MyOpt'" in report.stdout, report.stdout
    line = error_line(ckptrun(tmp_path, "restore", "--dir", "ckpts", "--step", "2", "--out", "x.pt"))
    assert "--optimizer-class" in line and "myopt.MyOpt" in line, line
    ok(ckptrun(tmp_path, "verify", "--dir", "ckpts", "--optimizer-class", "myopt:MyOpt"))  # imports myopt from cwd
    proc = ok(ckptrun(tmp_path, "restore", "--dir", "ckpts", "--step", "2", "--out", "x.pt",
                      "--optimizer-class", "myopt:MyOpt"))
    assert "restored step 2 (from step-00000000 + 1 diff record(s) replayed" in proc.stderr, proc.stderr
    line = error_line(ckptrun(tmp_path, "restore", "--dir", "ckpts", "--optimizer-class", "os:path"))
    assert "--optimizer-class os:path" in line, line


def test_check_skeleton_accepts_what_flatten_writes():
    import numpy as np
    import torch

    from ckptrun.storage.skeleton import check_skeleton
    from ckptrun.storage.tree import flatten

    state = {"w": torch.ones(2, dtype=torch.bfloat16), "a": np.arange(3), "t": (1, float("nan"), "x"),
             "k": {0: [torch.zeros(1)], (1, 2): None, "__dunder": 1.5}, "d": torch.float8_e4m3fn}
    skeleton, tensors = flatten(state)
    check_skeleton(skeleton, {k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                              for k, t in tensors.items()})


def _shard(**fields) -> dict:
    """A well-formed sharded-tensor node: tensor "k" (float32 [4, 3]) is rank 1's half of [8, 3]."""
    node = {"local": {"__tensor__": "k"}, "shape": [8, 3], "mesh": [2], "coord": [1], "placements": ["S0"]}
    node.update(fields)
    if "local" in fields:
        node["local"] = {"__tensor__": fields["local"]}
    return node


def _nested(depth: int) -> dict:
    node: dict = {}
    for _ in range(depth):
        node = {"a": node}
    return node


@pytest.mark.parametrize("skeleton, problem", [
    ({"__items__": [[[1], 2]]}, "a list used as a dict key"),
    ({"__items__": [[{"__tensor__": "k"}, 2]]}, "a tensor used as a dict key"),
    ({"__items__": [1]}, "not [key, value] pairs"),
    ({"__float__": "1e5"}, "not nan or an infinity"),
    ({"__dtype__": "load"}, "unknown dtype 'load'"),
    ({"__dtype__": "os"}, "unknown dtype 'os'"),
    ({"__x__": 1}, "unknown tag '__x__'"),
    ({"__tensor__": "k", "b": 1}, "with other keys"),
    ({"__tensor__": "nope"}, "which the index does not hold"),
    ([{"__tensor__": "k"}, {"__tensor__": "k"}], "twice"),
    ({"__ndarray__": "b"}, "numpy array 'b' of dtype bfloat16"),
    ({"__tuple__": {"a": 1}}, "is not a list"),
    (_nested(100), "levels deep"),
    ({"__dtensor__": {"local": {"__tensor__": "nope"}}}, "without a tensor of the index"),
    ({"__dtensor__": _shard(local="x")}, "without a tensor of the index"),
    ({"__dtensor__": {**_shard(), "extra": 1}}, "exactly the fields"),
    ({"__dtensor__": _shard(shape=[4, -1])}, "shape [4, -1] is not a list"),
    ({"__dtensor__": _shard(mesh=[0])}, "mesh [0] is not a list"),
    ({"__dtensor__": _shard(mesh=[2, 2])}, "do not match"),
    ({"__dtensor__": _shard(mesh=[2**17])}, "do not match"),
    ({"__dtensor__": _shard(coord=[2])}, "outside mesh"),
    ({"__dtensor__": _shard(placements=["S2"])}, "outside mesh"),
    ({"__dtensor__": _shard(placements=["P"])}, "are not R or S<dim>"),
    ({"__dtensor__": _shard(shape=[10, 3])}, "its placements make it [5, 3]"),
    ({"__dtensor__": _shard(placements=["R"])}, "its placements make it [8, 3]"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_check_skeleton_rejects_what_unflatten_cannot_rebuild(skeleton, problem):
    from ckptrun.storage.skeleton import check_skeleton

    with pytest.raises(ValueError, match=re.escape(problem)):
        check_skeleton(skeleton, {"k": {"dtype": "float32", "shape": [4, 3]}, "b": {"dtype": "bfloat16", "shape": [2]}})
