"""Problems reported under the key to change: a location of config keys and a message."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stoker.domain.errors import ConfigError

#: Where a problem lies: config keys and list indexes, like pydantic's error locations.
Loc = tuple[str | int, ...]
#: A problem under the key to change, and optionally the key whose value makes it one.
Problem = tuple[Loc, str] | tuple[Loc, str, Loc]


class ConfigProblems(ValueError):
    """Problems that span keys or sections, each reported under the key to change.

    Raised from a model validator; `format_errors` prints one line per problem, at the
    validator's location plus the problem's own, instead of one line at the model. A
    problem's key left to its default is named by where the key that made it one was set
    (`because`).
    """

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = tuple((p[0], p[1]) for p in problems)
        #: The key whose value makes a problem one, by the problem's location.
        self.because: dict[Loc, Loc] = {p[0]: p[2] for p in problems if len(p) == 3}
        super().__init__("; ".join(f"{dotted(loc)}: {message}" for loc, message in self.problems))


class ConfigKeyError(ConfigError):
    """A problem with one key of a loaded config, found by a check run after loading: one
    `config error: <key>: <problem>` line (`where`: the key as the line names it, when it
    says more than the key). `LoadedConfig.checking` adds where the key was set."""

    def __init__(self, loc: Loc, problem: str, *, where: str | None = None) -> None:
        self.loc = loc
        super().__init__(f"config error: {where or dotted(loc)}: {problem}")


def raise_problems(problems: Sequence[Problem]) -> None:
    """Raise `ConfigProblems` when there is any problem."""
    if problems:
        raise ConfigProblems(problems)


def dotted(loc: tuple[Any, ...]) -> str:
    """A location as the key a user writes: `pools[0].pod.cpu`."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text
