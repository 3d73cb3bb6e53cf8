"""Recipes: run options kept in a YAML file, `ckptrun --recipe R.yaml SCRIPT [ARGS]`.

A recipe is a mapping from run-option names to values, written as on the command line with
underscores for dashes (`max_inflight: 4` is `--max-inflight 4`, `every: auto`, `mtbf: 30m`,
`resume: false`). Every run option except SCRIPT and its arguments may appear; an unknown key is
an error that lists the valid ones, so a typo never silently falls back to a default. Options
given on the command line override the recipe. `ckptrun tune --write` writes one, and
`recipes/` holds documented examples (docs/tuning.md).

The values are converted and checked by the run command itself (the recipe becomes the command's
defaults, click's `default_map`), so a recipe value means exactly what the same flag means.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import yaml

from ..errors import UsageError

__all__ = ["load_recipe"]


def load_recipe(path: str | os.PathLike[str], allowed: Mapping[str, str]) -> dict[str, Any]:
    """The recipe's options as {option name: value} (`allowed`: each valid key, an option's name
    or an alias of it, to the option's name); UsageError naming the file and key otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise UsageError(f"cannot read recipe {os.fspath(path)!r}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise UsageError(f"recipe {os.fspath(path)} is not valid YAML{at}: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"recipe {os.fspath(path)} must be a mapping of run options (key: value), "
                         f"got a {type(data).__name__}")
    options: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in allowed:
            raise UsageError(f"recipe {os.fspath(path)}: unknown key {key!r}; valid keys are the run options: "
                             f"{', '.join(sorted(allowed))}")
        if isinstance(value, (dict, list)):
            raise UsageError(f"recipe {os.fspath(path)}: {key} must be a single value, as on the command line "
                             f"(got a {type(value).__name__})")
        if allowed[name] in options:
            raise UsageError(f"recipe {os.fspath(path)}: {key} sets {allowed[name]} a second time (it has "
                             "two names); keep one")
        options[allowed[name]] = value
    return options
