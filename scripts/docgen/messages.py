"""The error messages ckptrun prints, collected from its source by an AST walk, so that
docs/troubleshooting.md can be checked to have an entry for each: the message of every
constructor call of ckptrun's error classes (errors.CkptrunError and its subclasses, wherever they
are defined) and of every `log.error(...)`. A message's text is its string literal with each
interpolated value written as `…`; a message made at run time from something other than a
literal (`UsageError(str(e))`: the text of an error raised elsewhere) has no text of its own and
is not listed."""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ckptrun"
ROOT_ERROR = "CkptrunError"
HOLE = "…"


@dataclass(frozen=True)
class Message:
    text: str
    kind: str  # the error class, or "log.error"
    where: str  # path:line, relative to the repository


def _text(node: ast.AST) -> list[str]:
    """The texts a message argument can have (two for `a if c else b`); [] when not a literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
            elif parts and parts[-1] == HOLE:
                continue
            else:
                parts.append(HOLE)
        return ["".join(parts)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        return [a + b for a in left for b in right]
    if isinstance(node, ast.IfExp):
        return _text(node.body) + _text(node.orelse)
    return []


def _trees() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def error_classes(trees: list[tuple[Path, ast.Module]]) -> set[str]:
    """CkptrunError and every class that derives from it, by name, across the package."""
    bases: dict[str, set[str]] = {}
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                                    for b in node.bases}
    family = {ROOT_ERROR}
    while True:
        more = {name for name, bs in bases.items() if bs & family} - family
        if not more:
            return family
        family |= more


def _callee(call: ast.Call) -> str:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        owner = f.value.id if isinstance(f.value, ast.Name) else getattr(f.value, "attr", "")
        return f"{owner}.{f.attr}"
    return ""


@functools.cache
def collect() -> tuple[Message, ...]:
    """Every literal error message in the package, in file order, duplicates (same text) once."""
    trees = _trees()
    family = error_classes(trees)
    found: dict[str, Message] = {}
    repo = PACKAGE.parent
    for path, tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = _callee(node)
            kind = name.rsplit(".", 1)[-1] if name.rsplit(".", 1)[-1] in family else (
                "log.error" if name.endswith("log.error") else "")
            if not kind:
                continue
            for text in _text(node.args[0]):
                text = " ".join(text.split())
                if text.strip(HOLE + " ") and text not in found:
                    found[text] = Message(text, kind, f"{path.relative_to(repo)}:{node.lineno}")
    return tuple(sorted(found.values(), key=lambda m: (m.where.split(":")[0], int(m.where.split(":")[1]))))


if __name__ == "__main__":
    for m in collect():
        print(f"{m.where}\t{m.kind}\t{m.text}")
