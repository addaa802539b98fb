"""The catalog: the pools and orgs this replica serves, and the caps and TTLs they resolve to."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from stoker.domain.errors import NotFound
from stoker.domain.specs import OrgSpec, PoolSpec, RuntimeTemplate
from stoker.policy.reaping import resolve_ttl
from stoker.policy.rollout import Ramp
from stoker.policy.scaling import effective_cap


class Catalog:
    """Pool and org specs by name, and what they resolve to (org -> pool -> built-in)."""

    def __init__(
        self,
        pools: Mapping[str, PoolSpec],
        orgs: Mapping[str, OrgSpec],
        *,
        derived_cap: Callable[[PoolSpec], int],
    ) -> None:
        """`derived_cap` is the runtime's cap for a pool whose `max_workers` is 0."""
        self._pools = dict(pools)
        self._orgs = dict(orgs)
        self._derived_cap = derived_cap
        #: Each pool's newest rollout (active or ended) and the template of its revision.
        self._ramps: dict[str, tuple[Ramp, RuntimeTemplate]] = {}

    @property
    def pools(self) -> Mapping[str, PoolSpec]:
        """Every pool by name."""
        return self._pools

    def pool(self, name: str) -> PoolSpec:
        """The pool spec, or NotFound."""
        try:
            return self._pools[name]
        except KeyError:
            raise NotFound(f"unknown pool {name!r}") from None

    def get(self, name: str) -> PoolSpec | None:
        """The pool spec, if the pool is known."""
        return self._pools.get(name)

    def update_pool(self, spec: PoolSpec) -> None:
        """Serve `spec` from now on (a new revision of a pool is a rollout)."""
        self._pools[spec.name] = spec

    def set_ramp(self, name: str, ramp: Ramp | None, template: RuntimeTemplate | None) -> None:
        """Serve the pool's newest rollout `ramp`, whose revision has `template` (None: the
        pool has no rollout to follow)."""
        if ramp is None or template is None:
            self._ramps.pop(name, None)
        else:
            self._ramps[name] = (ramp, template)

    def ramp(self, name: str) -> Ramp | None:
        """The pool's newest rollout, active or ended, if it has one."""
        known = self._ramps.get(name)
        return known[0] if known else None

    def revision_spec(self, name: str, revision: str) -> PoolSpec | None:
        """The spec that spawns workers of `revision`: the pool's own at its stable
        revision, the rollout's at the newest one; None for any other."""
        pool = self._pools.get(name)
        if pool is not None and pool.revision == revision:
            return pool
        known = self._ramps.get(name)
        if known is None or known[0].revision != revision or pool is None:
            return None
        # The rollout's template with the pool's settings as they are now.
        return dataclasses.replace(pool, template=known[1], revision=revision)

    def pool_cap(self, pool: PoolSpec) -> int:
        """The pool cap in force (0 = unbounded)."""
        return effective_cap(pool.max_workers, self._derived_cap(pool))

    def org_cap(self, pool: PoolSpec, org: str) -> int:
        """The org's cap in the pool (0 = unbounded)."""
        spec = self._orgs.get(org)
        if spec is not None and spec.max_workers is not None:
            return spec.max_workers
        return pool.max_workers_per_org

    def max_claim_s(self, pool_name: str, org: str) -> float:
        """The longest a session of `org` in the pool may last (org -> pool; 0 = no limit)."""
        spec = self._orgs.get(org)
        if spec is not None and spec.max_claim_s is not None:
            return spec.max_claim_s
        pool = self._pools.get(pool_name)
        return pool.max_claim_s if pool else 0.0

    def min_hot_idle(self, pool_name: str, org: str) -> int:
        """The org's hot_idle floor in the pool (org -> pool)."""
        spec = self._orgs.get(org)
        if spec is not None and spec.min_hot_idle is not None:
            return spec.min_hot_idle
        pool = self._pools.get(pool_name)
        return pool.min_hot_idle if pool else 0

    def hot_idle_ttl(self, pool: PoolSpec, org: str, claim_ttl: float | None) -> float:
        """How long a worker of `org` stays parked: claim -> org -> pool, clamped by max_ttl."""
        org_spec = self._orgs.get(org)
        org_ttl = org_spec.hot_idle_ttl if org_spec else None
        return resolve_ttl(claim_ttl, org_ttl, pool.hot_idle_ttl, pool.max_ttl)
