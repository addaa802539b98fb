"""The sections of the config that have no domain twin: the store's options, the runtime,
leader election and the HTTP API."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, field_validator, model_validator

from stoker.config.names import DnsLabel, DnsSubdomain, OrgName, Quantity, Token
from stoker.config.problems import Problem, raise_problems
from stoker.config.schema import Section
from stoker.domain.specs import PositiveSeconds


class PostgresOptions(Section):
    """Options of the PostgreSQL store (ignored by SQLite)."""

    #: SQL schema holding stoker's tables (a plain identifier).
    db_schema: str = Field(
        "stoker", alias="schema", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=63
    )
    #: Connections each replica's pool keeps open to PostgreSQL.
    min_pool_size: int = Field(1, ge=0, le=1000)
    #: Connections each replica's pool opens to PostgreSQL at most.
    max_pool_size: int = Field(10, ge=1, le=1000)
    #: Statements executed this often get prepared server-side; null disables preparing.
    prepare_threshold: int | None = Field(5, ge=0)
    #: Wait for each commit to reach the disk (PostgreSQL's `synchronous_commit`). Off, a
    #: crash of the database server may lose the last fraction of a second of commits (never
    #: corrupts anything): about the durability of the SQLite store's default, and a claim
    #: burst binds several times faster.
    synchronous_commit: bool = True

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True)

    @model_validator(mode="after")
    def _sizes(self) -> PostgresOptions:
        if self.min_pool_size > self.max_pool_size:
            raise ValueError("min_pool_size must not exceed max_pool_size")
        return self


class LocalRuntimeConfig(Section):
    """Workers run as processes on this machine."""

    #: `local`: workers are processes of this machine (the default).
    kind: Literal["local"] = "local"
    #: Memory the workers may use together; a pool with max_workers 0 is capped at
    #: budget / memory_mb. Null: half of this machine's memory.
    memory_budget_mb: int | None = Field(None, ge=1)
    #: Directory for one log file per worker (`<worker id>.log`); null discards worker
    #: output. The logs of ended workers are deleted by `log_keep` and `log_keep_s`.
    log_dir: str | None = None
    #: The logs of this many ended workers are kept in `log_dir`, the most recently ended,
    #: and as many again of workers that failed to start (so that ended sessions never
    #: push out the log a pool's `last_spawn_error` names). Null: no bound by number.
    log_keep: int | None = Field(100, ge=1, le=1_000_000)
    #: An ended worker's log is deleted this long after the worker ended (checked every
    #: minute; a file of an earlier run counts from when it was last written). Null: no
    #: bound by age. A live worker's log is never deleted.
    log_keep_s: PositiveSeconds | None = Field(7 * 86400.0, ge=60)
    #: Workers starting at once at most (fork until ready); more wait in a queue, cold
    #: spawns first, their spawn timeout not yet running. Null: one per core.
    start_limit: int | None = Field(None, ge=1, le=10_000)
    #: A starting worker runs this much nicer than the control plane (0: as nice), so
    #: start-ups cannot starve the API; it gets its priority back once ready where
    #: RLIMIT_NICE allows, else keeps it.
    start_nice: int = Field(10, ge=0, le=19)


class PlaceholderSize(Section):
    """Requests (= limits) of one headroom placeholder pod."""

    #: CPU of one placeholder pod (a Kubernetes quantity: `500m`, `2`).
    cpu: Quantity
    #: Memory of one placeholder pod (a Kubernetes quantity: `512Mi`, `4Gi`).
    memory: Quantity


def _session_nodes(value: Any) -> Any:
    """`prefer_session_nodes` as the runtime takes it: true, false or `forecast` (one
    message for any other value, not one per kind of the union)."""
    if isinstance(value, bool) or value == "forecast":
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError("must be true, false or forecast")


#: When new worker pods prefer the nodes that hold the most sessions: always (true), never
#: (false), or while the pool's forecast says it may gather (`forecast`).
SessionNodes = Annotated[bool | Literal["forecast"], BeforeValidator(_session_nodes)]


class KubernetesRuntimeConfig(Section):
    """Workers run as pods; every pool needs a `pod` template."""

    #: `kubernetes`: workers are pods of a cluster.
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
    #: Requests the API client may send at once above `qps` (the token bucket's size).
    burst: int = Field(100, ge=1, le=100_000)
    #: The informer lists and diffs this often, to catch what a dropped watch missed.
    resync_s: PositiveSeconds = 300.0
    #: A pod create that the API server does not answer (connection errors, 5xx, 429) is
    #: retried until this long after its first attempt, then the spawn counts as failed
    #: and the pool backs off.
    create_deadline_s: PositiveSeconds = Field(5.0, le=600)
    #: PriorityClass of headroom placeholders; required when a pool has headroom_nodes.
    placeholder_priority_class: DnsSubdomain | None = None
    #: Image of the headroom placeholder pods (they only sleep).
    placeholder_image: str = Field("registry.k8s.io/pause:3.10", min_length=1)
    #: Null: each pool's placeholders are as large as its workers.
    placeholder_size: PlaceholderSize | None = None
    #: New worker pods prefer the nodes that hold the most sessions (preferred node
    #: affinity on `kubernetes.io/hostname`, which must be the node's name), so sessions
    #: gather and the node autoscaler can take the other nodes back: `true` always,
    #: `forecast` while the pool's forecast expects no growth beyond its warm pool within
    #: the node lead and no claim of it missed lately (`sizing.gather`), `false` never.
    #: Fewer nodes mean less spare room: with `true`, keep `headroom_nodes` for the
    #: spawns that then wait for a node.
    prefer_session_nodes: SessionNodes = "forecast"


RuntimeConfig = LocalRuntimeConfig | KubernetesRuntimeConfig
#: Runtime kinds this build can run, by the value of `runtime.kind`.
RUNTIME_KINDS: dict[str, type[RuntimeConfig]] = {
    "local": LocalRuntimeConfig,
    "kubernetes": KubernetesRuntimeConfig,
}

#: Values of `leader_election.kind`; `auto` resolves by the store (`elector_kind`).
ElectionKind = Literal["auto", "none", "store", "kubernetes"]


class LeaderElectionConfig(Section):
    """Who runs the fleet-wide janitor; the timings are client-go's defaults."""

    #: The elector: `store` (a lease row in the store), `kubernetes` (a Lease), `none` (this
    #: replica always runs the janitor) or `auto` (`store` on PostgreSQL, `none` on SQLite).
    kind: ElectionKind = "auto"
    #: Null: "janitor" (a row of the store) or "<fleet>-janitor" (a Kubernetes Lease).
    lease_name: str | None = Field(None, min_length=1, max_length=253)
    #: How long a leader's lease lasts without renewal before another replica may take it.
    lease_duration_s: PositiveSeconds = 15.0
    #: A leader that has not renewed for this long steps down.
    renew_deadline_s: PositiveSeconds = 10.0
    #: How often a replica tries to take or renew the lease.
    retry_period_s: PositiveSeconds = 2.0

    @model_validator(mode="after")
    def _timings(self) -> LeaderElectionConfig:
        # A leader steps down at the renew deadline, before its lease can expire for the
        # others, and retries often enough to renew more than once before that deadline.
        problems: list[Problem] = []
        if not self.lease_duration_s > self.renew_deadline_s:
            problems.append(
                (
                    ("lease_duration_s",),
                    f"must exceed renew_deadline_s ({self.renew_deadline_s:g})",
                    ("renew_deadline_s",),
                )
            )
        if not self.renew_deadline_s > 1.2 * self.retry_period_s:
            problems.append(
                (
                    ("renew_deadline_s",),
                    f"must exceed 1.2 x retry_period_s ({self.retry_period_s:g}), "
                    f"i.e. {1.2 * self.retry_period_s:g}",
                    ("retry_period_s",),
                )
            )
        raise_problems(problems)
        return self


class ApiConfig(Section):
    """The HTTP API: where it listens and who may call it."""

    #: Address the API listens on; a non-loopback address needs tokens.
    host: str = Field("127.0.0.1", min_length=1)
    #: 0 picks a free port (the server prints the one it got).
    port: int = Field(8080, ge=0, le=65535)
    #: Tokens that act for every org and may list workers.
    admin_tokens: list[Token] = Field(default_factory=list)
    #: Tokens that act for one org only: `{token: org}` or a list of `{org, token}`.
    org_tokens: dict[Token, OrgName] = Field(default_factory=dict)
    #: A file of admin tokens, one a line, read at start and again on SIGHUP or when it
    #: changes (rotation without a restart); added to `admin_tokens`.
    admin_tokens_file: str | None = Field(None, min_length=1)
    #: A file of org tokens, `<org> <token>` a line, read like `admin_tokens_file`.
    org_tokens_file: str | None = Field(None, min_length=1)
    #: Largest request body accepted; larger ones get 413.
    max_body_bytes: int = Field(65536, ge=1024, le=16 * 1024 * 1024)
    #: Largest request line plus headers accepted; larger ones get 431.
    max_header_bytes: int = Field(32768, ge=1024, le=1024 * 1024)
    #: A request's line and headers must arrive within this time of its first byte (or of
    #: the connection's opening); else 408 and the connection is closed.
    header_timeout_s: PositiveSeconds = 10.0
    #: A request's body must arrive within this time of its headers; else 408 and close.
    body_timeout_s: PositiveSeconds = 30.0
    #: An idle keep-alive connection is closed after this time.
    keep_alive_s: PositiveSeconds = 5.0
    #: Open connections at most; at the limit a new connection closes the longest-idle one
    #: that has no request in progress, or gets 503 when every one is serving a request.
    #: Lowered at start to what the open-files limit leaves room for.
    max_connections: int = Field(1024, ge=16, le=1_000_000)
    #: One log line per HTTP request (method, path, status, duration, org; never a token).
    access_log: bool = False

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
        return bool(
            self.admin_tokens or self.org_tokens or self.admin_tokens_file or self.org_tokens_file
        )
