"""The package's layering (issue 32), read from its source with `ast` (nothing is imported):

(a) No import cycle among ckptrun's modules. Every `import` counts wherever it stands: at module
level, inside a function, under `if TYPE_CHECKING:`; each is a dependency the layering carries.
`from pkg import name` depends on the module `pkg.name` when the package has one, else on `pkg`;
importing `a.b.c` depends on `a.b.c` alone (Python runs the parents' `__init__` first, but
nothing is taken from them). `LAZY` holds the only exemptions, each with its reason.

(c) The process boundary: nothing under engine/, storage/ or ipc/ imports worker/ or launcher/,
directly or through other modules (`crossings`); what both sides share lives below them.

(b) No strategy named outside ckptrun/strategies/ and ckptrun/bench/: a registered name, or the
name of the module its entry points into, may not be a word of an identifier (snake_case and
CamelCase words: `lowdiff_plan`, `LowDiffPlan`, `plan.lowdiff`), of an imported module's path,
or of a string literal (help texts and f-strings included; docstrings, which say why in prose,
are not). `HOMONYMS` holds the exceptions, each a token where such a word means something else.

(d) No class over 300 lines and no function body over 80 (issue 60).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest

from ckptrun.strategies import REGISTRY

PACKAGE = Path(__file__).resolve().parents[1] / "ckptrun"
FREE = ("strategies", "bench")  # the folders that may name strategies

# (importer, imported) -> why the import is exempt from (a)
LAZY = {
    ("ckptrun.storage.iowriter", "ckptrun._uring"):
        "the optional compiled writer (native/), imported where it is used so that a checkout "
        "without it falls back to the Python writer; it imports nothing of the package",
}
# (an identifier, or a whole string literal: "text") -> what the strategy's name means there instead
HOMONYMS = {
    ("sync", "identifier"): "a method flushing a file to disk (`OutFile.sync`, `RegionWriter.sync`)",
    ("sync write", "text"): "the dashboard's label of a synchronous write's stall, which any strategy may cause",
    ("checkfreq_min_interval_steps", "identifier"): "CheckFreq's bound (DESIGN §6: never checkpoint faster "
                                                    "than the persist path drains), which every interval obeys",
    ("checkfreq_min_steps", "identifier"): "that bound in `ckptrun tune`'s plan (a key of its JSON document)",
    ("_TERMINAL_STATE_SYNC_ID", "identifier"): "torch elastic's key prefix of its exit barrier "
                                               "(launcher/rdzv_exit.py reads whether every node reached it)",
}


# ---- (a) the import graph -----------------------------------------------------------------------


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> source file of every module under the package folder `root`."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported module of the package, line) for every import statement in module `name`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            lazy = {target for _, target in LAZY}
            targets = [sub if (sub := f"{base}.{alias.name}") in known or sub in lazy else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target != name and (target in known or (name, target) in LAZY):
                yield target, node.lineno


def graph(known: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the first line doing so}, LAZY left out."""
    edges: dict[str, dict[str, int]] = {name: {} for name in known}
    for name, path in known.items():
        for target, line in imports(name, path, known):
            if (name, target) not in LAZY:
                edges[name].setdefault(target, line)
    return edges


def groups(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted, by first member."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def shortest_cycle(start: str, group: list[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """[start, ..., start]: the shortest way back to `start` within its group (breadth first)."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        nxt = []
        for v in todo:
            for w in sorted(edges[v]):
                if w == start:
                    return [*paths[v], start]
                if w in group and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        todo = nxt
    raise AssertionError(f"{start} is on no cycle of {group}")


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """For each group, shortest cycles until every member is on one: a cycle names its modules."""
    found = []
    for group in groups(edges):
        covered: set[str] = set()
        for v in group:
            if v not in covered:
                found.append(shortest_cycle(v, group, edges))
                covered.update(found[-1])
    return found


def describe(cycle: list[str], edges: dict[str, dict[str, int]], known: dict[str, Path],
             root: Path = PACKAGE.parent) -> str:
    """`a (file:line) -> b (file:line) -> a`: where each module imports the next."""
    steps = [f"{a} ({known[a].relative_to(root)}:{edges[a][b]})" for a, b in pairwise(cycle)]
    return "import cycle: " + " -> ".join([*steps, cycle[-1]])


def test_no_import_cycle_among_the_packages_modules():
    known = modules(PACKAGE)
    edges = graph(known)
    found = [describe(c, edges, known) for c in cycles(edges)]
    assert not found, "\n".join(found)


def test_each_lazy_exemption_is_a_lazy_import_of_an_extension_the_package_lacks_as_source():
    known = modules(PACKAGE)
    for (importer, imported), why in LAZY.items():
        assert why and imported not in known, imported
        lines = [line for target, line in imports(importer, known[importer], known) if target == imported]
        assert lines, f"{importer} no longer imports {imported}: remove it from LAZY"
        top = {node.lineno for node in ast.parse(known[importer].read_text()).body}
        assert not top & set(lines), f"{importer} imports {imported} at module level: it is not lazy"


def write_package(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return modules(root / "pkg")


def test_the_cycle_check_sees_function_level_and_type_checking_imports(tmp_path):
    known = write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a/__init__.py": "",
        "pkg/a/server.py": "from .handlers import Handler\n",
        "pkg/a/handlers.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .server import X\n",
        "pkg/b.py": "def f():\n    from .c import g\n",
        "pkg/c.py": "import pkg.d\n",
        "pkg/d.py": "from pkg import b\n",
        "pkg/e.py": "from . import c\nfrom .a import server\n",
    })
    edges = graph(known)
    assert cycles(edges) == [["pkg.a.handlers", "pkg.a.server", "pkg.a.handlers"],
                             ["pkg.b", "pkg.c", "pkg.d", "pkg.b"]]
    assert edges["pkg.e"] == {"pkg.c": 1, "pkg.a.server": 2}
    assert describe(cycles(edges)[1], edges, known, tmp_path) == (
        "import cycle: pkg.b (pkg/b.py:2) -> pkg.c (pkg/c.py:1) -> pkg.d (pkg/d.py:1) -> pkg.b")


# ---- (c) the process boundary in the imports ----------------------------------------------------

# Code the engine process (and `ls`, `verify`, `restore`) runs: it loads nothing of the trainer's
# side or the launcher's, directly or through another module; what both sides share lives below.
ENGINE_SIDE = ("engine", "storage", "ipc")
OTHER_SIDES = ("worker", "launcher")


def crossings(edges: dict[str, dict[str, int]], root: str) -> list[list[str]]:
    """For each module of `root`'s ENGINE_SIDE folders that reaches a module of OTHER_SIDES, the
    shortest import path to the first such module (breadth first over the graph)."""
    def folder(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else ""

    found = []
    for start in sorted(m for m in edges if folder(m) in ENGINE_SIDE):
        paths, todo = {start: [start]}, [start]
        while todo:
            v = todo.pop(0)
            hit = next((w for w in sorted(edges[v]) if folder(w) in OTHER_SIDES), None)
            if hit is not None:
                found.append([*paths[v], hit])
                break
            for w in sorted(edges[v]):
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    todo.append(w)
    return found


def test_nothing_the_engine_runs_imports_the_worker_or_the_launcher():
    found = crossings(graph(modules(PACKAGE)), "ckptrun")
    assert not found, "\n".join(" -> ".join(path) for path in found)


def test_the_boundary_check_follows_imports_through_other_modules(tmp_path):
    known = write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/log.py": "def f():\n    from .launcher.console import x\n",
        "pkg/engine/__init__.py": "",
        "pkg/engine/server.py": "from ..log import f\n",
        "pkg/storage/__init__.py": "",
        "pkg/storage/store.py": "from ..tuning import y\n",
        "pkg/tuning.py": "",
        "pkg/launcher/__init__.py": "",
        "pkg/launcher/console.py": "",
    })
    assert crossings(graph(known), "pkg") == [["pkg.engine.server", "pkg.log", "pkg.launcher.console"]]


# ---- (b) strategy names -------------------------------------------------------------------------


def strategy_names() -> set[str]:
    """Every registered name, and the module each entry's import paths point into (the one
    below ckptrun.strategies for a built-in, the top-level one for a plug-in)."""
    found = set(REGISTRY)
    for entry in REGISTRY.values():
        for path in (entry.trainer, entry.engine_handler, entry.tuning, entry.explicit_every):
            if path:
                parts = path.partition(":")[0].split(".")
                found.add(parts[2] if parts[:2] == ["ckptrun", "strategies"] else parts[0])
    return found


CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")


def identifier_names(identifier: str, names: set[str]) -> set[str]:
    """The names that a run of `identifier`'s words spells (`LowDiffPlan` -> lowdiff)."""
    words = [w.lower() for part in identifier.split("_") for w in CAMEL.findall(part)]
    spelt = {"".join(words[i:j]) for i in range(len(words)) for j in range(i + 1, len(words) + 1)}
    return {n for n in names if n.isidentifier() and n.replace("_", "").lower() in spelt}


def text_names(text: str, names: set[str]) -> set[str]:
    return {n for n in names if re.search(rf"(?<!\w){re.escape(n)}(?!\w)", text)}


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, kinds) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def _tokens(node: ast.AST) -> Iterator[tuple[str, str]]:
    """(token, kind: "text", "identifier" or "module") for each string or name the node holds."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value, "text"
    elif isinstance(node, ast.Name):
        yield node.id, "identifier"
    elif isinstance(node, ast.Attribute):
        yield node.attr, "identifier"
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield node.name, "identifier"
    elif isinstance(node, ast.arg):
        yield node.arg, "identifier"
    elif isinstance(node, ast.keyword) and node.arg:
        yield node.arg, "identifier"
    elif isinstance(node, ast.Import):
        for alias in node.names:
            yield from ((part, "module") for part in [*alias.name.split("."), alias.asname or ""])
    elif isinstance(node, ast.ImportFrom):
        path = (node.module or "").split(".")
        yield from ((part, "module") for part in path)
        for alias in node.names:  # what the strategies package holds is a strategy's module or the registry
            yield from ((name, "module" if "strategies" in path else "identifier") for name in
                        (alias.name, alias.asname or ""))


def named_strategies(path: Path, names: set[str], used: set[str], root: Path = PACKAGE.parent) -> Iterator[str]:
    """`file:line: token (names)` (relative to `root`) for each place in `path` naming a strategy;
    the exempt tokens (HOMONYMS) met are added to `used`."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if id(node) in docs:
            continue
        for token, kind in _tokens(node):
            hits = text_names(token, names) if kind == "text" else identifier_names(token, names)
            if hits and (token, kind) in HOMONYMS:
                used.add((token, kind))
            elif hits:
                shown = token if len(token) <= 60 else f"{token[:57]}..."
                yield f"{path.relative_to(root)}:{node.lineno}: {shown!r} ({', '.join(sorted(hits))})"


def test_no_strategy_is_named_outside_strategies_and_bench():
    names: set[str] = strategy_names()
    used: set[tuple[str, str]] = set()
    found: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] not in FREE:
            found += named_strategies(path, names, used)
    found.sort(key=lambda line: (line.split(":")[0], int(line.split(":")[1])))
    assert not found, "strategies named outside ckptrun/strategies/ and ckptrun/bench/:\n" + "\n".join(found)
    assert used == set(HOMONYMS), f"HOMONYMS no longer met (remove them): {sorted(set(HOMONYMS) - used)}"


@pytest.mark.parametrize("source,expected", [
    ("from ..strategies.pccheck.model import configure\n", ["'pccheck' (pccheck)"]),
    ("from ..strategies import lowdiff_plus as lp\n", ["'lowdiff_plus' (lowdiff, lowdiff_plus)"]),
    ("class LowDiffPlan:\n    pass\n", ["'LowDiffPlan' (lowdiff)"]),
    ("import ckptrun.strategies.gockpt.model\n", ["'gockpt' (gockpt)"]),
    ("w.sync()\nsync = 1\n", []),
    ("from .strategies import sync\nfrom .intervals import sync\n", ["'sync' (sync)"]),
    ("x = plan.gockpt_note\n", ["'gockpt_note' (gockpt)"]),
    ("def f(**k):\n    f(pccheck=1)\n", ["'pccheck' (pccheck)"]),
    ("BASE = 'sync'\n", ["'sync' (sync)"]),
    ("HELP = f'lowdiff+ keeps {n} steps'\n", ["'lowdiff+ keeps ' (lowdiff, lowdiff+)"]),
    ("PATH = 'ckptrun.strategies.lowdiff_plus.engine:H'\n", ["'ckptrun.strategies.lowdiff_plus.engine:H' "
                                                             "(lowdiff_plus)"]),
    ('"""The docstring may say why lowdiff does this."""\nasync_io, fsync = 1, "sync_write"\n'
     "LABEL = 'sync write'\n", []),
])
def test_the_name_check_sees_imports_identifiers_and_strings(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source)
    names = {"sync", "lowdiff", "lowdiff+", "lowdiff_plus", "pccheck", "gockpt"}
    assert [line.split(": ", 1)[1] for line in named_strategies(path, names, set(), root=tmp_path)] == expected


# ---- (d) sizes ----------------------------------------------------------------------------------

MAX_CLASS_LINES, MAX_BODY_LINES = 300, 80


def oversized(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """("module:Qualified.name", lines) of each class over MAX_CLASS_LINES (decorators to its
    last line) and each function whose body is over MAX_BODY_LINES, at any depth in `path`."""
    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                first = child.lineno if isinstance(child, ast.ClassDef) else child.body[0].lineno
                lines = child.end_lineno - first + 1
                if lines > (MAX_CLASS_LINES if isinstance(child, ast.ClassDef) else MAX_BODY_LINES):
                    yield f"{name}:{prefix}{child.name}", lines
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(path.read_text(), str(path)), "")


def test_no_class_over_300_lines_and_no_function_body_over_80():
    found = dict(item for name, path in modules(PACKAGE).items() for item in oversized(name, path))
    assert not found, f"over {MAX_CLASS_LINES} lines (a class) or {MAX_BODY_LINES} (a function body): {found}"


def test_the_size_check_sees_nested_classes_and_function_bodies(tmp_path):
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_BODY_LINES + 1))
    known = write_package(tmp_path, {"pkg/a.py": f"class A:\n    def f(self):\n{body}\n"
                                                  "def g():\n    class B:\n        pass\n"})
    assert dict(oversized("pkg.a", known["pkg.a"])) == {"pkg.a:A.f": MAX_BODY_LINES + 1}
    big = "".join(f"    y{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    known = write_package(tmp_path, {"pkg/b.py": f"def g():\n    return 1\nclass C:\n{big}"})
    assert dict(oversized("pkg.b", known["pkg.b"])) == {"pkg.b:C": MAX_CLASS_LINES + 1}
