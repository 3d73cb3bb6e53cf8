"""Strategy options: each strategy declares its own flags (name, default, help) next to its code.

The registry carries them; the `run` command, recipes and `tune --write` read them from there,
and the worker hands the chosen strategy's values to it as `RunConfig.options`. Values stay
strings (as typed, or `auto`): the strategy parses them and names the flag in its error.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    name: str  # a Python identifier; the flag is --name-with-dashes
    default: str | None
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")
