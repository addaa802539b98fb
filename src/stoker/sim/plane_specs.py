"""The scenario in the domain's terms, the same under every policy: its pool as stoker's
`PoolSpec`, its tenants' overrides as `OrgSpec`s, the replicas' `PlaneSettings`, and the
caps and floors in force that the invariant checker holds the replicas to (`Limits`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from stoker.domain.specs import (
    Activation,
    DemandSpec,
    OrgSpec,
    PlaneSettings,
    PodTemplate,
    PoolSpec,
    Timeouts,
)
from stoker.sim.baselines import derived_cap
from stoker.sim.scenario import WORKER_PRIORITY_CLASS, PoolConfig, Scenario


def pool_spec(scenario: Scenario) -> PoolSpec:
    """The scenario's pool as stoker's `PoolSpec` (a pod template on the simulated cluster);
    `stoker-reactive` runs it with the learned forecast off."""
    pool = scenario.pool
    reactive = any(entry.policy == "stoker-reactive" for entry in scenario.policies)
    return PoolSpec(
        name=pool.name,
        template=PodTemplate(
            image=pool.image,
            cpu=pool.cpu,
            memory=pool.memory,
            node_selector=dict(pool.node_selector),
            tolerations=tuple(dict(t) for t in pool.tolerations),
            priority_class=WORKER_PRIORITY_CLASS,
        ),
        warm_target=pool.warm_target,
        max_workers=pool.max_workers,
        max_workers_per_org=pool.max_workers_per_org,
        hot_idle_ttl=pool.hot_idle_ttl_s,
        max_ttl=pool.max_ttl_s,
        min_hot_idle=pool.min_hot_idle,
        reuse=pool.reuse,
        activation=Activation.HTTP,
        scale_down_delay=pool.scale_down_delay_s,
        lease_s=pool.lease_s,
        claim_timeout_s=pool.claim_timeout_s,
        timeouts=Timeouts(
            spawn_s=pool.spawn_timeout_s,
            reserve_s=pool.reserve_timeout_s,
            activation_s=pool.activation_timeout_s,
            drain_s=pool.drain_timeout_s,
            stop_grace_s=pool.stop_grace_s,
        ),
        headroom_nodes=pool.headroom_nodes,
        demand=_demand(pool, reactive=reactive),
    )


def _demand(pool: PoolConfig, *, reactive: bool) -> DemandSpec:
    spec = DemandSpec(forecast=not reactive, org_forecast=pool.org_forecast, headroom=pool.headroom)
    if pool.demand_quantile is not None:
        spec = dataclasses.replace(spec, quantile=pool.demand_quantile)
    return spec


def org_specs(scenario: Scenario) -> list[OrgSpec]:
    """Per-org overrides of the tenants that set any."""
    specs = []
    for group in scenario.tenants:
        if (
            group.max_workers is None
            and group.hot_idle_ttl_s is None
            and group.min_hot_idle is None
        ):
            continue
        for org in group.org_names():
            specs.append(
                OrgSpec(
                    name=org,
                    hot_idle_ttl=group.hot_idle_ttl_s,
                    min_hot_idle=group.min_hot_idle,
                    max_workers=group.max_workers,
                )
            )
    return specs


def plane_settings(scenario: Scenario) -> PlaneSettings:
    """The replicas' intervals and budgets, from the scenario (realistic, not test, values)."""
    cp = scenario.control_plane
    return PlaneSettings(
        janitor_interval_s=cp.janitor_interval_s,
        reaper_interval_s=cp.reaper_interval_s,
        instance_heartbeat_s=cp.instance_heartbeat_s,
        instance_expiry_s=cp.instance_expiry_s,
        stranded_grace_s=cp.stranded_grace_s,
        spawn_rate=cp.spawn_rate,
        spawn_burst=cp.spawn_burst,
    )


@dataclass(frozen=True, slots=True)
class Limits:
    """The caps and hot_idle floors in force in the scenario's one pool under its policy:
    an org's own, else the pool's; the pool's cap is its `max_workers`, else the policy's
    derived cap (0 = unbounded)."""

    pool: PoolSpec
    orgs: Mapping[str, OrgSpec]
    derived_cap: int

    @classmethod
    def of(cls, scenario: Scenario, pool: PoolSpec) -> Limits:
        """The limits of `scenario`'s view of one policy, whose pool is `pool`."""
        orgs = {spec.name: spec for spec in org_specs(scenario)}
        return cls(pool, orgs, derived_cap(scenario.policies[0], scenario))

    def pool_cap(self, _pool: str) -> int:
        """The pool's cap."""
        return self.pool.max_workers if self.pool.max_workers > 0 else self.derived_cap

    def org_cap(self, _pool: str, org: str) -> int:
        """The org's cap in the pool."""
        spec = self.orgs.get(org)
        if spec is not None and spec.max_workers is not None:
            return spec.max_workers
        return self.pool.max_workers_per_org

    def floor(self, _pool: str, org: str) -> int:
        """The org's hot_idle floor in the pool."""
        spec = self.orgs.get(org)
        if spec is not None and spec.min_hot_idle is not None:
            return spec.min_hot_idle
        return self.pool.min_hot_idle
