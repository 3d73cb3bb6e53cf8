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

    def choice(self, options: dict[str, Any]) -> str:
        """This option's value in `options` (its default when not given), one of `choices`."""
        value = options.get(self.name) or self.default
        if value not in self.choices:
            *rest, last = self.choices
            raise UsageError(f"{self.flag} is {', '.join(rest)} or {last} (got {value!r})")
        return value


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

