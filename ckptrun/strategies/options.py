"""Strategy options: each strategy declares its own flags (name, default, help) next to its code.

The registry carries them; the `run` command, recipes and `tune --write` read them from there,
and the worker hands the chosen strategy's values to it as `RunConfig.options`. Values stay
strings (as typed, or `auto`): the strategy parses them and names the flag in its error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UsageError


@dataclass(frozen=True)
class Option:
    name: str  # a Python identifier; the flag is --name-with-dashes
    default: str | None
    help: str
    choices: tuple[str, ...] = ()  # the allowed values, checked by the launcher before anything starts

    @property
    def flag(self) -> str:
        return _flag(self.name)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def int_value(options: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    """Option `name` as an integer in [lo, hi]; None when not given or `auto`."""
    raw = options.get(name)
    if raw in (None, "auto"):
        return None
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise UsageError(f"{_flag(name)} must be an integer in [{lo}, {hi}] (got {raw!r})")
    return value


def choice_value(options: dict[str, Any], name: str, allowed: tuple[str, ...]) -> str:
    """Option `name`, one of `allowed` (the first when not given)."""
    value = options.get(name) or allowed[0]
    if value not in allowed:
        raise UsageError(f"{_flag(name)} is {', '.join(allowed[:-1])} or {allowed[-1]} (got {value!r})")
    return value
