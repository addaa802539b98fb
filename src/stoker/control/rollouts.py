"""Rollouts as one replica serves them: which revision a new claim goes to, which
revisions may park workers for reuse, and each pass's `rollout_plan`.

Every answer comes from `stoker.policy.rollout.rollout_plan` over the catalog's stored
rollout: a replica that does not lead routes by the plan of the stored step (`decide`
off); the leader's janitor computes the plan that decides and writes what it decided.
Outcomes of the ramping revision are counted here as this replica sees them; every replica
writes its counts to the store (`control.outcomes`) and the leader judges from their sum.
Each plan sets the pool's `stoker_pool_revision_share` series (those of revisions that no
longer serve are removed) and `stoker_rollout_state`, and the leader's steps, holds,
pauses and verdicts are events of the journal (`GET /v1/events`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Mapping
from enum import StrEnum

from stoker.control.catalog import Catalog
from stoker.control.journal import EventKind, Journal
from stoker.control.metrics import Metrics
from stoker.domain.pools import Rollout, StoredRevision
from stoker.domain.rollouts import CanaryStrategy, RolloutState
from stoker.domain.specs import PoolSpec
from stoker.domain.states import RetireReason
from stoker.policy.rollout import (
    SERVING,
    Decision,
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
    #: A claim of the pool that wanted a neutral worker while the rollout was under way,
    #: and one of those that routing sent to the ramping revision (sticky by org).
    NEUTRAL = "neutral"
    ROUTED = "routed"


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

    def __init__(
        self,
        catalog: Catalog,
        metrics: Metrics,
        planner: Planner = rollout_plan,
        journal: Journal | None = None,
    ) -> None:
        """`planner` replaces `rollout_plan` (the simulator's baselines); `journal`
        records the rollouts' events."""
        self._catalog = catalog
        self._metrics = metrics
        self._plan = planner
        self._journal = journal
        #: The revisions whose share series each pool shows.
        self._shown: dict[str, set[str]] = {}
        #: The rollout id and step each pool's last recorded hold was about.
        self._held: dict[str, tuple[str, int]] = {}
        #: Called after a failure is counted (the outcome counts publish soon).
        self.on_failure: Callable[[], None] | None = None
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
        self._show(pool.name, plan, ramp)
        return plan

    def show_stored(self) -> None:
        """Bring every pool's series to its stored rollout (a replica that does not lead
        plans nothing; its catalog loads what the leader wrote)."""
        for pool in self._catalog.pools.values():
            self.stored(pool)

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
        then the other serving ones, but never a new revision whose first step has not
        taken effect (it takes no claim before it holds that step's workers)."""
        others = [r for r in self.serving_revisions(name) if r != revision]
        pool = self._catalog.get(name)
        if pool is not None and others and self._catalog.rollout(name) is not None:
            plan = self.stored(pool)
            others = [r for r in others if r == plan.stable or plan.part(r).share > 0]
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
            if outcome in _FAILURES and self.on_failure is not None:
                self.on_failure()

    def note_neutral(self, pool: str, revision: str) -> None:
        """Count a claim of the pool that wants a neutral worker, routed to `revision`,
        while a rollout is under way (how much of the pool's claims routing sends it)."""
        ramp = self._catalog.rollout(pool)
        if ramp is not None and not ramp.state.ended:
            self._tally[(ramp.id, Outcome.NEUTRAL)] += 1
            if ramp.revision == revision:
                self._tally[(ramp.id, Outcome.ROUTED)] += 1

    def counted(self) -> dict[str, dict[str, int]]:
        """This replica's counts so far: rollout id -> outcome -> count."""
        out: dict[str, dict[str, int]] = {}
        for (rollout, outcome), n in self._tally.items():
            out.setdefault(rollout, {})[outcome.value] = n
        return out

    def failures(self, rollout_id: str) -> RevisionFailures:
        """What this replica saw of the rollout's revision so far."""
        return self.failures_of(self.counted().get(rollout_id, {}))

    @staticmethod
    def failures_of(counts: Mapping[str, int]) -> RevisionFailures:
        """The plan's view of outcome counts (by `Outcome` value)."""

        def n(outcome: Outcome) -> int:
            return counts.get(outcome.value, 0)

        return RevisionFailures(
            spawns=n(Outcome.SPAWN),
            spawn_failures=n(Outcome.SPAWN_FAILURE),
            activations=n(Outcome.ACTIVATION),
            activation_failures=n(Outcome.ACTIVATION_FAILURE),
            claims=n(Outcome.CLAIM),
            claim_errors=n(Outcome.CLAIM_ERROR),
            neutral=n(Outcome.NEUTRAL),
            routed=n(Outcome.ROUTED),
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
        current = self._catalog.get(pool.name) or pool
        self._show(pool.name, routing_plan(current.revision, written), written)

    def _show(self, name: str, plan: RolloutPlan, ramp: Rollout | None) -> None:
        """Set the pool's series to `plan`: each serving revision's share (the series of
        the others are removed) and the state of its newest rollout `ramp`."""
        shown = self._shown.setdefault(name, set())
        serving = {rev for rev in plan.revisions if plan.serving(rev)} | {plan.stable}
        for revision in shown - serving:
            self._metrics.revision_share.remove(name, revision)
        for revision in serving:
            self._metrics.revision_share.labels(name, revision).set(plan.part(revision).share)
        self._shown[name] = serving
        for state in RolloutState:
            on = ramp is not None and ramp.state is state
            self._metrics.rollout_state.labels(name, state.value).set(1 if on else 0)

    def record(self, kind: EventKind, ramp: Rollout, why: str | None = None) -> None:
        """An event of the journal about `ramp` (`why`: its reason, if any)."""
        if self._journal is None:
            return
        detail = f"rollout {ramp.id} of revision {ramp.revision}: {ramp.state.value}"
        if not ramp.state.ended:
            detail += f" at step {ramp.step + 1} of {_steps(ramp)}, {ramp.share} % of new claims"
        self._journal.record(kind, pool=ramp.pool, reason=why, detail=detail)

    def decided(self, plan: RolloutPlan) -> None:
        """Record what the leader wrote for `plan` (a step, a pause, a verdict)."""
        written = plan.written
        kind = _DECIDED.get(plan.decision)
        if written is not None and kind is not None:
            self.record(kind, written, plan.why)

    def plan(
        self,
        pool: PoolSpec,
        counts: Mapping[str, RevisionCounts],
        demand: PoolDemand,
        now: float,
        *,
        decide: bool = True,
        failures: RevisionFailures | None = None,
    ) -> RolloutPlan:
        """The pass's plan for the pool, deciding what is due unless `decide` is off (the
        leader writes what it decided); `failures`: every replica's counts of the
        rollout (None: this replica's own)."""
        ramp = self._catalog.rollout(pool.name)
        if failures is None:
            failures = self.failures(ramp.id) if ramp is not None else RevisionFailures()
        plan = self._plan(
            stable=pool.revision,
            ramp=ramp,
            counts=counts,
            failures=failures,
            pool=demand,
            now=now,
            decide=decide,
        )
        self.plans[pool.name] = plan
        self._show(pool.name, plan, ramp)
        self._note_hold(pool.name, plan)
        return plan

    def _note_hold(self, name: str, plan: RolloutPlan) -> None:
        """Record once per step that a due step waits for the revision's workers."""
        ramp = plan.ramp
        if ramp is None or plan.decision is not Decision.HOLD or not plan.held_back:
            return
        key = (ramp.id, ramp.step if ramp.share else -1)
        if self._held.get(name) != key:
            self._held[name] = key
            self.record(EventKind.ROLLOUT_HELD, ramp, plan.waits)


#: Outcomes that are failures: the leader should hear of them before the next pass.
_FAILURES = frozenset({Outcome.SPAWN_FAILURE, Outcome.ACTIVATION_FAILURE, Outcome.CLAIM_ERROR})

#: The event of each decision the leader writes.
_DECIDED = {
    Decision.ADVANCE: EventKind.ROLLOUT_STEP,
    Decision.PAUSE: EventKind.ROLLOUT_PAUSED,
    Decision.PROMOTE: EventKind.ROLLOUT_PROMOTED,
    Decision.ROLL_BACK: EventKind.ROLLOUT_ROLLED_BACK,
}


def _steps(ramp: Rollout) -> int:
    strategy = ramp.strategy
    return len(strategy.steps) if isinstance(strategy, CanaryStrategy) else 1
