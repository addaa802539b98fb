"""The catalog: the pools and orgs this replica serves, and the caps and TTLs they resolve to.

The pools come from the store (`stoker.control.stored_pools` loads them whenever their
generations change): each at its stable revision, with its active rollout and the templates
of its revisions. Until the first load it serves the pools the replica was built with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from stoker.domain.errors import NotFound
from stoker.domain.pools import Rollout, StoredPool, StoredRevision
from stoker.domain.specs import OrgSpec, PoolSpec, Timeouts
from stoker.policy.reaping import resolve_ttl
from stoker.policy.scaling import effective_cap

#: A stopped worker's grace where no pool says otherwise.
_DEFAULT_STOP_GRACE_S = Timeouts().stop_grace_s

#: The overrides of an org the config does not name: none.
_NO_OVERRIDES = OrgSpec("-")


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
        self._stored: dict[str, StoredPool] = {}
        self._rollouts: dict[str, Rollout] = {}
        self._revisions: dict[tuple[str, str], StoredRevision] = {}

    def load(
        self,
        pools: Iterable[StoredPool],
        rollouts: Iterable[Rollout],
        revisions: Iterable[StoredRevision],
    ) -> None:
        """Serve the stored pools from now on: each at its stable revision (a draining pool
        keeps no warm target), with its active rollout and the templates of its revisions."""
        stored = {p.name: p for p in pools}
        self._stored = stored
        self._pools = {
            name: dataclasses.replace(p.spec, warm_target=0) if p.draining else p.spec
            for name, p in stored.items()
        }
        self._rollouts = {r.pool: r for r in rollouts if r.active}
        self._revisions = {(r.pool, r.revision): r for r in revisions}

    def stored(self, name: str) -> StoredPool | None:
        """The pool as the store held it at the last load (None: not loaded from the store)."""
        return self._stored.get(name)

    def draining(self, name: str) -> bool:
        """True while the stored pool hands out no new claims."""
        pool = self._stored.get(name)
        return pool is not None and pool.draining

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

    def adopt(self, rollout: Rollout, revision: StoredRevision | None = None) -> None:
        """Serve `rollout` (the pool's newest: active, or ended since the pool was last
        loaded) and, when given, the template of its revision."""
        self._rollouts[rollout.pool] = rollout
        if revision is not None:
            self._revisions[(revision.pool, revision.revision)] = revision

    def revisions_of(self, name: str) -> list[StoredRevision]:
        """The stored revisions of the pool this catalog serves."""
        return [r for (pool, _), r in self._revisions.items() if pool == name]

    def rollout(self, name: str) -> Rollout | None:
        """The pool's newest rollout: its active one, or one that ended on this replica
        since the pool was last loaded."""
        return self._rollouts.get(name)

    def revision_spec(self, name: str, revision: str) -> PoolSpec | None:
        """The pool's spec at `revision`: its settings with that revision's template (None
        when the pool or the revision is unknown)."""
        pool = self._pools.get(name)
        if pool is None:
            return None
        if revision == pool.revision:
            return pool
        known = self._revisions.get((name, revision))
        if known is None:
            return None
        return dataclasses.replace(pool, template=known.template, revision=revision)

    def pool_cap(self, pool: PoolSpec) -> int:
        """The pool cap in force (0 = unbounded)."""
        return effective_cap(pool.max_workers, self._derived_cap(pool))

    def org_cap(self, pool: PoolSpec, org: str) -> int:
        """The org's cap in the pool (0 = unbounded)."""
        own = self._org(org).max_workers
        return pool.max_workers_per_org if own is None else own

    def stop_grace_s(self, pool_name: str) -> float:
        """The seconds a worker of the pool has to exit once asked to stop (the default
        of `Timeouts` for a pool this replica does not serve)."""
        pool = self._pools.get(pool_name)
        return pool.timeouts.stop_grace_s if pool is not None else _DEFAULT_STOP_GRACE_S

    def max_claim_s(self, pool_name: str, org: str) -> float:
        """The longest a session of `org` in the pool may last (org -> pool; 0 = no limit)."""
        own = self._org(org).max_claim_s
        pool = self._pools.get(pool_name)
        return own if own is not None else pool.max_claim_s if pool else 0.0

    def min_hot_idle(self, pool_name: str, org: str) -> int:
        """The org's hot_idle floor in the pool (org -> pool)."""
        own = self._org(org).min_hot_idle
        pool = self._pools.get(pool_name)
        return own if own is not None else pool.min_hot_idle if pool else 0

    @property
    def orgs(self) -> Mapping[str, OrgSpec]:
        """The per-org overrides, by org (every pool's)."""
        return self._orgs

    def _org(self, org: str) -> OrgSpec:
        """The org's overrides (none for an org the config does not name)."""
        return self._orgs.get(org, _NO_OVERRIDES)

    def hot_idle_ttl(self, pool: PoolSpec, org: str, claim_ttl: float | None) -> float:
        """How long a worker of `org` stays parked: claim -> org -> pool, clamped by max_ttl."""
        org_ttl = self._org(org).hot_idle_ttl
        return resolve_ttl(claim_ttl, org_ttl, pool.hot_idle_ttl, pool.max_ttl)
