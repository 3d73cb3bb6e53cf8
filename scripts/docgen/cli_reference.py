"""The CLI reference page, made from ckptrun's own typer/click command tree at build time, so that
it cannot drift from the flags: every command, its usage, help and each parameter's help record
(the same text and defaults `--help` prints)."""

from __future__ import annotations

import typer.main

from ckptrun.cli import app

HEADER = """# CLI reference

Generated from ckptrun's own command definitions when the site is built (`scripts/docgen/`):
each command's `--help`, in full. `ckptrun [OPTIONS] SCRIPT [ARGS]...` is `ckptrun run`.
What the flags do, at length: [Running a job](../running.md), [Strategies](../strategies/index.md),
[Tiers](../tiers/index.md), [Tuning](../tuning.md), [Performance](../performance.md).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def command_page() -> str:
    """The whole page as Markdown."""
    group = typer.main.get_command(app)
    root_ctx = group.context_class(group, info_name="ckptrun")
    parts = [HEADER, f"{group.help}\n"]
    for name, cmd in group.commands.items():
        ctx = cmd.context_class(cmd, info_name=name, parent=root_ctx)
        usage = " ".join([ctx.command_path, *cmd.collect_usage_pieces(ctx)])
        parts.append(f"## ckptrun {name}\n\n```\n{usage}\n```\n\n{cmd.help or ''}\n")
        rows = [p.get_help_record(ctx) for p in cmd.params]
        rows = [r for r in rows if r]
        if rows:
            parts.append("| parameter | meaning |\n|---|---|\n" +
                         "\n".join(f"| `{_cell(decl)}` | {_cell(text)} |" for decl, text in rows) + "\n")
        if cmd.epilog:
            parts.append("```\n" + cmd.epilog.replace("\b\n", "").strip("\n") + "\n```\n")
    return "\n".join(parts)


def options_of(command: str) -> list[str]:
    """Every option string of one command (for the tests)."""
    cmd = typer.main.get_command(app).commands[command]
    return [o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]
