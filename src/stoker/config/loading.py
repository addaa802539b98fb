"""Loading: one YAML file, `STOKER_*` environment overrides, and error messages that name
the key.

`load_config(path)` reads the file (or nothing: every key has an embedded default), applies
the environment overrides (`STOKER_API__PORT=9000`, `STOKER_STORE=postgresql://...`; `__`
separates nested keys, a number indexes a list: `STOKER_POOLS__0__WARM_TARGET=5`) and
validates the result. Every problem is one `config error: <key>: <problem>` line, ending
with where the key was set: `(from STOKER_API__PORT)`, else `(from <the file>)`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from stoker.config.changes import RENAMED_FIELDS
from stoker.config.convert import to_domain
from stoker.config.models import StokerConfig
from stoker.config.pools import default_pools
from stoker.config.problems import ConfigKeyError, ConfigProblems, dotted
from stoker.config.sections import RUNTIME_KINDS
from stoker.domain.errors import ConfigError, one_line

#: Prefix of the environment variables that override configuration keys.
ENV_PREFIX = "STOKER_"


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    """A validated config and where it came from (for the server's start-up line), and
    where each of its keys was set (for the checks run after loading)."""

    config: StokerConfig
    source: str
    #: Environment variables that overrode keys.
    overrides: tuple[str, ...] = ()
    #: Where each key was set (`checking`).
    sources: _Sources = field(default_factory=lambda: _Sources({}, {}), repr=False)

    @contextmanager
    def checking(self) -> Iterator[None]:
        """Around the checks run on the loaded config (`serve`, `config check`): the
        `ConfigKeyError` one raises names where its key was set, as the loader's lines do."""
        try:
            yield
        except ConfigKeyError as exc:
            source = self.sources.of(exc.loc)
            if source is None:
                raise
            raise ConfigError(f"{exc} (from {one_line(source)})") from None


def load_config(
    path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> LoadedConfig:
    """Read `path` (or nothing), apply `STOKER_*` overrides from `environ`, validate.

    Raises `ConfigError` whose message has one `config error: <key>: <problem>` line per
    problem.
    """
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    file: str | None = None
    if path is not None:
        data = _read_yaml(Path(path))
        file = str(path)
    # The file's own keys, before the overrides replace any.
    in_file = frozenset(_key_paths(data)) if file is not None else frozenset()
    env_keys, made = _apply_env(data, environ)
    # Checked once the overrides replaced what they replace (their JSON has text keys): such
    # a key is the file's, though a variable may name its path as text (`STOKER_API__1`).
    in_the_file = _Sources({}, {}, file, in_file)
    problems = [
        _line(loc, "a key must be a string; quote it", in_the_file)
        for loc in _keys_not_strings(data)
    ]
    if problems:
        raise ConfigError("\n".join(problems))
    sources = _Sources(env_keys, made, file, in_file)
    try:
        # Lenient: a `STOKER_*` override is text, so `"5"` is read as 5 here (and YAML's
        # `true` as 1); the API's JSON is held to the models' strict types.
        config = StokerConfig.model_validate(data, strict=False)
    except ValidationError as exc:
        raise ConfigError("\n".join(_format_errors(exc, sources))) from None
    source = file if file is not None else "built-in defaults"
    loaded = LoadedConfig(config, source, tuple(sorted(set(env_keys.values()))), sources)
    with loaded.checking():
        # The domain objects run their own checks; surface them as config errors now.
        to_domain(config)
    return loaded


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        shown = one_line(str(path))
        raise ConfigError(f"config error: cannot read {shown}: {_reason(exc)}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" line {mark.line + 1}, column {mark.column + 1}:"
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"config error: {path}:{where} {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config error: {path}: the top level must be a mapping of keys")
    return data


def _keys_not_strings(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Where YAML read a key as something else than text (`on:` is true, `1:` a number):
    pydantic would name such a key like a list index, or not at all."""
    found: list[tuple[Any, ...]] = []
    if isinstance(value, dict):
        for key, child in value.items():
            if not isinstance(key, str):
                found.append((*at, _as_written(key)))
            else:
                found += _keys_not_strings(child, (*at, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            found += _keys_not_strings(child, (*at, i))
    return found


def _key_paths(value: Any, at: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every key path of a document, `()` first, as `_Sources` spells them (an index as
    text, a key YAML read as another type as written)."""
    yield at
    items: Any = ()
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    for key, child in items:
        yield from _key_paths(child, (*at, key if isinstance(key, str) else _as_written(key)))


def _as_written(key: Any) -> str:
    """A key YAML read as something else than text, as the file spells it: `true`, `1`."""
    return json.dumps(key) if _is_scalar(key) else repr(key)


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _apply_env(
    data: dict[str, Any], environ: Mapping[str, str]
) -> tuple[dict[tuple[str, ...], str], dict[tuple[str, ...], str]]:
    """Merge `STOKER_*` overrides into `data`; returns the key paths they set, and the
    mappings they made on the way (`STOKER_API__PROT__X` makes `api.prot`), by variable.

    Only variables whose first segment names a top-level key count: `STOKER_URL` and
    `STOKER_TOKEN` belong to the client commands, not to the server's config.
    """
    top = set(StokerConfig.model_fields)
    applied: dict[tuple[str, ...], str] = {}
    made: dict[tuple[str, ...], str] = {}
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX):
            continue
        # An index in any digits (`٣`) as the one pydantic names (`3`).
        path = tuple(
            str(int(k)) if k.isdecimal() else k for k in name[len(ENV_PREFIX) :].lower().split("__")
        )
        if path[0] not in top or not all(path):
            continue
        raw = environ[name]
        # A control character in the name would break the message's one line.
        name = one_line(name)
        value: Any = raw
        if raw.strip().startswith(("[", "{")):
            try:
                value = json.loads(raw)
            except ValueError as exc:
                raise ConfigError(f"config error: {name}: not valid JSON ({exc})") from None
        if path[0] == "pools" and len(path) > 1 and "pools" not in data:
            # Indexing the default pools: materialise them first.
            data["pools"] = [p.model_dump(mode="json", by_alias=True) for p in default_pools()]
        for key in _set_path(data, path, value, name):
            made.setdefault(key, name)
        applied[path] = name
    return applied, made


#: Keys that accept a string shorthand for a mapping: the key the string stands for.
_SHORTHANDS: dict[tuple[str, ...], str] = {("leader_election",): "kind"}


def _set_path(
    data: dict[str, Any], path: tuple[str, ...], value: Any, name: str
) -> list[tuple[str, ...]]:
    """Set `path` to `value`; returns the paths of the mappings and lists it made."""
    made: list[tuple[str, ...]] = []
    target: Any = data
    for i, key in enumerate(path[:-1]):
        nxt = path[i + 1]
        shorthand = _SHORTHANDS.get(path[: i + 1])
        if shorthand and isinstance(target, dict) and isinstance(target.get(key), str):
            # `leader_election: store` in the file, STOKER_LEADER_ELECTION__LEASE_NAME set.
            target[key] = {shorthand: target[key]}
        if isinstance(target, list):
            if not key.isdecimal() or int(key) >= len(target):
                raise ConfigError(
                    f"config error: {name}: {one_line('.'.join(path[:i]))} has no item "
                    f"{one_line(key)} "
                    f"(it has {len(target)})"
                )
            target = target[int(key)]
            continue
        if not isinstance(target, dict):
            raise ConfigError(
                f"config error: {name}: {one_line('.'.join(path[:i]))} is not a mapping"
            )
        if key not in target or target[key] is None:
            target[key] = [] if nxt.isdecimal() else {}
            made.append(path[: i + 1])
        target = target[key]
    last = path[-1]
    if isinstance(target, list):
        if not last.isdecimal() or int(last) >= len(target):
            raise ConfigError(f"config error: {name}: no item {one_line(last)} to override")
        target[int(last)] = value
    elif isinstance(target, dict):
        target[last] = value
    else:
        raise ConfigError(f"config error: {name}: {one_line('.'.join(path[:-1]))} is not a mapping")
    return made


_MESSAGES = {
    "extra_forbidden": "unknown key",
    "missing": "required",
    "int_parsing": "must be an integer",
    "int_type": "must be an integer",
    "int_from_float": "must be a whole number",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
    # The sections that are domain dataclasses (`intervals`, `orgs`, `timeouts`) and the
    # tuples of the domain's templates say it in their own words.
    "unexpected_keyword_argument": "unknown key",
    "missing_argument": "required",
    "dataclass_type": "must be a mapping",
    "tuple_type": "must be a list",
}


def format_errors(
    exc: ValidationError,
    env_keys: Mapping[tuple[str, ...], str],
    made: Mapping[tuple[str, ...], str] | None = None,
) -> list[str]:
    """One `config error: <key>: <problem>` line per pydantic error; `env_keys` are the
    key paths overrides set and `made` the mappings they made, by variable."""
    return _format_errors(exc, _Sources(env_keys, made or {}))


def _format_errors(exc: ValidationError, sources: _Sources) -> list[str]:
    lines = []
    for error in exc.errors(include_input=False, include_url=False):
        ctx = error.get("ctx") or {}
        cause = ctx.get("error")
        if isinstance(cause, ConfigProblems):
            # Problems that span keys: one line each, under the key each one names.
            at = tuple(error["loc"])
            for loc, problem in cause.problems:
                because = cause.because.get(loc)
                lines.append(
                    _line(
                        (*at, *loc),
                        problem,
                        sources,
                        because=None if because is None else (*at, *because),
                    )
                )
            continue
        kind = error["type"]
        if kind in _MESSAGES:
            message = _MESSAGES[kind]
        elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
            ops = {
                "greater_than_equal": ">=",
                "greater_than": ">",
                "less_than_equal": "<=",
                "less_than": "<",
            }
            bound = next(iter(ctx.values()), "?")
            if isinstance(bound, float) and bound.is_integer():
                bound = int(bound)
            message = f"must be {ops[kind]} {bound}"
        elif kind == "value_error":
            message = str(ctx.get("error", error["msg"]))
        else:
            message = error["msg"][:1].lower() + error["msg"][1:]
        renamed = RENAMED_FIELDS.get(str(error["loc"][-1])) if error["loc"] else None
        if kind == "extra_forbidden" and renamed is not None:
            message += f" (a process's command line is `{renamed}`)"
        lines.append(_line(tuple(error["loc"]), message, sources))
    return lines


@dataclass(frozen=True, slots=True)
class _Sources:
    """Where a key was set. By a variable: `set` names it for its key and every key under
    it, `made` for a mapping an override made on its way only (the error of an unknown
    key). Else by `file`, when the file holds the key or the mapping it is missing from
    (`in_file`, the file's key paths); else by the built-in defaults."""

    set: Mapping[tuple[str, ...], str]
    made: Mapping[tuple[str, ...], str]
    file: str | None = None
    in_file: frozenset[tuple[str, ...]] = frozenset()

    def of(self, loc: tuple[Any, ...]) -> str | None:
        """The variable or the file that set the key at `loc`, or the file that holds the
        mapping it is missing from; None: the defaults."""
        parts = tuple(str(p) for p in loc)
        source = self.set_by(loc)
        if source is None and self.file is not None and parts[:-1] in self.in_file:
            return self.file
        return source

    def set_by(self, loc: tuple[Any, ...]) -> str | None:
        """The variable or the file that set the key at `loc` itself; None: its default."""
        parts = tuple(str(p) for p in loc)
        best: tuple[str, ...] | None = None
        for path in self.set:
            if parts[: len(path)] == path and (best is None or len(path) > len(best)):
                best = path
        if best is not None:
            return self.set[best]
        if parts in self.made:
            return self.made[parts]
        if self.file is not None and parts in self.in_file:
            return self.file
        return None


def _line(
    loc: tuple[Any, ...],
    message: str,
    sources: _Sources,
    *,
    because: tuple[Any, ...] | None = None,
) -> str:
    """`config error: <key>: <message>`, naming the variable or the file that set the key;
    for a key left to its default, the one that set `because`, the key that made it wrong."""
    at = _key_path(loc)
    source = sources.of(at)
    if because is not None and sources.set_by(at) is None:
        source = sources.of(_key_path(because)) or source
    suffix = f" (from {one_line(source)})" if source else ""
    return f"config error: {dotted(_redact(at)) or '(top level)'}: {message}{suffix}"


def _key_path(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Drop pydantic's union tag (`runtime.kubernetes.qps` is the key `runtime.qps`)."""
    return tuple(
        part
        for i, part in enumerate(loc)
        if not (part == "[key]" or (i == 1 and loc[0] == "runtime" and part in RUNTIME_KINDS))
    )


def _redact(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Never print a token: a key under `org_tokens` is one. Quote a key that is not
    printable: a line break in it would split the message's one line per problem."""
    out: list[Any] = []
    for i, part in enumerate(loc):
        if i > 0 and loc[i - 1] == "org_tokens" and isinstance(part, str):
            out.append("<token>")
        elif isinstance(part, str):
            out.append(one_line(part))
        else:
            out.append(part)
    return tuple(out)
