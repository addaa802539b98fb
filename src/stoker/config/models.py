"""The whole configuration of one `stoker serve` (`StokerConfig`) and what it derives: the
elector, the janitor's lease, the fleet's name, the store's kind and path."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_core.core_schema import ValidatorFunctionWrapHandler

from stoker.config.activation import ActivationConfig
from stoker.config.names import LABEL_VALUE_RULE, is_label_value
from stoker.config.pools import PoolConfig, default_pools
from stoker.config.problems import ConfigProblems, Loc, raise_problems
from stoker.config.rules import election_problems, pool_problems
from stoker.config.schema import Section
from stoker.config.sections import (
    RUNTIME_KINDS,
    ApiConfig,
    LeaderElectionConfig,
    LocalRuntimeConfig,
    PostgresOptions,
    RuntimeConfig,
)
from stoker.config.tracing import TracingConfig
from stoker.domain.specs import JANITOR_LEASE, OrgSpec, PlaneSettings


class StokerConfig(Section):
    """The whole configuration of one `stoker serve`."""

    #: `sqlite:///relative/path.db`, `sqlite:////absolute/path.db` or `postgresql://...`.
    store: str = "sqlite:///./stoker.db"
    store_options: PostgresOptions = Field(default_factory=PostgresOptions)
    #: Where workers run: `kind: local` (processes of this machine) or `kind: kubernetes`.
    runtime: RuntimeConfig = Field(default_factory=LocalRuntimeConfig, discriminator="kind")
    #: The janitor's elector: a mapping, or the shorthand none | store | kubernetes | auto.
    leader_election: LeaderElectionConfig = Field(default_factory=LeaderElectionConfig)
    #: Label of this fleet's runtime objects (a Kubernetes label value); null derives one
    #: from the store URL, so two servers with different stores never take each other's
    #: workers for stranded ones.
    fleet: str | None = None
    api: ApiConfig = Field(default_factory=ApiConfig)
    #: The fleet activation key that signs every activation (see `config.activation`).
    activation: ActivationConfig = Field(default_factory=ActivationConfig)
    #: OpenTelemetry spans of each claim (the `tracing` extra; see `config.tracing`).
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    #: Intervals and budgets of the control plane: the fields of `PlaneSettings`.
    intervals: PlaneSettings = Field(default_factory=PlaneSettings)
    pools: list[PoolConfig] = Field(default_factory=default_pools, min_length=1)
    #: Per-org overrides: the fields of `OrgSpec`; a missing value falls back to the pool's.
    orgs: list[OrgSpec] = Field(default_factory=list)
    #: Lowest level of the log lines written (case-insensitive).
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    #: `kv`: key=value lines; `json`: one JSON object per line.
    log_format: Literal["kv", "json"] = "kv"

    #: The keys of `intervals` the config names (`intervals_given`).
    _intervals_given: frozenset[str] = PrivateAttr(frozenset())

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
        if not isinstance(kind, str) or kind not in RUNTIME_KINDS:
            # Under `runtime.kind`: the key to change (and the variable that set it).
            supported = ", ".join(sorted(RUNTIME_KINDS))
            raise ConfigProblems([(("kind",), f"unknown kind {kind!r}; supported: {supported}")])
        # `kind` may be left out for the local runtime; the union is told apart by it.
        return {**value, "kind": kind}

    @field_validator("leader_election", mode="before")
    @classmethod
    def _election_shorthand(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"kind": value}
        if not isinstance(value, Mapping | LeaderElectionConfig):
            raise ValueError("must be a mapping or one of none, store, kubernetes, auto")
        return value

    @field_validator("fleet")
    @classmethod
    def _fleet_label(cls, value: str | None) -> str | None:
        # Every runtime object carries the fleet as a label (a pod label on Kubernetes).
        if value is not None and not is_label_value(value):
            raise ValueError(f"must be {LABEL_VALUE_RULE}")
        return value

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lowercase(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("intervals")
    @classmethod
    def _expiry_outlives_heartbeat(cls, value: PlaneSettings) -> PlaneSettings:
        # A replica that heartbeats slower than it expires would be declared dead while alive.
        if value.instance_expiry_s <= value.instance_heartbeat_s:
            raise ValueError("instance_expiry_s must be longer than instance_heartbeat_s")
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _remember_given_intervals(
        cls, data: Any, handler: ValidatorFunctionWrapHandler
    ) -> StokerConfig:
        config: StokerConfig = handler(data)
        given = data.get("intervals") if isinstance(data, Mapping) else None
        if isinstance(given, Mapping):
            config._intervals_given = frozenset(given)
        return config

    @model_validator(mode="after")
    def _unique_names(self) -> StokerConfig:
        problems: list[tuple[Loc, str]] = []
        for section, what, names in (
            ("pools", "pool", [p.name for p in self.pools]),
            ("orgs", "org", [o.name for o in self.orgs]),
        ):
            first: dict[str, int] = {}
            for i, name in enumerate(names):
                if name in first:
                    # Under the later item's name: the one to rename.
                    also = f"{section}[{first[name]}]"
                    problems.append(
                        ((section, i, "name"), f"duplicate {what} name {name!r} (also {also})")
                    )
                else:
                    first[name] = i
        raise_problems(problems)
        return self

    @model_validator(mode="after")
    def _across_sections(self) -> StokerConfig:
        raise_problems(
            [
                *pool_problems(
                    self.runtime, self.pools, pools_given="pools" in self.model_fields_set
                ),
                *election_problems(
                    self.runtime,
                    self.elector_kind(),
                    self.janitor_lease_name(),
                    lease_name_given=bool(self.leader_election.lease_name),
                ),
            ]
        )
        return self

    # -- derived values ---------------------------------------------------------------------

    def intervals_given(self) -> frozenset[str]:
        """The keys of `intervals` the config names; the others are `PlaneSettings`' defaults."""
        return self._intervals_given

    def elector_kind(self) -> Literal["none", "store", "kubernetes"]:
        """`leader_election.kind` with `auto` resolved: `store` on PostgreSQL, else `none`.

        SQLite is one machine's file, so `auto` assumes one replica there.
        """
        kind = self.leader_election.kind
        if kind == "auto":
            return "store" if self.is_postgres else "none"
        return kind

    def janitor_lease_name(self) -> str | None:
        """The lease the janitor is elected on; None without an elector."""
        kind = self.elector_kind()
        if kind == "none":
            return None
        if self.leader_election.lease_name:
            return self.leader_election.lease_name
        # One Lease per fleet: two deployments sharing a namespace never share a janitor.
        return JANITOR_LEASE if kind == "store" else f"{self.fleet_name()}-janitor"

    @property
    def is_postgres(self) -> bool:
        """True when the store is PostgreSQL."""
        return self.store.startswith(("postgresql://", "postgres://"))

    def store_display(self) -> str:
        """`store` without its password, for logs and the server's start-up line."""
        return _without_password(self.store)

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
