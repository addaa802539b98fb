"""Pool and org specifications: what a platform engineer configures (DESIGN.md §2, §6)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from stoker.domain.errors import ConfigError
from stoker.domain.states import Reuse

#: TTL of a hot_idle worker when neither the claim, the org nor the pool sets one.
DEFAULT_HOT_IDLE_TTL_S = 60.0
#: The janitor's lease in the store when the configuration names none.
JANITOR_LEASE = "janitor"


class Activation(StrEnum):
    """Whether workers of a pool implement the activation protocol of DESIGN.md §7."""

    HTTP = "http"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class ProcessTemplate:
    """A local worker process: argv with `{port}` and `{worker_id}` placeholders, never a shell."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    #: Memory one worker is expected to use; the local cap is budget / this when max_workers is 0.
    memory_mb: int = 64


@dataclass(frozen=True, slots=True)
class PodTemplate:
    """A Kubernetes worker pod; requests equal limits so workers are never BestEffort."""

    image: str
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cpu: str = "1"
    memory: str = "1Gi"
    port: int = 8080
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    priority_class: str | None = None
    service_account: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)


RuntimeTemplate = ProcessTemplate | PodTemplate


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long each in-flight state may last before the stuck sweep retires it (I4)."""

    spawn_s: float = 120.0
    reserve_s: float = 30.0
    activation_s: float = 30.0
    drain_s: float = 120.0
    #: Grace between SIGTERM (or pod delete) and SIGKILL.
    stop_grace_s: float = 10.0


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A named kind of worker with its targets, caps, TTLs and reuse policy."""

    name: str
    template: RuntimeTemplate
    revision: str = ""
    warm_target: int = 0
    #: 0 means unbounded (cluster modes) or derived from a memory budget (local mode).
    max_workers: int = 0
    #: 0 means no per-org cap.
    max_workers_per_org: int = 0
    hot_idle_ttl: float | None = None
    #: Upper clamp for any TTL a claim or org asks for; 0 means no clamp.
    max_ttl: float = 0.0
    min_hot_idle: int = 0
    reuse: Reuse = Reuse.SAME_ORG
    activation: Activation = Activation.HTTP
    scale_down_delay: float = 60.0
    lease_s: float = 60.0
    claim_timeout_s: float = 30.0
    timeouts: Timeouts = field(default_factory=Timeouts)
    #: Kubernetes only: constant number of placeholder pods that keep spare nodes.
    headroom_nodes: int = 0

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
        if self.lease_s <= 0 or self.claim_timeout_s < 0 or self.scale_down_delay < 0:
            raise ConfigError(f"pool {self.name!r}: lease_s must be > 0, timeouts >= 0")


@dataclass(frozen=True, slots=True)
class OrgSpec:
    """Per-org overrides; `None` falls back to the pool's value."""

    name: str
    hot_idle_ttl: float | None = None
    min_hot_idle: int | None = None
    max_workers: int | None = None


def revision_of(template: RuntimeTemplate) -> str:
    """A short stable hash of a runtime template: a new template is a new revision."""
    body = json.dumps(asdict(template), sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:10]


@dataclass(frozen=True, slots=True)
class PlaneSettings:
    """Intervals and budgets of one control-plane replica."""

    #: Janitor pass: reconcile, reap, sweep (duckgres: 5 s).
    janitor_interval_s: float = 2.0
    #: Every replica's own fallback reaper (duckgres: 60 s).
    reaper_interval_s: float = 10.0
    instance_heartbeat_s: float = 5.0
    #: A replica whose heartbeat is older than this is expired (duckgres: 20 s).
    instance_expiry_s: float = 20.0
    #: Runtime objects with no live row are stopped once older than this (duckgres: 2 min).
    stranded_grace_s: float = 120.0
    #: How often the janitor lists runtime objects to find stranded ones.
    stranded_scan_s: float = 60.0
    #: Retired workers and ended claims are deleted once this old.
    history_retention_s: float = 86_400.0
    #: How often the janitor deletes old history.
    purge_interval_s: float = 600.0
    #: Spawns per second and burst: the runtime's API budget (client-go: QPS 50, burst 100).
    spawn_rate: float = 50.0
    spawn_burst: int = 100
    #: Misses older than this no longer count as demand.
    demand_window_s: float = 60.0
    #: How long a shutdown waits for in-flight claims.
    shutdown_grace_s: float = 30.0
    #: Retry-After hint on an org-cap rejection (duckgres: 45 s).
    org_cap_retry_after_s: float = 45.0
