"""Pool and org specifications: what a platform engineer configures (docs/guides/local.md).

Each setting is declared here once: its type, its default, its bounds (`annotated_types`
metadata, which the configuration's validation enforces) and its doc comment.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le, MaxLen, MinLen

from stoker.domain.errors import ConfigError
from stoker.domain.states import Reuse

#: TTL of a hot_idle worker when neither the claim, the org nor the pool sets one.
DEFAULT_HOT_IDLE_TTL_S = 60.0
#: The janitor's lease in the store when the configuration names none.
JANITOR_LEASE = "janitor"

#: The longest duration a setting may take: a year.
_YEAR_S = 365 * 86400
#: A duration in seconds, 0 allowed.
Seconds = Annotated[float, Ge(0), Le(_YEAR_S)]
#: A duration in seconds that must pass before anything happens: more than 0.
PositiveSeconds = Annotated[float, Gt(0), Le(_YEAR_S)]


class Activation(StrEnum):
    """Whether workers of a pool implement the protocol of docs/worker-protocol.md."""

    HTTP = "http"
    NONE = "none"


#: The most memory a worker may be said to use: 1 TiB.
MEMORY_MB_MAX = 1_048_576


@dataclass(frozen=True, slots=True)
class ProcessTemplate:
    """A local worker process: its command line (`command` in the config, the API, the CLI
    and the SDK) with `{port}` and `{worker_id}` placeholders, never run through a shell."""

    argv: tuple[str, ...]
    #: Environment of the process, added to the server's.
    env: Mapping[str, str] = field(default_factory=dict)
    #: Working directory of the process; None: the server's.
    cwd: str | None = None
    #: Memory one worker is expected to use; the local cap is budget / this when max_workers is 0.
    memory_mb: Annotated[int, Ge(1), Le(MEMORY_MB_MAX)] = 64


@dataclass(frozen=True, slots=True)
class PodTemplate:
    """A Kubernetes worker pod; requests equal limits so workers are never BestEffort."""

    #: The worker container's image.
    image: Annotated[str, MinLen(1)]
    #: Replaces the image's entrypoint; empty keeps it.
    command: tuple[str, ...] = ()
    #: Arguments of the command (or of the image's entrypoint).
    args: tuple[str, ...] = ()
    #: Environment of the worker container.
    env: Mapping[str, str] = field(default_factory=dict)
    #: Requests and limits of the worker container: the Guaranteed QoS class.
    cpu: str = "1"
    #: Memory of the worker container (requests = limits), a Kubernetes quantity.
    memory: str = "1Gi"
    #: The port the worker listens on (`{port}` in command, args and env).
    port: Annotated[int, Ge(1), Le(65535)] = 8080
    #: Labels a node must have to run a worker.
    node_selector: Mapping[str, str] = field(default_factory=dict)
    #: Taints of nodes the workers tolerate.
    tolerations: tuple[Mapping[str, Any], ...] = ()
    #: PriorityClass of the worker pods; null: the cluster's default.
    priority_class: str | None = None
    #: ServiceAccount the worker pods run as; null: the namespace's default.
    service_account: str | None = None
    #: Labels added to the worker pods (stoker's own are set by stoker).
    labels: Mapping[str, str] = field(default_factory=dict)
    #: Annotations added to the worker pods.
    annotations: Mapping[str, str] = field(default_factory=dict)


RuntimeTemplate = ProcessTemplate | PodTemplate


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long each in-flight state may last before the stuck sweep retires it (I4)."""

    #: How long a worker may take from spawn to ready.
    spawn_s: PositiveSeconds = 120.0
    #: Kubernetes: how long a spawning pod may wait on the cluster (no node fits it yet,
    #: a node is on its way, its image is being pulled) before the stuck sweep retires it,
    #: instead of `spawn_s`; `spawn_s` counts again from its container's start.
    pending_s: PositiveSeconds = 600.0
    #: How long a worker may stay reserved for a claim before activation starts.
    reserve_s: PositiveSeconds = 30.0
    #: How long an activation may take.
    activation_s: PositiveSeconds = 30.0
    #: How long a draining worker may take to stop before it is retired anyway.
    drain_s: PositiveSeconds = 120.0
    #: Grace between SIGTERM (or pod delete) and SIGKILL.
    stop_grace_s: Seconds = 10.0


@dataclass(frozen=True, slots=True)
class SpawnBackoff:
    """How a pool backs off while its spawns fail (a crash loop), per revision: after the
    n-th failure in a row no spawn starts for `min(max_s, initial_s * factor ** (n - 1))`
    seconds, then one spawn probes; the first worker that gets ready resets it."""

    #: The pause after the first failed spawn.
    initial_s: PositiveSeconds = 1.0
    #: The longest pause between probes.
    max_s: PositiveSeconds = 60.0
    #: How much longer each pause is than the one before.
    factor: Annotated[float, Ge(1), Le(10)] = 2.0


#: The most a price may say (per hour).
_PRICE_MAX = 1_000_000.0
Price = Annotated[float, Ge(0), Le(_PRICE_MAX)]


@dataclass(frozen=True, slots=True)
class CostSpec:
    """What a pool's workers cost (docs/warmth.md): either per cpu-hour and GiB-hour of the
    template's resources, or a flat price per worker-hour. Currency is the operator's."""

    #: Price of one cpu-hour of the template's resources (with `per_gib_hour`).
    per_cpu_hour: Price | None = None
    #: Price of one GiB-hour of the template's memory (with `per_cpu_hour`).
    per_gib_hour: Price | None = None
    #: A flat price per worker-hour, instead of the two above.
    per_worker_hour: Price | None = None

    def __post_init__(self) -> None:
        by_resources = self.per_cpu_hour is not None or self.per_gib_hour is not None
        if by_resources and self.per_worker_hour is not None:
            raise ValueError("cost takes per_cpu_hour/per_gib_hour or per_worker_hour, not both")
        if not by_resources and self.per_worker_hour is None:
            raise ValueError("cost needs per_cpu_hour and per_gib_hour, or per_worker_hour")
        for name in ("per_cpu_hour", "per_gib_hour", "per_worker_hour"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(f"cost.{name} must be a finite price >= 0")

    def of(self, worker_s: float, cpu_s: float, gib_s: float) -> float:
        """The price of `worker_s` worker-seconds holding `cpu_s` cpu-seconds and `gib_s`
        GiB-seconds."""
        if self.per_worker_hour is not None:
            return worker_s / 3600.0 * self.per_worker_hour
        cpu = (self.per_cpu_hour or 0.0) * cpu_s
        return (cpu + (self.per_gib_hour or 0.0) * gib_s) / 3600.0


@dataclass(frozen=True, slots=True)
class DemandSpec:
    """How a pool reads its demand as a rate and sizes its warm pool and node headroom from
    it (docs/scaling.md justifies the defaults)."""

    #: Claims counted over this window make the stable rate; None: the deprecated
    #: `intervals.demand_window_s` when the config sets it, else 300 s.
    stable_window_s: PositiveSeconds | None = None
    #: The short window whose rate wins while it is at least `panic_ratio` x the stable one.
    panic_window_s: PositiveSeconds = 30.0
    #: How many times the stable rate the panic window's rate must reach to win.
    panic_ratio: Annotated[float, Ge(1), Le(100)] = 2.0
    #: Share of replacement times whose claims the warm pool covers (Poisson quantile).
    quantile: Annotated[float, Ge(0.5), Le(0.9999)] = 0.999
    #: Spawn-to-ready time assumed until the runtime has reported one.
    ready_seed_s: PositiveSeconds = 10.0
    #: Learn the new-session rate by hour of the week and size ahead of it.
    forecast: bool = True
    #: The forecast is set aside while the claims of the last `error_window_s` are off
    #: from it by more than this share (and by more than Poisson noise).
    forecast_error_bound: Annotated[float, Gt(0), Le(100)] = 0.5
    #: The window over which the forecast's error is measured.
    error_window_s: PositiveSeconds = 900.0
    #: Learn the new-session rate of each of the pool's busiest orgs (docs/scaling.md): at
    #: a full pool, a parked worker whose org is unlikely to claim again before its TTL
    #: runs out makes room for the warm pool.
    org_forecast: bool = True
    #: Orgs whose rate is learned, at most (48 stored rows each); the busiest are kept.
    org_forecast_orgs: Annotated[int, Ge(1), Le(10_000)] = 64
    #: After a claim missed the warm pool (went cold or queued), for this long the warm
    #: target is the largest of the reactive rate's and the forecast's upper quantile's;
    #: otherwise a forecast in use leads with its mean (docs/scaling.md).
    miss_hold_s: Seconds = 1800.0
    #: Kubernetes: how far ahead node headroom looks (a new node's launch and join time).
    node_lead_s: Seconds = 300.0
    #: Kubernetes: headroom falls only once it has been lower this long, so a spare node is
    #: not launched and consolidated away again within minutes, nor flapped pass by pass.
    headroom_hold_s: Seconds = 1800.0
    #: Kubernetes: `paying` keeps headroom placeholders only while they avoid cold starts
    #: (the forecast's growth beyond the warm pool, or claims gone cold within the hold);
    #: `constant` keeps the pool's `headroom_nodes` at all times.
    headroom: Literal["paying", "constant"] = "paying"

    def stable_s(self, fallback: float | None) -> float:
        """The stable window in force: this pool's, else the deprecated setting, else 300 s."""
        if self.stable_window_s is not None:
            return self.stable_window_s
        return fallback if fallback is not None else DEFAULT_STABLE_WINDOW_S


#: The stable window of a pool that sets none (Knative's stable window is 60 s; a claim
#: rate is lower than a request rate, so a longer window keeps its noise down).
DEFAULT_STABLE_WINDOW_S = 300.0


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A named kind of worker with its targets, caps, TTLs and reuse policy."""

    name: str
    template: RuntimeTemplate
    revision: str = ""
    #: Kubernetes only: the most placeholder pods kept to hold spare nodes; the leader keeps
    #: them only while they avoid cold starts (docs/scaling.md, "Node headroom").
    headroom_nodes: Annotated[int, Ge(0), Le(1000)] = 0
    #: Warm workers kept ready for claims, on top of the demand.
    warm_target: Annotated[int, Ge(0), Le(100_000)] = 0
    #: 0 means unbounded (cluster modes) or derived from runtime.memory_budget_mb /
    #: memory_mb (local mode).
    max_workers: Annotated[int, Ge(0), Le(1_000_000)] = 0
    #: 0 means no per-org cap.
    max_workers_per_org: Annotated[int, Ge(0), Le(1_000_000)] = 0
    #: TTL of a hot_idle worker when the claim and the org set none; None: 60 s.
    hot_idle_ttl: Seconds | None = None
    #: Upper clamp for any TTL a claim or org asks for; 0 means no clamp.
    max_ttl: Seconds = 0.0
    #: hot_idle workers an org keeps past their TTL.
    min_hot_idle: Annotated[int, Ge(0), Le(100_000)] = 0
    #: On release, `same_org` parks the worker as hot_idle for its org's next session;
    #: `never` retires it.
    reuse: Reuse = Reuse.SAME_ORG
    #: `http`: workers implement the activation protocol (docs/worker-protocol.md); `none`:
    #: they do not, and get no session token.
    activation: Activation = Activation.HTTP
    #: How long warm workers stay above target before the excess is retired.
    scale_down_delay: Seconds = 60.0
    #: A claim's lease when the claim asks for none; a lease not renewed expires. At least
    #: a second, as a claim's own `lease_s` must be.
    lease_s: Annotated[float, Ge(1), Le(86400)] = 60.0
    #: How long a claim waits for a worker when it sets no timeout_s.
    claim_timeout_s: Annotated[float, Ge(0), Le(3600)] = 30.0
    #: The longest a session may last from its bind, renewals included: its lease never
    #: runs past it, a renewal past it gets 409 and the claim ends. 0 means no limit.
    max_claim_s: Seconds = 0.0
    timeouts: Timeouts = field(default_factory=Timeouts)
    spawn_backoff: SpawnBackoff = field(default_factory=SpawnBackoff)
    #: Demand as a rate, the forecast and node headroom (docs/scaling.md).
    demand: DemandSpec = field(default_factory=DemandSpec)
    #: What the pool's workers cost, so the ledger reads in money (docs/warmth.md).
    cost: CostSpec | None = None

    def __post_init__(self) -> None:
        if not self.revision:
            object.__setattr__(self, "revision", revision_of(self.template))
        for name in ("warm_target", "max_workers", "max_workers_per_org", "min_hot_idle"):
            if getattr(self, name) < 0:
                raise ConfigError(f"pool {self.name!r}: {name} must be >= 0")
        if self.max_workers and self.warm_target > self.max_workers:
            raise ConfigError(
                f"pool {self.name!r}: warm_target ({self.warm_target}) exceeds "
                f"max_workers ({self.max_workers})"
            )
        if self.lease_s < 1 or self.claim_timeout_s < 0 or self.scale_down_delay < 0:
            raise ConfigError(f"pool {self.name!r}: lease_s must be >= 1, timeouts >= 0")


@dataclass(frozen=True, slots=True)
class OrgSpec:
    """Per-org overrides; `None` falls back to the pool's value."""

    #: The org's name, as claims give it.
    name: Annotated[str, MinLen(1), MaxLen(128)]
    #: The org's own TTL of a hot_idle worker.
    hot_idle_ttl: Seconds | None = None
    #: hot_idle workers the org keeps past their TTL.
    min_hot_idle: Annotated[int, Ge(0)] | None = None
    #: Live workers the org may hold in each pool at most (0: no cap).
    max_workers: Annotated[int, Ge(0)] | None = None
    #: The org's own `max_claim_s` (0: no limit for this org).
    max_claim_s: Seconds | None = None

    def overrides(self) -> dict[str, int | float]:
        """The settings this org sets itself, by name (the others are the pool's)."""
        return {
            f.name: value
            for f in fields(self)
            if f.name != "name" and (value := getattr(self, f.name)) is not None
        }


def revision_of(template: RuntimeTemplate) -> str:
    """A short stable hash of a runtime template: a new template is a new revision."""
    body = json.dumps(asdict(template), sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:10]


@dataclass(frozen=True, slots=True)
class PlaneSettings:
    """Intervals and budgets of one control-plane replica."""

    #: Janitor pass: reconcile, reap, sweep (duckgres: 5 s).
    janitor_interval_s: PositiveSeconds = 2.0
    #: Every replica's own fallback reaper (duckgres: 60 s).
    reaper_interval_s: PositiveSeconds = 10.0
    #: How often a replica stamps its row as alive.
    instance_heartbeat_s: PositiveSeconds = 5.0
    #: A replica whose heartbeat is older than this is expired (duckgres: 20 s).
    instance_expiry_s: PositiveSeconds = 20.0
    #: Runtime objects with no live row are stopped once older than this (duckgres: 2 min).
    stranded_grace_s: Seconds = 120.0
    #: How often the janitor lists runtime objects to find stranded ones.
    stranded_scan_s: PositiveSeconds = 60.0
    #: Retired workers and ended claims are deleted once this old.
    history_retention_s: Seconds = 86_400.0
    #: How often the janitor deletes old history.
    purge_interval_s: PositiveSeconds = 600.0
    #: The ledger and the claim log are kept this long (docs/warmth.md): 35 days.
    ledger_retention_s: Seconds = 35 * 86400.0
    #: Rows of the ledger and the claim log one purge deletes at most.
    ledger_purge_batch: Annotated[int, Ge(1), Le(1_000_000)] = 10_000
    #: Spawns per second and burst: the runtime's API budget (client-go: QPS 50, burst 100).
    spawn_rate: Annotated[float, Gt(0), Le(100_000)] = 50.0
    #: Spawns that may start at once above `spawn_rate` (the token bucket's size).
    spawn_burst: Annotated[int, Ge(1), Le(100_000)] = 100
    #: Deprecated: a pool's `demand.stable_window_s`. When set, the stable window of the
    #: pools that set none.
    demand_window_s: PositiveSeconds | None = None
    #: How long a shutdown waits for in-flight claims.
    shutdown_grace_s: Seconds = 30.0
    #: Retry-After hint on an org-cap rejection (duckgres: 45 s).
    org_cap_retry_after_s: Seconds = 45.0
    #: How often each replica samples its pools for the dashboard's chart (one hour kept).
    pool_sample_s: Annotated[float, Ge(1), Le(3600)] = 10.0
