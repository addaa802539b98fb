"""Configuration: one YAML file validated by pydantic, plus `STOKER_*` environment overrides.

`load_config(path)` reads the file (or nothing: every key has an embedded default), applies
the environment overrides (`STOKER_API__PORT=9000`, `STOKER_STORE=postgresql://...`; `__`
separates nested keys, a number indexes a list: `STOKER_POOLS__0__WARM_TARGET=5`) and
validates the result. Every model forbids unknown keys, so a typo is an error that names the
key, never a silently ignored setting. `to_domain` turns the validated config into the
domain objects the control plane runs on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from stoker.domain.errors import ConfigError
from stoker.domain.specs import (
    Activation,
    OrgSpec,
    PlaneSettings,
    PoolSpec,
    ProcessTemplate,
    Timeouts,
)
from stoker.domain.states import Reuse

#: Prefix of the environment variables that override configuration keys.
ENV_PREFIX = "STOKER_"
#: The demo worker shipped with stoker; `{python}` is the interpreter running the server.
DEMO_COMMAND = [
    "{python}",
    "-m",
    "stoker.demo_worker",
    "--port",
    "{port}",
    "--worker-id",
    "{worker_id}",
]

#: Pool names appear in URLs, metric labels and process labels: keep them plain.
PoolName = Annotated[
    str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
]
#: Bearer tokens travel in an HTTP header: visible ASCII, long enough not to be guessed.
Token = Annotated[str, StringConstraints(min_length=16, max_length=512, pattern=r"^[\x21-\x7e]+$")]
OrgName = Annotated[str, StringConstraints(min_length=1, max_length=128)]
Seconds = Annotated[float, Field(ge=0, le=365 * 86400)]
PositiveSeconds = Annotated[float, Field(gt=0, le=365 * 86400)]


class _Section(BaseModel):
    """Base of every config section: unknown keys and NaN/infinity are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class PostgresOptions(_Section):
    """Options of the PostgreSQL store (ignored by SQLite)."""

    #: SQL schema holding stoker's tables (a plain identifier).
    db_schema: str = Field(
        "stoker", alias="schema", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=63
    )
    min_pool_size: int = Field(1, ge=0, le=1000)
    max_pool_size: int = Field(10, ge=1, le=1000)
    #: Statements executed this often get prepared server-side; null disables preparing.
    prepare_threshold: int | None = Field(5, ge=0)

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True)

    @model_validator(mode="after")
    def _sizes(self) -> PostgresOptions:
        if self.min_pool_size > self.max_pool_size:
            raise ValueError("min_pool_size must not exceed max_pool_size")
        return self


class LocalRuntimeConfig(_Section):
    """Workers run as processes on this machine."""

    kind: Literal["local"] = "local"
    #: Memory the workers may use together; a pool with max_workers 0 is capped at
    #: budget / memory_mb. Null: half of this machine's memory.
    memory_budget_mb: int | None = Field(None, ge=1)
    #: Directory for one log file per worker; null discards worker output.
    log_dir: str | None = None


#: Runtime kinds this build can run, by the value of `runtime.kind`.
RUNTIME_KINDS: dict[str, type[LocalRuntimeConfig]] = {"local": LocalRuntimeConfig}
#: Kinds that are designed but whose runtime is not part of this build yet.
PLANNED_RUNTIME_KINDS = frozenset({"kubernetes"})


class ApiConfig(_Section):
    """The HTTP API: where it listens and who may call it."""

    host: str = Field("127.0.0.1", min_length=1)
    #: 0 picks a free port (the server prints the one it got).
    port: int = Field(8080, ge=0, le=65535)
    #: Tokens that act for every org and may list workers.
    admin_tokens: list[Token] = Field(default_factory=list)
    #: Tokens that act for one org only: `{token: org}` or a list of `{org, token}`.
    org_tokens: dict[Token, OrgName] = Field(default_factory=dict)
    #: Largest request body accepted; larger ones get 413.
    max_body_bytes: int = Field(65536, ge=1024, le=16 * 1024 * 1024)

    @field_validator("admin_tokens", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        # An environment override is one string: "tok1,tok2".
        if isinstance(value, str):
            return [t.strip() for t in value.split(",") if t.strip()]
        return value

    @field_validator("org_tokens", mode="before")
    @classmethod
    def _list_form(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        out: dict[Any, Any] = {}
        for i, item in enumerate(value):
            if not isinstance(item, dict) or set(item) != {"org", "token"}:
                raise ValueError(f"item {i} must be a mapping with exactly the keys org and token")
            if not isinstance(item["token"], str):
                raise ValueError(f"item {i}: token must be a string")
            if item["token"] in out:
                raise ValueError(f"item {i} repeats a token")
            out[item["token"]] = item["org"]
        return out

    @model_validator(mode="after")
    def _distinct_tokens(self) -> ApiConfig:
        if len(set(self.admin_tokens)) != len(self.admin_tokens):
            raise ValueError("admin_tokens repeats a token")
        if set(self.admin_tokens) & set(self.org_tokens):
            raise ValueError("a token is both an admin token and an org token")
        return self

    @property
    def has_tokens(self) -> bool:
        """True when clients must authenticate."""
        return bool(self.admin_tokens or self.org_tokens)


class IntervalsBase(_Section):
    """Intervals and budgets of the control plane (`stoker.domain.specs.PlaneSettings`)."""

    janitor_interval_s: PositiveSeconds = 2.0
    reaper_interval_s: PositiveSeconds = 10.0
    instance_heartbeat_s: PositiveSeconds = 5.0
    instance_expiry_s: PositiveSeconds = 20.0
    stranded_grace_s: Seconds = 120.0
    stranded_scan_s: PositiveSeconds = 60.0
    history_retention_s: Seconds = 86_400.0
    purge_interval_s: PositiveSeconds = 600.0
    spawn_rate: float = Field(50.0, gt=0, le=100_000)
    spawn_burst: int = Field(100, ge=1, le=100_000)
    demand_window_s: PositiveSeconds = 60.0
    shutdown_grace_s: Seconds = 30.0
    org_cap_retry_after_s: Seconds = 45.0

    @model_validator(mode="after")
    def _expiry_outlives_heartbeat(self) -> IntervalsBase:
        # A replica that heartbeats slower than it expires would be declared dead while alive.
        if self.instance_expiry_s <= self.instance_heartbeat_s:
            raise ValueError("instance_expiry_s must be longer than instance_heartbeat_s")
        return self


def _intervals_model() -> type[IntervalsBase]:
    """`IntervalsBase` plus any `PlaneSettings` field it does not name yet (>= 0, same default).

    The control plane grows settings on its own schedule; each one is configurable from the
    day it exists, and gets its precise bounds when it is named above.
    """
    kinds = {"int": int, "float": float, "bool": bool}
    extra: dict[str, Any] = {}
    for f in dataclasses.fields(PlaneSettings):
        if f.name in IntervalsBase.model_fields:
            continue
        kind = kinds.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
        if kind is None:
            continue
        extra[f.name] = (kind, Field(f.default, ge=0) if kind is not bool else f.default)
    if not extra:
        return IntervalsBase
    model: type[IntervalsBase] = create_model("IntervalsConfig", __base__=IntervalsBase, **extra)
    return model


if TYPE_CHECKING:
    IntervalsConfig = IntervalsBase
else:
    IntervalsConfig = _intervals_model()


class TimeoutsConfig(_Section):
    """How long each in-flight state may last before the stuck sweep retires it."""

    spawn_s: PositiveSeconds = 120.0
    reserve_s: PositiveSeconds = 30.0
    activation_s: PositiveSeconds = 30.0
    drain_s: PositiveSeconds = 120.0
    stop_grace_s: Seconds = 10.0


class PoolConfig(_Section):
    """One pool; maps onto `stoker.domain.specs.PoolSpec`."""

    name: PoolName
    #: argv of a worker process (never run through a shell); `{port}`, `{worker_id}` and
    #: `{python}` are replaced when a worker starts.
    command: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    memory_mb: int = Field(64, ge=1)
    warm_target: int = Field(0, ge=0, le=100_000)
    #: 0: derived from runtime.memory_budget_mb / memory_mb.
    max_workers: int = Field(0, ge=0, le=1_000_000)
    #: 0: no per-org cap.
    max_workers_per_org: int = Field(0, ge=0, le=1_000_000)
    hot_idle_ttl: Seconds | None = None
    #: Upper clamp of any TTL a claim or org asks for; 0: no clamp.
    max_ttl: Seconds = 0.0
    min_hot_idle: int = Field(0, ge=0, le=100_000)
    reuse: Reuse = Reuse.SAME_ORG
    activation: Activation = Activation.HTTP
    scale_down_delay: Seconds = 60.0
    lease_s: float = Field(60.0, gt=0, le=86400)
    claim_timeout_s: float = Field(30.0, ge=0, le=3600)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)

    @model_validator(mode="after")
    def _target_within_cap(self) -> PoolConfig:
        if self.max_workers and self.warm_target > self.max_workers:
            raise ValueError(
                f"warm_target ({self.warm_target}) exceeds max_workers ({self.max_workers})"
            )
        return self


class OrgConfig(_Section):
    """Per-org overrides; a missing value falls back to the pool's."""

    name: OrgName
    hot_idle_ttl: Seconds | None = None
    min_hot_idle: int | None = Field(None, ge=0)
    max_workers: int | None = Field(None, ge=0)


def _default_pools() -> list[PoolConfig]:
    return [PoolConfig(name="demo", command=list(DEMO_COMMAND), warm_target=2)]


class StokerConfig(_Section):
    """The whole configuration of one `stoker serve`."""

    #: `sqlite:///relative/path.db`, `sqlite:////absolute/path.db` or `postgresql://...`.
    store: str = "sqlite:///./stoker.db"
    store_options: PostgresOptions = Field(default_factory=PostgresOptions)
    runtime: LocalRuntimeConfig = Field(default_factory=LocalRuntimeConfig)
    #: Label of this fleet's runtime objects; null derives one from the store URL, so two
    #: servers with different stores never take each other's workers for stranded ones.
    fleet: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    api: ApiConfig = Field(default_factory=ApiConfig)
    intervals: IntervalsConfig = Field(default_factory=IntervalsConfig)
    pools: list[PoolConfig] = Field(default_factory=_default_pools, min_length=1)
    orgs: list[OrgConfig] = Field(default_factory=list)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["kv", "json"] = "kv"

    @field_validator("store")
    @classmethod
    def _store_url(cls, value: str) -> str:
        if value.startswith("sqlite:///"):
            if len(value) == len("sqlite:///"):
                raise ValueError("sqlite URL needs a path: sqlite:///./stoker.db")
            return value
        if value.startswith(("postgresql://", "postgres://")):
            return value
        raise ValueError("must start with sqlite:/// or postgresql://")

    @field_validator("runtime", mode="before")
    @classmethod
    def _runtime_kind(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        kind = value.get("kind", "local")
        if kind in PLANNED_RUNTIME_KINDS:
            raise ValueError(
                f"kind {kind!r} is not available in this version of stoker; "
                f"supported: {', '.join(sorted(RUNTIME_KINDS))}"
            )
        if kind not in RUNTIME_KINDS:
            raise ValueError(
                f"unknown kind {kind!r}; supported: {', '.join(sorted(RUNTIME_KINDS))}"
            )
        return value

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lowercase(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _unique_names(self) -> StokerConfig:
        for section, names in (
            ("pools", [p.name for p in self.pools]),
            ("orgs", [o.name for o in self.orgs]),
        ):
            seen: set[str] = set()
            for name in names:
                if name in seen:
                    raise ValueError(f"{section}: name {name!r} appears twice")
                seen.add(name)
        return self

    # -- derived values ---------------------------------------------------------------------

    @property
    def is_postgres(self) -> bool:
        """True when the store is PostgreSQL."""
        return self.store.startswith(("postgresql://", "postgres://"))

    def sqlite_path(self) -> str:
        """The SQLite file named by `store` (`:memory:` stays as it is)."""
        path = self.store[len("sqlite:///") :]
        return path if path == ":memory:" else os.path.abspath(path)

    def fleet_name(self) -> str:
        """`fleet`, or a stable name derived from the store."""
        if self.fleet:
            return self.fleet
        if self.is_postgres:
            identity = f"{_without_password(self.store)}#{self.store_options.db_schema}"
        else:
            identity = self.sqlite_path()
        return "stoker-" + hashlib.sha256(identity.encode()).hexdigest()[:10]


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not at:
        return url
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}@{host}"


# -- loading --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    """A validated config and where it came from (for the server's start-up line)."""

    config: StokerConfig
    source: str
    #: Environment variables that overrode keys.
    overrides: tuple[str, ...] = ()


def load_config(
    path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> LoadedConfig:
    """Read `path` (or nothing), apply `STOKER_*` overrides from `environ`, validate.

    Raises `ConfigError` whose message has one `config error: <key>: <problem>` line per
    problem.
    """
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    source = "built-in defaults"
    if path is not None:
        data = _read_yaml(Path(path))
        source = str(path)
    env_keys = _apply_env(data, environ)
    try:
        config = StokerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("\n".join(format_errors(exc, env_keys))) from None
    # The domain objects run their own checks; surface them as config errors now.
    to_domain(config)
    return LoadedConfig(config, source, tuple(sorted(set(env_keys.values()))))


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config error: cannot read {path}: {_reason(exc)}") from None
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


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _apply_env(data: dict[str, Any], environ: Mapping[str, str]) -> dict[tuple[str, ...], str]:
    """Merge `STOKER_*` overrides into `data`; returns the key paths they set, by variable.

    Only variables whose first segment names a top-level key count: `STOKER_URL` and
    `STOKER_TOKEN` belong to the client commands, not to the server's config.
    """
    top = set(StokerConfig.model_fields)
    applied: dict[tuple[str, ...], str] = {}
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX):
            continue
        path = tuple(name[len(ENV_PREFIX) :].lower().split("__"))
        if path[0] not in top or not all(path):
            continue
        raw = environ[name]
        value: Any = raw
        if raw.strip().startswith(("[", "{")):
            try:
                value = json.loads(raw)
            except ValueError as exc:
                raise ConfigError(f"config error: {name}: not valid JSON ({exc})") from None
        if path[0] == "pools" and len(path) > 1 and "pools" not in data:
            # Indexing the default pools: materialise them first.
            data["pools"] = [p.model_dump(mode="json", by_alias=True) for p in _default_pools()]
        _set_path(data, path, value, name)
        applied[path] = name
    return applied


def _set_path(data: dict[str, Any], path: tuple[str, ...], value: Any, name: str) -> None:
    target: Any = data
    for i, key in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(target, list):
            if not key.isdigit() or int(key) >= len(target):
                raise ConfigError(
                    f"config error: {name}: {'.'.join(path[:i])} has no item {key} "
                    f"(it has {len(target)})"
                )
            target = target[int(key)]
            continue
        if not isinstance(target, dict):
            raise ConfigError(f"config error: {name}: {'.'.join(path[:i])} is not a mapping")
        if key not in target or target[key] is None:
            target[key] = [] if nxt.isdigit() else {}
        target = target[key]
    last = path[-1]
    if isinstance(target, list):
        if not last.isdigit() or int(last) >= len(target):
            raise ConfigError(f"config error: {name}: no item {last} to override")
        target[int(last)] = value
    elif isinstance(target, dict):
        target[last] = value
    else:
        raise ConfigError(f"config error: {name}: {'.'.join(path[:-1])} is not a mapping")


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
}


def format_errors(exc: ValidationError, env_keys: Mapping[tuple[str, ...], str]) -> list[str]:
    """One `config error: <key>: <problem>` line per pydantic error."""
    lines = []
    for error in exc.errors(include_input=False, include_url=False):
        loc = _redact(tuple(error["loc"]))
        key = _dotted(loc) or "(top level)"
        ctx = error.get("ctx") or {}
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
        source = _env_source(loc, env_keys)
        suffix = f" (from {source})" if source else ""
        lines.append(f"config error: {key}: {message}{suffix}")
    return lines


def _redact(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Never print a token: a key under `org_tokens` is one."""
    out: list[Any] = []
    for i, part in enumerate(loc):
        if i > 0 and loc[i - 1] == "org_tokens" and isinstance(part, str):
            out.append("<token>")
        elif part == "[key]":
            continue
        else:
            out.append(part)
    return tuple(out)


def _dotted(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _env_source(loc: tuple[Any, ...], env_keys: Mapping[tuple[str, ...], str]) -> str | None:
    parts = tuple(str(p) for p in loc)
    best: tuple[str, ...] | None = None
    for path in env_keys:
        if parts[: len(path)] == path and (best is None or len(path) > len(best)):
            best = path
    return env_keys[best] if best is not None else None


# -- to domain objects ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DomainConfig:
    """What the control plane is built from."""

    pools: list[PoolSpec]
    orgs: list[OrgSpec]
    settings: PlaneSettings


def to_domain(config: StokerConfig) -> DomainConfig:
    """Convert the validated config into `PoolSpec`, `OrgSpec` and `PlaneSettings`.

    Raises `ConfigError` when a domain object rejects a value (naming the pool).
    """
    pools = []
    for i, p in enumerate(config.pools):
        template = ProcessTemplate(
            argv=tuple(p.command), env=dict(p.env), cwd=p.cwd, memory_mb=p.memory_mb
        )
        try:
            pools.append(
                PoolSpec(
                    name=p.name,
                    template=template,
                    warm_target=p.warm_target,
                    max_workers=p.max_workers,
                    max_workers_per_org=p.max_workers_per_org,
                    hot_idle_ttl=p.hot_idle_ttl,
                    max_ttl=p.max_ttl,
                    min_hot_idle=p.min_hot_idle,
                    reuse=p.reuse,
                    activation=p.activation,
                    scale_down_delay=p.scale_down_delay,
                    lease_s=p.lease_s,
                    claim_timeout_s=p.claim_timeout_s,
                    timeouts=Timeouts(**p.timeouts.model_dump()),
                )
            )
        except ConfigError as exc:
            raise ConfigError(f"config error: pools[{i}]: {exc}") from None
    orgs = [
        OrgSpec(
            name=o.name,
            hot_idle_ttl=o.hot_idle_ttl,
            min_hot_idle=o.min_hot_idle,
            max_workers=o.max_workers,
        )
        for o in config.orgs
    ]
    settings = PlaneSettings(**config.intervals.model_dump())
    return DomainConfig(pools=pools, orgs=orgs, settings=settings)
