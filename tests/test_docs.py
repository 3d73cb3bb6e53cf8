"""Docs that cannot rot: the README's and the getting-started page's commands print what they show,
every internal link and anchor of the README and docs/ resolves, docs/troubleshooting.md has an
entry for every error message in the code (and none for a message no longer printed), and the CLI
reference the site generates covers every command and option."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TIMEOUT_S, clean_env

sys.path.insert(0, str(REPO / "scripts"))
from docgen import cli_reference, doccheck, messages  # noqa: E402

README = REPO / "README.md"
GETTING_STARTED = REPO / "docs" / "getting-started.md"
TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]


def _setup_commands() -> list[str]:
    """The README's two setup commands: the indented fenced blocks of 'Setup: two commands'."""
    section = README.read_text().split("## Setup: two commands", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"^   ```\n(.*?)\n   ```", section, re.S | re.M)]


def _shell(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """A documented command as a user types it from the clone's root: bash, this interpreter's
    `ckptrun` and `python` first on PATH, output and errors together."""
    env = clean_env(None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)


def test_readme_is_a_landing_page_with_the_two_setup_commands_ci_runs() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines: move detail into docs/"
    install, tests = _setup_commands()
    assert install.startswith("python3 -m venv .venv") and "pip install -e ." in install
    test_command = tests.split(" && ")[-1]
    assert test_command.startswith("python -m pytest")
    ci = (REPO / ".ci" / "run").read_text()
    assert test_command in ci.splitlines(), ".ci/run runs the README's test command"
    assert 'pip install --quiet -e ".[test]"' in ci and "mkdocs build --strict" in ci


def test_every_link_and_anchor_resolves() -> None:
    problems = [p for page in PAGES for p in doccheck.broken_links(page)]
    assert not problems, "\n".join(problems)


def test_the_link_check_catches_a_missing_page_and_a_missing_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## Remote tier (`--durable`)\n")
    page.write_text("# Page\n\n[ok](other.md#remote-tier-durable) [gone](nowhere.md) "
                    "[forge-style](other.md#remote-tier---durable) [self](#page) `[code](x.md)`\n")
    doccheck.REPO, saved = tmp_path, doccheck.REPO
    try:
        problems = doccheck.broken_links(page)
    finally:
        doccheck.REPO = saved
    assert problems == ["page.md: nowhere.md: no such file",
                        "page.md: other.md#remote-tier---durable: no such anchor in other.md"]


def test_troubleshooting_has_an_entry_for_every_error_message_and_none_stale() -> None:
    found = messages.collect()
    assert len(found) > 200, "the collector finds ckptrun's error messages"
    listed = doccheck.entries(TROUBLESHOOTING.read_text())
    missing = [m for m in found if m.text not in listed]
    assert not missing, ("docs/troubleshooting.md lacks these messages; add each line under its group "
                         "(cause and fix):\n" + "\n".join(f"{doccheck.entry(m.text)}    <- {m.where}"
                                                          for m in missing))
    stale = listed - {m.text for m in found}
    assert not stale, "docs/troubleshooting.md lists messages ckptrun no longer prints:\n" + "\n".join(sorted(stale))


def test_the_message_collector_reads_literals_f_strings_and_both_branches() -> None:
    texts = {m.text: m for m in messages.collect()}
    usage = texts["--every must be at least 1 (got …)"]
    assert usage.kind == "UsageError" and usage.where.startswith("ckptrun/launcher/run.py:")
    assert texts["no checkpoint engine answers at …"].kind == "EngineLost"  # a subclass defined elsewhere
    assert any(t.startswith("… does not fit the host-memory budget") for t in texts)  # BudgetError(UsageError)
    assert "dashboard error (further ones suppressed): …: …" in texts  # log.error
    assert doccheck.entries(doccheck.entry("a `b` c") + "\n" + doccheck.entry("plain")) == {"a `b` c", "plain"}


def test_cli_reference_covers_every_command_and_option() -> None:
    page = cli_reference.command_page()
    for command in ("run", "strategies", "restore", "ls", "verify", "bench", "tune"):
        assert f"## ckptrun {command}\n" in page
        for option in cli_reference.options_of(command):
            assert f"`{option}" in page or f" {option}" in page, (command, option)
    assert "--persist-every" in page and "Intervals per strategy" in page  # strategy options, run's epilog


def test_readme_tour_is_the_getting_started_tour() -> None:
    """The README's commands are a subsequence of the getting-started page's, so the run below
    executes each once and checks the lines both pages show."""
    readme = [c.line for c in doccheck.console_commands(README)]
    guide = iter(c.line for c in doccheck.console_commands(GETTING_STARTED))
    assert readme and all(any(line == g for g in guide) for line in readme), readme


def test_shown_lines_match_numbers_loosely_and_prefixes() -> None:
    out = "ckptrun: rank 0 restarted (#1), resumed at step 24 in 0.88 s\n│    60 │ full │ step-00000060 │ 1 │\n"
    assert doccheck.missing_lines(["ckptrun: rank 0 restarted (#1), resumed at step 9 in 1.2 s",
                                   "│ 60 │ full │ step-00000060 │ …"], out) == []
    assert doccheck.missing_lines(["resumed at step 24"], out) == ["resumed at step 24"]  # whole lines
    assert doccheck.missing_lines(["ckptrun: summary: …"], out) == ["ckptrun: summary: …"]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder that looks like the clone's root to the documented commands."""
    root = tmp_path_factory.mktemp("clone")
    (root / "examples").symlink_to(REPO / "examples")
    return root


def test_getting_started_and_readme_commands_print_what_they_show(clone: Path) -> None:
    shown = {c.line: c.expect for c in doccheck.console_commands(README)}
    for command in doccheck.console_commands(GETTING_STARTED):
        r = _shell(command.line, clone)
        assert r.returncode == 0, f"$ {command.line}\n{r.stdout[-3000:]}"
        for page, expect in (("docs/getting-started.md", command.expect), ("README.md", shown.get(command.line, []))):
            missing = doccheck.missing_lines(expect, r.stdout)
            assert not missing, f"{page}: $ {command.line}\nnot printed: {missing}\n--- output:\n{r.stdout[-3000:]}"


def test_readme_setup_trains_kills_and_lists_the_example(clone: Path) -> None:
    """The README's first setup command after its installs: the killed example resumes and
    `ls` lists lowdiff's records."""
    install, _ = _setup_commands()
    steps = [s for s in install.split(" && ") if not s.startswith(("python3 -m venv", ". .venv", "pip install"))]
    assert steps[0].startswith("CKPTRUN_FAULT=kill:step=30 ckptrun") and steps[-1] == "ckptrun ls --dir ckpts"
    r = _shell(" && ".join(steps), clone)
    assert r.returncode == 0, r.stdout[-3000:]
    assert not doccheck.missing_lines(["ckptrun: rank 0 restarted (#1), resumed at step 29 in 0.9 s",
                                       "ckptrun: summary: steps 60 (…", "│ 30-60 │ diff │ …"], r.stdout), r.stdout
