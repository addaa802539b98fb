"""Configuration: one YAML file validated by pydantic, plus `STOKER_*` environment overrides.

`load_config(path)` reads the file (or nothing: every key has an embedded default), applies
the environment overrides (`STOKER_API__PORT=9000`, `STOKER_STORE=postgresql://...`; `__`
separates nested keys, a number indexes a list: `STOKER_POOLS__0__WARM_TARGET=5`) and
validates the result. Every model forbids unknown keys, so a typo is an error that names the
key, never a silently ignored setting. `to_domain` turns the validated config into the
domain objects the control plane runs on.

`runtime.kind` picks the workers' runtime (`local` processes with a `command` per pool, or
`kubernetes` pods with a `pod` per pool) and `leader_election` the janitor's elector
(`none`, `store`, `kubernetes`, or `auto`: `store` on PostgreSQL, `none` on SQLite).
Rules that span sections (a pool's template must match the runtime, headroom needs a
placeholder priority class, ...) are checked on the whole config and reported under the
key to change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
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
    JANITOR_LEASE,
    Activation,
    OrgSpec,
    PlaneSettings,
    PodTemplate,
    PoolSpec,
    ProcessTemplate,
    RuntimeTemplate,
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

# Kubernetes name rules, applied here so that a bad name is a config error at start-up,
# not a pod the API server refuses on every spawn.
# A label value and the name part of a label or annotation key follow the same rule.
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_ENV_NAME = re.compile(r"[-._A-Za-z][-._A-Za-z0-9]*")
_QUANTITY = re.compile(r"(\d+(\.\d*)?|\.\d+)([mkMGTPE]|[KMGTPE]i|[eE]\d+)?")
#: What a label value may be, in words (fleet, pool names, label values).
LABEL_VALUE_RULE = (
    "a valid Kubernetes label value: at most 63 letters, digits, '-', '_' or '.', "
    "beginning and ending with a letter or digit"
)
_DNS_SUBDOMAIN_RULE = (
    "a valid Kubernetes object name: at most 253 lowercase letters, digits, '-' or '.', "
    "beginning and ending with a letter or digit"
)
#: Labels and annotations the Kubernetes runtime sets itself; a template may not set them.
_RESERVED_LABEL_PREFIX = "stoker.dev/"
_RESERVED_LABELS = frozenset({"app.kubernetes.io/managed-by"})
_RESERVED_ANNOTATIONS = frozenset({"karpenter.sh/do-not-disrupt"})


def is_label_value(value: str) -> bool:
    """True when `value` is a non-empty Kubernetes label value."""
    return _LABEL_VALUE.fullmatch(value) is not None


def _is_dns_subdomain(value: str) -> bool:
    return len(value) <= 253 and _DNS_SUBDOMAIN.fullmatch(value) is not None


def _check_label_value(value: str) -> str:
    # An empty label value is valid in Kubernetes and means "no value" in a selector.
    if value and not is_label_value(value):
        raise ValueError(f"{value!r} is not {LABEL_VALUE_RULE}")
    return value


def _check_qualified_name(value: str) -> str:
    """A label or annotation key: an optional DNS-subdomain prefix and `/`, then a name."""
    prefix, slash, name = value.rpartition("/")
    if (slash and not _is_dns_subdomain(prefix)) or _LABEL_VALUE.fullmatch(name) is None:
        raise ValueError(
            f"{value!r} is not a valid Kubernetes key: an optional DNS prefix and '/', then "
            "at most 63 letters, digits, '-', '_' or '.', beginning and ending with a letter "
            "or digit"
        )
    return value


def _check_dns_subdomain(value: str) -> str:
    if not _is_dns_subdomain(value):
        raise ValueError(f"{value!r} is not {_DNS_SUBDOMAIN_RULE}")
    return value


def _check_dns_label(value: str) -> str:
    if _DNS_LABEL.fullmatch(value) is None:
        raise ValueError(
            f"{value!r} is not a valid namespace: at most 63 lowercase letters, digits or '-', "
            "beginning and ending with a letter or digit"
        )
    return value


def _check_env_name(value: str) -> str:
    if _ENV_NAME.fullmatch(value) is None:
        raise ValueError(
            f"{value!r} is not a valid environment variable name: letters, digits, '_', '-' "
            "or '.', not beginning with a digit"
        )
    return value


def _quantity_text(value: Any) -> Any:
    # YAML reads `cpu: 2` as a number; Kubernetes quantities are strings. Written out in
    # full: `format(.., "g")` would turn 4294967296 into 4.29497e+09.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _check_quantity(value: str) -> str:
    match = _QUANTITY.fullmatch(value)
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity such as 500m, 2, 512Mi or 4Gi")
    if float(match.group(1)) <= 0:
        raise ValueError(f"{value!r} must be more than 0")
    return value


LabelValue = Annotated[str, AfterValidator(_check_label_value)]
QualifiedName = Annotated[str, AfterValidator(_check_qualified_name)]
DnsSubdomain = Annotated[str, AfterValidator(_check_dns_subdomain)]
DnsLabel = Annotated[str, AfterValidator(_check_dns_label)]
EnvName = Annotated[str, AfterValidator(_check_env_name)]
#: A Kubernetes resource quantity (`"2"`, `500m`, `4Gi`); numbers are accepted as text.
Quantity = Annotated[str, BeforeValidator(_quantity_text), AfterValidator(_check_quantity)]
#: argv of a worker process: at least the program.
Argv = Annotated[list[str], Field(min_length=1)]

#: Where a problem lies: config keys and list indexes, like pydantic's error locations.
Loc = tuple[str | int, ...]


class ConfigProblems(ValueError):
    """Problems that span sections, each reported under the key to change.

    Raised from a model validator; `format_errors` prints one line per problem, at the
    validator's location plus the problem's own, instead of one line at the model.
    """

    def __init__(self, problems: Sequence[tuple[Loc, str]]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(f"{_dotted(loc)}: {message}" for loc, message in problems))


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


class PlaceholderSize(_Section):
    """Requests (= limits) of one headroom placeholder pod."""

    cpu: Quantity
    memory: Quantity


class KubernetesRuntimeConfig(_Section):
    """Workers run as pods; every pool needs a `pod` template."""

    kind: Literal["kubernetes"]
    #: Namespace of the worker pods (and of the janitor Lease). Null: the pod's own
    #: namespace when stoker runs in a cluster, else "default".
    namespace: DnsLabel | None = None
    #: Null: the in-cluster service account, else $KUBECONFIG or ~/.kube/config.
    kubeconfig: str | None = Field(None, min_length=1)
    #: A context of the kubeconfig; null: its current context.
    context: str | None = Field(None, min_length=1)
    #: The API client's budget (token bucket); spawns are paced to it as well.
    qps: float = Field(50.0, gt=0, le=100_000)
    burst: int = Field(100, ge=1, le=100_000)
    #: The informer lists and diffs this often, to catch what a dropped watch missed.
    resync_s: PositiveSeconds = 300.0
    #: PriorityClass of headroom placeholders; required when a pool has headroom_nodes.
    placeholder_priority_class: DnsSubdomain | None = None
    placeholder_image: str = Field("registry.k8s.io/pause:3.10", min_length=1)
    #: Null: each pool's placeholders are as large as its workers.
    placeholder_size: PlaceholderSize | None = None


RuntimeConfig = LocalRuntimeConfig | KubernetesRuntimeConfig
#: Runtime kinds this build can run, by the value of `runtime.kind`.
RUNTIME_KINDS: dict[str, type[RuntimeConfig]] = {
    "local": LocalRuntimeConfig,
    "kubernetes": KubernetesRuntimeConfig,
}

#: Values of `leader_election.kind`; `auto` resolves by the store (`elector_kind`).
ElectionKind = Literal["auto", "none", "store", "kubernetes"]


class LeaderElectionConfig(_Section):
    """Who runs the fleet-wide janitor; the timings are client-go's defaults."""

    kind: ElectionKind = "auto"
    #: Null: "janitor" (a row of the store) or "<fleet>-janitor" (a Kubernetes Lease).
    lease_name: str | None = Field(None, min_length=1, max_length=253)
    lease_duration_s: PositiveSeconds = 15.0
    renew_deadline_s: PositiveSeconds = 10.0
    retry_period_s: PositiveSeconds = 2.0

    @model_validator(mode="after")
    def _timings(self) -> LeaderElectionConfig:
        # A leader steps down at the renew deadline, before its lease can expire for the
        # others, and retries often enough to renew more than once before that deadline.
        problems: list[tuple[Loc, str]] = []
        if not self.lease_duration_s > self.renew_deadline_s:
            problems.append(
                (
                    ("lease_duration_s",),
                    f"must exceed renew_deadline_s ({self.renew_deadline_s:g})",
                )
            )
        if not self.renew_deadline_s > 1.2 * self.retry_period_s:
            problems.append(
                (
                    ("renew_deadline_s",),
                    f"must exceed 1.2 x retry_period_s ({self.retry_period_s:g}), "
                    f"i.e. {1.2 * self.retry_period_s:g}",
                )
            )
        if problems:
            raise ConfigProblems(problems)
        return self


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


class TolerationConfig(_Section):
    """One toleration of a worker pod (Kubernetes' `tolerationSeconds` spelling accepted)."""

    key: str | None = Field(None, min_length=1)
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, alias="tolerationSeconds", ge=0)

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True)

    @model_validator(mode="after")
    def _consistent(self) -> TolerationConfig:
        # The API server's own rules; a pod breaking them is refused at every spawn.
        if self.key is None and self.operator != "Exists":
            raise ValueError("a toleration without a key must use operator Exists")
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("a toleration with operator Exists takes no value")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds needs effect NoExecute")
        return self

    def as_mapping(self) -> dict[str, Any]:
        """The toleration in Kubernetes' spelling, without unset fields."""
        body = {
            "key": self.key,
            "operator": self.operator,
            "value": self.value,
            "effect": self.effect,
            "tolerationSeconds": self.toleration_seconds,
        }
        return {k: v for k, v in body.items() if v is not None}


class PodConfig(_Section):
    """A worker pod (runtime.kind: kubernetes); maps onto `stoker.domain.specs.PodTemplate`.

    `{port}` and `{worker_id}` are replaced in `command`, `args` and `env`. Requests equal
    limits (`cpu`, `memory`), so workers get the Guaranteed QoS class.
    """

    image: str = Field(min_length=1)
    #: Replaces the image's entrypoint; empty keeps it.
    command: list[str] = Field(default_factory=list)
    args: list[str] = Field(default_factory=list)
    env: dict[EnvName, str] = Field(default_factory=dict)
    #: The defaults are `PodTemplate`'s.
    cpu: Quantity = "1"
    memory: Quantity = "1Gi"
    port: int = Field(8080, ge=1, le=65535)
    node_selector: dict[QualifiedName, LabelValue] = Field(default_factory=dict)
    tolerations: list[TolerationConfig] = Field(default_factory=list)
    priority_class: DnsSubdomain | None = None
    service_account: DnsSubdomain | None = None
    labels: dict[QualifiedName, LabelValue] = Field(default_factory=dict)
    annotations: dict[QualifiedName, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _not_stokers_own(self) -> PodConfig:
        # The runtime sets these itself (the fleet label scopes every list and watch;
        # do-not-disrupt follows the worker's state): a template value would be dropped.
        problems: list[tuple[Loc, str]] = []
        for key in self.labels:
            if key.startswith(_RESERVED_LABEL_PREFIX) or key in _RESERVED_LABELS:
                problems.append((("labels", key), "is set by stoker itself"))
        for key in self.annotations:
            if key in _RESERVED_ANNOTATIONS:
                problems.append((("annotations", key), "is set by stoker itself"))
        if problems:
            raise ConfigProblems(problems)
        return self

    def to_template(self) -> PodTemplate:
        """The domain's pod template."""
        return PodTemplate(
            image=self.image,
            command=tuple(self.command),
            args=tuple(self.args),
            env=dict(self.env),
            cpu=self.cpu,
            memory=self.memory,
            port=self.port,
            node_selector=dict(self.node_selector),
            tolerations=tuple(t.as_mapping() for t in self.tolerations),
            priority_class=self.priority_class,
            service_account=self.service_account,
            labels=dict(self.labels),
            annotations=dict(self.annotations),
        )


class PoolConfig(_Section):
    """One pool; maps onto `stoker.domain.specs.PoolSpec`.

    Exactly one of `command` (runtime.kind: local) and `pod` (runtime.kind: kubernetes);
    `StokerConfig` checks which one against the runtime.
    """

    name: PoolName
    #: argv of a worker process (never run through a shell); `{port}`, `{worker_id}` and
    #: `{python}` are replaced when a worker starts.
    command: Argv | None = None
    #: The worker pod of the kubernetes runtime.
    pod: PodConfig | None = None
    #: Local runtime only: environment, working directory and memory of the process.
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    memory_mb: int = Field(64, ge=1)
    #: Kubernetes only: placeholder pods that keep this many spare nodes (a constant).
    headroom_nodes: int = Field(0, ge=0, le=1000)
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
    runtime: RuntimeConfig = Field(default_factory=LocalRuntimeConfig, discriminator="kind")
    #: The janitor's elector: a mapping, or the shorthand none | store | kubernetes | auto.
    leader_election: LeaderElectionConfig = Field(default_factory=LeaderElectionConfig)
    #: Label of this fleet's runtime objects (a Kubernetes label value); null derives one
    #: from the store URL, so two servers with different stores never take each other's
    #: workers for stranded ones.
    fleet: str | None = None
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
        if not isinstance(kind, str) or kind not in RUNTIME_KINDS:
            raise ValueError(
                f"unknown kind {kind!r}; supported: {', '.join(sorted(RUNTIME_KINDS))}"
            )
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

    @model_validator(mode="after")
    def _across_sections(self) -> StokerConfig:
        problems = [*self._pool_problems(), *self._election_problems()]
        if problems:
            raise ConfigProblems(problems)
        return self

    def _pool_problems(self) -> list[tuple[Loc, str]]:
        """Each pool's template matches the runtime; headroom only where it can work."""
        kubernetes = isinstance(self.runtime, KubernetesRuntimeConfig)
        if kubernetes and "pools" not in self.model_fields_set:
            return [
                (
                    ("pools",),
                    "required with runtime.kind kubernetes (the built-in demo pool runs a "
                    "local process): give each pool a pod",
                )
            ]
        problems: list[tuple[Loc, str]] = []
        headroom: list[str] = []
        for i, pool in enumerate(self.pools):
            at: Loc = ("pools", i)
            if pool.command is not None and pool.pod is not None:
                problems.append(
                    (
                        at,
                        "set command (runtime.kind local) or pod (runtime.kind kubernetes), "
                        "not both",
                    )
                )
            elif kubernetes and pool.pod is None:
                if pool.command is None:
                    problems.append(((*at, "pod"), "required"))
                else:
                    problems.append(
                        (
                            (*at, "command"),
                            "runs a local process, but runtime.kind is kubernetes: "
                            "give the pool a pod instead",
                        )
                    )
            elif not kubernetes and pool.command is None:
                if pool.pod is None:
                    problems.append(((*at, "command"), "required"))
                else:
                    problems.append(
                        (
                            (*at, "pod"),
                            "needs runtime.kind kubernetes; the local runtime runs a command",
                        )
                    )
            if kubernetes:
                if not is_label_value(pool.name):
                    problems.append(
                        ((*at, "name"), f"with runtime.kind kubernetes, must be {LABEL_VALUE_RULE}")
                    )
                # Settings of a local process: with pods they would be silently ignored.
                for key, hint in (
                    ("env", "set pod.env"),
                    ("cwd", "the image decides"),
                    ("memory_mb", "set pod.memory"),
                ):
                    if key in pool.model_fields_set:
                        problems.append(((*at, key), f"is for the local runtime only ({hint})"))
                if pool.headroom_nodes > 0:
                    headroom.append(pool.name)
            elif pool.headroom_nodes > 0:
                problems.append(
                    (
                        (*at, "headroom_nodes"),
                        "needs runtime.kind kubernetes (placeholder pods hold spare nodes)",
                    )
                )
        if (
            headroom
            and isinstance(self.runtime, KubernetesRuntimeConfig)
            and self.runtime.placeholder_priority_class is None
        ):
            problems.append(
                (
                    ("runtime", "placeholder_priority_class"),
                    f"required when a pool has headroom_nodes > 0 ({', '.join(headroom)}): "
                    "without a class below the workers', no worker could preempt a placeholder",
                )
            )
        return problems

    def _election_problems(self) -> list[tuple[Loc, str]]:
        kind = self.elector_kind()
        if kind == "kubernetes" and not isinstance(self.runtime, KubernetesRuntimeConfig):
            return [
                (
                    ("leader_election", "kind"),
                    "kubernetes needs runtime.kind kubernetes (the Lease lives in the "
                    "runtime's namespace and is reached with its credentials); with local "
                    "workers use store, on a PostgreSQL store",
                )
            ]
        name = self.janitor_lease_name()
        derived = " (derived from fleet; set leader_election.lease_name)"
        suffix = "" if self.leader_election.lease_name else derived
        if kind == "kubernetes" and name is not None and not _is_dns_subdomain(name):
            return [
                (
                    ("leader_election", "lease_name"),
                    f"{name!r} is not {_DNS_SUBDOMAIN_RULE}{suffix}",
                )
            ]
        return []

    # -- derived values ---------------------------------------------------------------------

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


#: Keys that accept a string shorthand for a mapping: the key the string stands for.
_SHORTHANDS: dict[tuple[str, ...], str] = {("leader_election",): "kind"}


def _set_path(data: dict[str, Any], path: tuple[str, ...], value: Any, name: str) -> None:
    target: Any = data
    for i, key in enumerate(path[:-1]):
        nxt = path[i + 1]
        shorthand = _SHORTHANDS.get(path[: i + 1])
        if shorthand and isinstance(target, dict) and isinstance(target.get(key), str):
            # `leader_election: store` in the file, STOKER_LEADER_ELECTION__LEASE_NAME set.
            target[key] = {shorthand: target[key]}
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
        ctx = error.get("ctx") or {}
        cause = ctx.get("error")
        if isinstance(cause, ConfigProblems):
            # Cross-section problems: one line each, under the key each one names.
            for loc, problem in cause.problems:
                at = _redact((*error["loc"], *loc))
                source = _env_source(at, env_keys)
                suffix = f" (from {source})" if source else ""
                lines.append(f"config error: {_dotted(at) or '(top level)'}: {problem}{suffix}")
            continue
        loc = _redact(tuple(error["loc"]))
        key = _dotted(loc) or "(top level)"
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
    """Never print a token: a key under `org_tokens` is one. Drop pydantic's union tag
    (`runtime.kubernetes.qps` is the key `runtime.qps`)."""
    out: list[Any] = []
    for i, part in enumerate(loc):
        if i > 0 and loc[i - 1] == "org_tokens" and isinstance(part, str):
            out.append("<token>")
        elif part == "[key]" or (i == 1 and loc[0] == "runtime" and part in RUNTIME_KINDS):
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
        template: RuntimeTemplate
        if p.pod is not None:
            template = p.pod.to_template()
        elif p.command is not None:
            template = ProcessTemplate(
                argv=tuple(p.command), env=dict(p.env), cwd=p.cwd, memory_mb=p.memory_mb
            )
        else:
            # Only a config built without validation (model_construct) gets here.
            raise ConfigError(f"config error: pools[{i}]: needs a command or a pod")
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
                    headroom_nodes=p.headroom_nodes,
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
    return DomainConfig(pools=pools, orgs=orgs, settings=plane_settings(config))


def plane_settings(config: StokerConfig) -> PlaneSettings:
    """`intervals` as `PlaneSettings`, with the spawn budget sized to the runtime's API budget.

    On Kubernetes every spawn is a request against the client's qps/burst budget: the spawn
    bucket is that budget, or an explicitly configured `intervals.spawn_rate`/`spawn_burst`
    when it is smaller (a larger one would only queue spawns inside the client).
    """
    settings = PlaneSettings(**config.intervals.model_dump())
    runtime = config.runtime
    if not isinstance(runtime, KubernetesRuntimeConfig):
        return settings
    explicit = config.intervals.model_fields_set
    rate = min(settings.spawn_rate, runtime.qps) if "spawn_rate" in explicit else runtime.qps
    burst = min(settings.spawn_burst, runtime.burst) if "spawn_burst" in explicit else runtime.burst
    return dataclasses.replace(settings, spawn_rate=rate, spawn_burst=burst)
