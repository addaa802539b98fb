"""Prometheus metrics of one control plane (each plane has its own registry)."""

from __future__ import annotations

from typing import Any, TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry

CLAIM_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


_M = TypeVar("_M", bound="_Children")


class _Children:
    """`labels(...)` that asks prometheus_client once per label set.

    Every pass and claim looks its series up: prometheus_client converts and checks the
    values and takes a lock each time, which cost more than the update itself. stoker
    never removes a series, so a found child stays valid.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self: _M, *values: Any, **named: Any) -> _M:
        if named:
            return super().labels(*values, **named)  # type: ignore[misc, no-any-return]
        child: _M | None = self._children.get(values)
        if child is None:
            child = self._children[values] = super().labels(*values)  # type: ignore[misc]
        return child


class Gauge(_Children, prometheus_client.Gauge):
    """A gauge whose labelled children are looked up once."""


class Counter(_Children, prometheus_client.Counter):
    """A counter whose labelled children are looked up once."""


class Histogram(_Children, prometheus_client.Histogram):
    """A histogram whose labelled children are looked up once."""


class Metrics:
    """Every metric stoker exports; the README's metrics table documents each one."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.workers = Gauge(
            "stoker_workers", "Live workers by pool and state.", ["pool", "state"], registry=r
        )
        self.warm_desired = Gauge(
            "stoker_warm_desired",
            "Warm workers the pool wants (target + demand).",
            ["pool"],
            registry=r,
        )
        self.demand = Gauge(
            "stoker_demand",
            "Demand seen by the last reconcile pass (misses + queued claims).",
            ["pool"],
            registry=r,
        )
        self.claims = Counter(
            "stoker_claims",
            "Claims by pool, source and outcome.",
            ["pool", "source", "outcome"],
            registry=r,
        )
        self.claim_seconds = Histogram(
            "stoker_claim_duration_seconds",
            "Time from claim request to bound worker.",
            ["pool", "source"],
            buckets=CLAIM_BUCKETS,
            registry=r,
        )
        self.claims_waiting = Gauge(
            "stoker_claims_waiting", "Claims waiting for a worker.", ["pool"], registry=r
        )
        self.misses = Counter(
            "stoker_misses",
            "Claims that found no warm or reusable worker, by reason.",
            ["pool", "reason"],
            registry=r,
        )
        self.spawns = Counter(
            "stoker_spawns",
            "Workers spawned, by pool and purpose (warm or cold).",
            ["pool", "purpose"],
            registry=r,
        )
        self.spawn_failures = Counter(
            "stoker_spawn_failures",
            "Spawns that failed, by reason.",
            ["pool", "reason"],
            registry=r,
        )
        self.retirements = Counter(
            "stoker_retirements", "Workers retired, by reason.", ["pool", "reason"], registry=r
        )
        self.transitions = Counter(
            "stoker_transitions",
            "Worker state changes written, by target state.",
            ["pool", "to"],
            registry=r,
        )
        self.fence_misses = Counter(
            "stoker_fence_misses",
            "Compare-and-set writes that found the row changed.",
            ["operation"],
            registry=r,
        )
        self.persist_failures = Counter(
            "stoker_persist_failures",
            "Durable writes that failed (the old state was kept).",
            ["transition"],
            registry=r,
        )
        self.activation_seconds = Histogram(
            "stoker_activation_duration_seconds",
            "Time to activate a worker.",
            ["pool"],
            buckets=CLAIM_BUCKETS,
            registry=r,
        )
        self.pass_seconds = Histogram(
            "stoker_pass_duration_seconds",
            "Duration of reconcile passes.",
            ["pass"],
            buckets=CLAIM_BUCKETS,
            registry=r,
        )
        self.pass_failures = Counter(
            "stoker_pass_failures", "Reconcile passes that failed.", ["pass"], registry=r
        )
        self.is_leader = Gauge(
            "stoker_janitor_is_leader",
            "1 while this replica runs the fleet-wide janitor.",
            registry=r,
        )
        self.reaper_last_success = Gauge(
            "stoker_reaper_last_success_timestamp_seconds",
            "When this replica's reaper last completed a pass (stale = reaping is stuck).",
            registry=r,
        )
        self.janitor_last_success = Gauge(
            "stoker_janitor_last_success_timestamp_seconds",
            "When the janitor last completed a pass on this replica.",
            registry=r,
        )
        self.pool_cap = Gauge(
            "stoker_pool_cap", "Pool cap in force (0 = unbounded).", ["pool"], registry=r
        )
