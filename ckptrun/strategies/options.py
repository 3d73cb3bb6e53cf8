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
    ints: tuple[int, int] | None = None  # or: an integer in this range (or `auto`), checked the same way
    fraction: bool = False  # or: a number in (0, 1]
    # Changes what training computes (e.g. gradient compression), not only what is saved: a fair
    # reference trains the same way without checkpointing (`ckptrun bench`'s `none+VALUE`, the
    # example script taking the same flag).
    trains: bool = False

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


    def integer(self, options: dict[str, Any]) -> int | None:
        """This option's value in `options` as an integer in `ints`; None when `auto`."""
        raw = options.get(self.name) or self.default
        if raw in (None, "auto"):
            return None
        lo, hi = self.ints
        try:
            value = int(raw)
        except ValueError:
            value = lo - 1
        if not lo <= value <= hi:
            raise UsageError(f"{self.flag} must be an integer in [{lo}, {hi}] or auto (got {raw!r})")
        return value

    def share(self, options: dict[str, Any]) -> float | None:
        """This option's value in `options` as a fraction in (0, 1]; None when `auto`."""
        raw = options.get(self.name) or self.default
        if raw == "auto":
            return None
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0 < value <= 1:
            raise UsageError(f"{self.flag} must be a fraction in (0, 1], e.g. 0.3, or auto (got {raw!r})")
        return value

    def check(self, options: dict[str, Any]) -> None:
        """Refuse a value the strategy would refuse, before anything is created."""
        if self.choices:
            self.choice(options)
        elif self.ints:
            self.integer(options)
        elif self.fraction:
            self.share(options)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
