"""mkdocs hook (mkdocs.yml `hooks:`): adds the generated CLI reference to the site's files, so the
built page is always the CLI of the code being built."""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from docgen.cli_reference import command_page  # noqa: E402

PAGE = "reference/cli.md"


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, PAGE, content=command_page()))
    return files
