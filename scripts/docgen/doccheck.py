"""What tests/test_docs.py checks the README and docs/ against: the commands their ```console
blocks show with the output lines they promise, every internal link and anchor, and the
troubleshooting page's message entries."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ELLIPSIS = "…"
# Pages the site generates at build time (scripts/docgen/hook.py): not in the tree, linked to.
GENERATED = {REPO / "docs" / "reference" / "cli.md"}


# ---- console blocks -----------------------------------------------------------------------

@dataclass
class Command:
    line: str  # what follows "$ "
    expect: list[str]  # the output lines shown under it


def console_commands(path: Path) -> list[Command]:
    """The commands of a page's ```console blocks, in order, with the lines shown under each."""
    commands: list[Command] = []
    inside = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```console"
            continue
        if not inside:
            continue
        if line.startswith("$ "):
            commands.append(Command(line[2:], []))
        elif line.strip() and commands:
            commands[-1].expect.append(line)
    return commands


_NUMBER = re.compile(r"\d[\d,.]*")


def _pattern(shown: str) -> re.Pattern[str]:
    """A shown output line as a pattern: any number matches any number, whitespace runs are one
    space, and a line ending in … only has to start that way."""
    text = " ".join(shown.split())
    prefix = text.endswith(ELLIPSIS)
    text = text.removesuffix(ELLIPSIS).rstrip() if prefix else text
    parts = _NUMBER.split(text)
    body = r"\d[\d,.]*".join(re.escape(p) for p in parts)
    return re.compile(body + ("" if prefix else "$"))


def missing_lines(shown: list[str], output: str) -> list[str]:
    """The shown lines that no line of the real output matches."""
    actual = [" ".join(line.split()) for line in output.splitlines()]
    return [s for s in shown if not any(_pattern(s).match(a) for a in actual)]


# ---- links and anchors --------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`]*`")


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (MkDocs) gives a heading."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _markdown(path: Path) -> str:
    if path in GENERATED:
        from .cli_reference import command_page

        return command_page()
    return path.read_text()


def anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", _markdown(path))
    found: set[str] = set()
    for line in text.splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            base = slug(m.group(1))
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}_{n}"
            found.add(name)
    return found


def broken_links(path: Path) -> list[str]:
    """Internal links of one Markdown file whose file or anchor does not exist."""
    text = _CODE.sub("", _FENCE.sub("", path.read_text()))
    problems = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.is_file() and dest not in GENERATED:
            problems.append(f"{path.relative_to(REPO)}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{path.relative_to(REPO)}: {target}: no such anchor in {dest.name}")
    return problems


# ---- troubleshooting entries --------------------------------------------------------------

def entry(message: str) -> str:
    """A message's line in docs/troubleshooting.md: a list item holding it as inline code."""
    ticks = "``" if "`" in message else "`"
    pad = " " if "`" in message else ""
    return f"- {ticks}{pad}{message}{pad}{ticks}"


def entries(page: str) -> set[str]:
    found = set()
    for line in page.splitlines():
        m = re.fullmatch(r"- (`+)(.*)\1", line)
        if m:
            found.add(m.group(2).strip() if m.group(1) == "``" else m.group(2))
    return found
