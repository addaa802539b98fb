"""Rollouts as one replica serves them: which revision a new claim goes to, which
revisions may park workers for reuse, and each pass's `rollout_plan`.

Every answer comes from `stoker.policy.rollout.rollout_plan` over the catalog's stored
rollout: a replica that does not lead routes by the plan of the stored step (`decide`
off); the leader's janitor computes the plan that decides and writes what it decided.
Failures of the ramping revision are counted here as this replica sees them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Mapping
from enum import StrEnum

from stoker.control.catalog import Catalog
from stoker.control.metrics import Metrics
from stoker.domain.pools import Rollout, StoredRevision
from stoker.domain.rollouts import RolloutState
from stoker.domain.specs import PoolSpec
from stoker.domain.states import RetireReason
from stoker.policy.rollout import (
    SERVING,
    PoolDemand,
    RevisionCounts,
    RevisionFailures,
    RolloutPlan,
    rollout_plan,
    routing_plan,
)

#: Rollouts whose revision's workers retire as `rollout_failed`.
_FAILED = frozenset({RolloutState.ROLLED_BACK, RolloutState.ABORTED})


class Outcome(StrEnum):
    """What a revision's worker was tried for, and whether it failed."""

    SPAWN = "spawn"
    SPAWN_FAILURE = "spawn_failure"
    ACTIVATION = "activation"
    ACTIVATION_FAILURE = "activation_failure"
    CLAIM = "claim"
    CLAIM_ERROR = "claim_error"


#: `rollout_plan`, or what the simulator's baselines put in its place (same arguments).
Planner = Callable[..., RolloutPlan]


class _Reusable(Container[str]):
    """`revision in reusable`: the plan's answer."""

    def __init__(self, plan: RolloutPlan) -> None:
        self._plan = plan

    def __contains__(self, revision: object) -> bool:
        return isinstance(revision, str) and self._plan.reusable(revision)


class Rollouts:
    """Routing, reuse and sizing of each pool's revisions by its rollout plan."""

    def __init__(self, catalog: Catalog, metrics: Metrics, planner: Planner = rollout_plan) -> None:
        """`planner` replaces `rollout_plan` (the simulator's baselines)."""
        self._catalog = catalog
        self._metrics = metrics
        self._plan = planner
        #: Attempts and failures by (rollout id, outcome).
        self._tally: Counter[tuple[str, Outcome]] = Counter()
        #: The last plan each pool's pass computed (the API and metrics show it).
        self.plans: dict[str, RolloutPlan] = {}
        #: Each pool's plan of its stored rollout, with the revision and the rollout it is
        #: of: every claim and release asks for it, and it changes only with them.
        self._routing: dict[str, tuple[str, Rollout | None, RolloutPlan]] = {}

    def stored(self, pool: PoolSpec) -> RolloutPlan:
        """The plan of the stored rollout, deciding nothing: how new claims route now."""
        ramp = self._catalog.rollout(pool.name)
        known = self._routing.get(pool.name)
        # A rollout is an immutable record: the same one (and revision) has the same plan.
        if known is not None and known[0] == pool.revision and known[1] is ramp:
            return known[2]
        plan = routing_plan(pool.revision, ramp)
        self._routing[pool.name] = (pool.revision, ramp, plan)
        return plan

    def route(self, pool: PoolSpec, org: str) -> PoolSpec:
        """The spec of the revision a new (non-reuse) claim of `org` goes to."""
        if self._catalog.rollout(pool.name) is None:
            return pool
        revision = self.stored(pool).route(org)
        return self._catalog.revision_spec(pool.name, revision) or pool

    def serving(self, name: str, revision: str) -> bool:
        """Whether workers of the pool's `revision` serve claims and park for reuse."""
        pool = self._catalog.get(name)
        if pool is None:
            return False
        if self._catalog.rollout(name) is None:
            return revision == pool.revision
        return self.stored(pool).serving(revision)

    def reusable(self, name: str) -> Container[str]:
        """The revisions whose parked workers their org may reuse (`in` asks the plan)."""
        pool = self._catalog.get(name)
        if pool is None:
            return ()
        return _Reusable(self.stored(pool))

    def warm_order(self, name: str, revision: str) -> tuple[str, ...]:
        """Where a new claim routed to `revision` looks for a warm worker: its revision,
        then the other serving ones."""
        others = [r for r in self.serving_revisions(name) if r != revision]
        return (revision, *others)

    def serving_revisions(self, name: str) -> tuple[str, ...]:
        """The revisions whose parked workers an org may reuse, the stable one first."""
        pool = self._catalog.get(name)
        if pool is None:
            return ()
        if self._catalog.rollout(name) is None:
            return (pool.revision,)
        plan = self.stored(pool)
        parts = sorted(plan.revisions.values(), key=lambda p: p.revision != plan.stable)
        return tuple(p.revision for p in parts if p.role in SERVING)

    def retire_reason(self, name: str, revision: str) -> RetireReason:
        """Why an idle worker of a revision that no longer serves retires."""
        ramp = self._catalog.rollout(name)
        failed = ramp is not None and ramp.revision == revision and ramp.state in _FAILED
        return RetireReason.ROLLOUT_FAILED if failed else RetireReason.ROLLOUT

    def note(self, pool: str, revision: str, outcome: Outcome) -> None:
        """Count an attempt (or a failure) of a revision while its rollout is active."""
        ramp = self._catalog.rollout(pool)
        if ramp is not None and ramp.revision == revision and not ramp.state.ended:
            self._tally[(ramp.id, outcome)] += 1

    def failures(self, rollout_id: str) -> RevisionFailures:
        """What this replica saw of the rollout's revision so far."""
        t = self._tally
        return RevisionFailures(
            spawns=t[(rollout_id, Outcome.SPAWN)],
            spawn_failures=t[(rollout_id, Outcome.SPAWN_FAILURE)],
            activations=t[(rollout_id, Outcome.ACTIVATION)],
            activation_failures=t[(rollout_id, Outcome.ACTIVATION_FAILURE)],
            claims=t[(rollout_id, Outcome.CLAIM)],
            claim_errors=t[(rollout_id, Outcome.CLAIM_ERROR)],
        )

    def adopt(
        self, pool: PoolSpec, written: Rollout, revision: StoredRevision | None = None
    ) -> None:
        """Serve a rollout row just written (a start with its `revision`, a step, a
        promotion, a rollback) at once."""
        self._catalog.adopt(written, revision)
        spec = self._catalog.revision_spec(pool.name, written.revision)
        if written.state is RolloutState.PROMOTED and spec is not None:
            self._catalog.update_pool(spec)
        self.show(pool.name, written)

    def show(self, name: str, ramp: Rollout | None) -> None:
        """Set the pool's `stoker_rollout_state` series."""
        for state in RolloutState:
            on = ramp is not None and ramp.state is state
            self._metrics.rollout_state.labels(name, state.value).set(1 if on else 0)

    def plan(
        self,
        pool: PoolSpec,
        counts: Mapping[str, RevisionCounts],
        demand: PoolDemand,
        now: float,
        *,
        decide: bool = True,
    ) -> RolloutPlan:
        """The pass's plan for the pool, deciding what is due unless `decide` is off (the
        leader writes what it decided)."""
        ramp = self._catalog.rollout(pool.name)
        plan = self._plan(
            stable=pool.revision,
            ramp=ramp,
            counts=counts,
            failures=self.failures(ramp.id) if ramp is not None else RevisionFailures(),
            pool=demand,
            now=now,
            decide=decide,
        )
        self.plans[pool.name] = plan
        for part in plan.revisions.values():
            self._metrics.revision_share.labels(pool.name, part.revision).set(part.share)
        return plan
