"""Prometheus metrics of one control plane (each plane has its own registry)."""

from __future__ import annotations

from typing import Any, TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry

# Counters and histograms without a `_created` series each: a creation timestamp per label
# set doubles the series and tells an operator nothing the process start time does not.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

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


#: Series of rollouts: name and help.
_REVISION_FAILURES = (
    "stoker_revision_failures",
    "Spawn and activation failures by pool revision (kind: spawn or activation).",
)
_REVISION_SHARE = (
    "stoker_pool_revision_share",
    "Share (0-1) of the pool's new claims each revision gets by the rollout plan.",
)
_ROLLOUT_STATE = (
    "stoker_rollout_state",
    "1 for the state of the pool's rollout under way (or of the one this replica just "
    "ended), 0 for the others; all 0 without one.",
)

_M = TypeVar("_M", bound="_Children")


class _Children:
    """`labels(...)` that asks prometheus_client once per label set.

    Every pass and claim looks its series up: prometheus_client converts and checks the
    values and takes a lock each time, which cost more than the update itself. A found
    child stays valid until `remove` drops the series.
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

    def remove_where(self, label: str, value: str) -> None:
        """Drop every series whose `label` is `value` (nothing when it has no such label)."""
        names: tuple[str, ...] = self._labelnames  # type: ignore[attr-defined]
        if label not in names:
            return
        at = names.index(label)
        series: dict[tuple[str, ...], Any] = self._metrics  # type: ignore[attr-defined]
        for values in [v for v in list(series) if v[at] == value]:
            self._children.pop(values, None)
            super().remove(*values)  # type: ignore[misc]

    def remove(self, *values: Any) -> None:
        """Drop the series of `values` (nothing when there is none)."""
        if self._children.pop(values, None) is not None:
            super().remove(*values)  # type: ignore[misc]

    def clear(self) -> None:
        """Drop every series."""
        self._children.clear()
        super().clear()  # type: ignore[misc]


class Gauge(_Children, prometheus_client.Gauge):
    """A gauge whose labelled children are looked up once."""


class Counter(_Children, prometheus_client.Counter):
    """A counter whose labelled children are looked up once."""


class Histogram(_Children, prometheus_client.Histogram):
    """A histogram whose labelled children are looked up once."""


#: The gauges of a pool's sizing: name and help.
_SIZING_GAUGES = (
    (
        "stoker_pool_demand_rate",
        "Claims per second that wanted a neutral worker (stable or panic window).",
    ),
    (
        "stoker_pool_forecast_sessions",
        "New sessions the forecast expects over the next replacement time (upper quantile; "
        "0 without a forecast).",
    ),
    (
        "stoker_pool_forecast_error",
        "Claims seen against the forecast over the error window, relative (0: none).",
    ),
    (
        "stoker_pool_org_forecasts",
        "Orgs of the pool whose learned new-session rate is in use (enough history).",
    ),
)


class Metrics:
    """Every metric stoker exports; docs/reference/metrics is generated from them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.workers = self._gauge(
            "stoker_workers", "Live workers by pool and state.", "pool", "state"
        )
        self.warm_desired = self._gauge(
            "stoker_warm_desired", "Warm workers the pool wants (target + demand).", "pool"
        )
        self.demand = self._gauge(
            "stoker_demand",
            "Warm workers the last reconcile pass wanted beyond warm_target (the demand "
            "rate's or the forecast's, plus queued claims).",
            "pool",
        )
        # How the leader sized each pool (docs/scaling.md).
        self.demand_rate, self.forecast_sessions, self.forecast_error, self.org_forecasts = (
            self._gauge(name, about, "pool") for name, about in _SIZING_GAUGES
        )
        self.claims = self._counter(
            "stoker_claims", "Claims by pool, source and outcome.", "pool", "source", "outcome"
        )
        self.claim_seconds = self._histogram(
            "stoker_claim_duration_seconds",
            "Time from claim request to bound worker.",
            "pool",
            "source",
        )
        self.claims_waiting = self._gauge(
            "stoker_claims_waiting", "Claims waiting for a worker.", "pool"
        )
        self.misses = self._counter(
            "stoker_misses",
            "Claims that found no warm or reusable worker, by reason.",
            "pool",
            "reason",
        )
        self.spawns = self._counter(
            "stoker_spawns",
            "Workers spawned, by pool and purpose (warm or cold).",
            "pool",
            "purpose",
        )
        self.spawn_failures = self._counter(
            "stoker_spawn_failures", "Spawns that failed, by reason.", "pool", "reason"
        )
        self.spawn_failing = self._gauge(
            "stoker_spawn_failing",
            "Spawns of the pool's revision that failed since its spawns last worked (0: "
            "they work), as GET /v1/pools shows spawn_failing.",
            "pool",
        )
        self.pins_out_of_date = self._gauge(
            "stoker_pins_out_of_date",
            "This replica's busy workers (activating, hot, hot_idle) whose pod lacked its "
            "do-not-disrupt pin at the last janitor pass and could not be pinned.",
            "pool",
        )
        by_revision = ("pool", "revision")
        self.revision_failures = self._counter(*_REVISION_FAILURES, *by_revision, "kind")
        self.revision_share = self._gauge(*_REVISION_SHARE, *by_revision)
        self.rollout_state = self._gauge(*_ROLLOUT_STATE, "pool", "state")
        self.retirements = self._counter(
            "stoker_retirements", "Workers retired, by reason.", "pool", "reason"
        )
        self.transitions = self._counter(
            "stoker_transitions", "Worker state changes written, by target state.", "pool", "to"
        )
        self.fence_misses = self._counter(
            "stoker_fence_misses", "Compare-and-set writes that found the row changed.", "operation"
        )
        self.persist_failures = self._counter(
            "stoker_persist_failures",
            "Durable writes that failed (the old state was kept).",
            "transition",
        )
        self.activation_seconds = self._histogram(
            "stoker_activation_duration_seconds", "Time to activate a worker.", "pool"
        )
        self.pass_seconds = self._histogram(
            "stoker_pass_duration_seconds", "Duration of reconcile passes.", "pass"
        )
        self.pass_failures = self._counter(
            "stoker_pass_failures",
            "Reconcile passes that failed (pool empty), and passes whose step for one pool "
            "failed while the other pools went on (pool set, once per pass).",
            "pass",
            "pool",
        )
        self.is_leader = self._gauge(
            "stoker_janitor_is_leader", "1 while this replica runs the fleet-wide janitor."
        )
        self.reaper_last_success = self._gauge(
            "stoker_reaper_last_success_timestamp_seconds",
            "When this replica's reaper last completed a pass (stale = reaping is stuck).",
        )
        self.janitor_last_success = self._gauge(
            "stoker_janitor_last_success_timestamp_seconds",
            "When the janitor last completed a pass on this replica.",
        )
        self.api_refusals = self._counter(
            "stoker_api_refusals",
            "Requests and connections the API refused or closed early, by reason.",
            "reason",
        )
        self.pool_cap = self._gauge("stoker_pool_cap", "Pool cap in force (0 = unbounded).", "pool")
        # The ledger (docs/warmth.md): by pool only, never by org, so the series stay few.
        self.ledger_worker_seconds = self._counter(
            "stoker_ledger_worker_seconds",
            "Worker-seconds this replica counted in the ledger, by pool and state.",
            "pool",
            "state",
        )
        self.ledger_idle_cost = self._counter(
            "stoker_ledger_idle_cost",
            "Cost of idle worker time by the pool's prices (kind: warm, parked, headroom).",
            "pool",
            "kind",
        )
        self.ledger_cold_start_avoided = self._counter(
            "stoker_ledger_cold_start_seconds_avoided",
            "Seconds of cold start the claims served warm or by reuse did not wait (the "
            "pool's mean spawn-to-ready time this replica measured, per claim).",
            "pool",
        )

    def drop_leaders_gauges(self) -> None:
        """Drop the series only the janitor's leader sets (workers by state, each pool's
        sizing and cap, the rollouts' shares and states): a replica that led keeps them no
        longer than it leads, so that a rule's or a dashboard's max (or sum) over the
        replicas is the leader's figures, not an earlier leader's frozen ones."""
        for gauge in (
            self.workers,
            self.warm_desired,
            self.demand,
            self.demand_rate,
            self.forecast_sessions,
            self.forecast_error,
            self.org_forecasts,
            self.pool_cap,
            self.revision_share,
            self.rollout_state,
        ):
            gauge.clear()

    def drop_pool(self, pool: str) -> None:
        """Drop every series of `pool` (a pool deleted from the store): its gauges would
        otherwise stay at their last values, and its counters be exported for ever."""
        for metric in vars(self).values():
            if isinstance(metric, _Children):
                metric.remove_where("pool", pool)

    def _gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, *labels: str) -> Histogram:
        # Every stoker histogram times something between a millisecond and a minute.
        return Histogram(name, doc, labels, buckets=CLAIM_BUCKETS, registry=self.registry)
