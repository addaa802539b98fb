"""The rollout plan: what each revision of a pool gets while a new one ramps (pure).

`rollout_plan` is the one answer to "is this pool ramping, and how": spawning sizes each
revision from it, routing splits new claims by its shares, the janitor retires by its
roles, and the API and metrics show it. Nothing else derives a ramp.

The rules (picchu #602, #614-#617, #648, whose bugs each rule avoids):

- the ramping revision's capacity is the *other* revisions' live capacity (busy + warm)
  times its share, never a figure that counts its own workers (a feedback loop: 100 -> 232);
- the total stays within the pool's cap when it has one, else within the 100 % equivalent
  of the other revisions plus the pool's demand;
- with nothing else live (warm_target 0), the ramp is sized from demand, never a fixed 1;
- the stable revision keeps its demand-driven target for its share of new claims;
- a step advances after `step_interval_s` only once the ramping revision holds what the
  next step needs and its failure ratios stay under `max_failure_ratio`;
- failures over the threshold roll back at once: share 0 and the stable revision's whole
  target back in the same plan (no `scale_down_delay`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from stoker.domain.pools import Rollout
from stoker.domain.rollouts import CanaryStrategy, ReplaceStrategy, RolloutState
from stoker.policy.scaling import desired_warm

#: A failure ratio is judged only from this many attempts on (one early failure of a
#: revision is not a verdict); a crash loop reaches it within a few back-offs.
MIN_ATTEMPTS = 5


class Role(StrEnum):
    """What a revision does in the plan."""

    #: Takes the new claims the ramp does not (all of them without a rollout).
    STABLE = "stable"
    #: The newest revision, taking its step's share of new claims.
    RAMPING = "ramping"
    #: The newest revision, its share held where it is.
    PAUSED = "paused"
    #: An older revision: no new claims, its warm and parked workers retire (`rollout`).
    RETIRING = "retiring"
    #: A revision whose rollout failed or was aborted: it retires (`rollout_failed`).
    FAILED = "failed"


#: Roles whose workers serve claims and park for reuse.
SERVING = frozenset({Role.STABLE, Role.RAMPING, Role.PAUSED})
#: Roles whose parked workers their org may still reuse (until their TTL): an older
#: revision's too, so that a promotion does not cost every parked org a cold start; not
#: a failed one's.
REUSABLE = SERVING | {Role.RETIRING}


class Decision(StrEnum):
    """What the leader writes to the store after this plan (`hold`: nothing)."""

    HOLD = "hold"
    ADVANCE = "advance"
    PROMOTE = "promote"
    ROLL_BACK = "roll_back"


@dataclass(frozen=True, slots=True)
class RevisionCounts:
    """Live workers of one revision."""

    #: Bound to an org: reserved, activating, hot or hot_idle.
    busy: int = 0
    warm: int = 0
    #: Spawn slots on their way to warm.
    spawning: int = 0

    @property
    def capacity(self) -> int:
        """What the revision holds now: busy + warm."""
        return self.busy + self.warm

    @property
    def live(self) -> int:
        """Every slot the revision takes against the cap."""
        return self.busy + self.warm + self.spawning


@dataclass(frozen=True, slots=True)
class RevisionFailures:
    """Attempts and failures of the ramping revision since its rollout started."""

    spawns: int = 0
    spawn_failures: int = 0
    activations: int = 0
    activation_failures: int = 0
    claims: int = 0
    claim_errors: int = 0

    def worst(self) -> tuple[str, float] | None:
        """The highest failure ratio among those judged (enough attempts), with its name."""
        judged = [
            (name, failed / tried)
            for name, tried, failed in (
                ("spawn", self.spawns, self.spawn_failures),
                ("activation", self.activations, self.activation_failures),
                ("claim", self.claims, self.claim_errors),
            )
            if tried >= MIN_ATTEMPTS
        ]
        return max(judged, key=lambda item: item[1]) if judged else None


@dataclass(frozen=True, slots=True)
class PoolDemand:
    """The pool's own sizing inputs, as the janitor reads them without a rollout."""

    warm_target: int = 0
    #: Misses since the last pass plus claims waiting now.
    demand: int = 0
    #: The pool cap in force (0 = unbounded).
    cap: int = 0


@dataclass(frozen=True, slots=True)
class RevisionPlan:
    """One revision's part: its role, its share of new claims and its warm target."""

    revision: str
    role: Role
    share: float
    warm_target: int


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    """Every revision's part, and what the leader should write (`decision`, `why`)."""

    stable: str
    revisions: Mapping[str, RevisionPlan]
    decision: Decision = Decision.HOLD
    why: str = ""
    #: The rollout under way after `decision` (None: none).
    ramp: Rollout | None = None
    #: The rollout row the leader writes for `decision` (None: nothing to write).
    written: Rollout | None = None
    #: What the ramping revision must hold before the step may advance (0: no ramp).
    needed: int = 0
    totals: Mapping[str, int] = field(default_factory=dict)

    @property
    def ramping(self) -> str | None:
        """The revision that ramps (ramping or paused), if any: the one answer to that."""
        return self.ramp.revision if self.ramp is not None else None

    def part(self, revision: str) -> RevisionPlan:
        """The part of `revision`; a revision the plan does not name retires."""
        known = self.revisions.get(revision)
        return known or RevisionPlan(revision, Role.RETIRING, 0.0, 0)

    def serving(self, revision: str) -> bool:
        """Whether workers of `revision` may serve and park for reuse."""
        return self.part(revision).role in SERVING

    def reusable(self, revision: str) -> bool:
        """Whether a worker of `revision` that its org parked may serve that org again."""
        return self.part(revision).role in REUSABLE

    def route(self, org: str) -> str:
        """The revision a new (non-reuse) claim of `org` goes to.

        An org keeps its revision for the whole rollout once it moved: its place in
        [0, 1) is a hash of the rollout and the org, and the ramp's share only grows.
        """
        ramp = self.ramp
        if ramp is None:
            return self.stable
        share = self.part(ramp.revision).share
        return ramp.revision if org_position(ramp.id, org) < share else self.stable


def org_position(rollout_id: str, org: str) -> float:
    """A stable place in [0, 1) for `org` within one rollout."""
    digest = hashlib.blake2b(f"{rollout_id}\0{org}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def rollout_plan(
    *,
    stable: str,
    ramp: Rollout | None,
    counts: Mapping[str, RevisionCounts],
    failures: RevisionFailures,
    pool: PoolDemand,
    now: float,
    decide: bool = True,
) -> RolloutPlan:
    """The plan of a pool whose stable revision is `stable` and whose newest rollout is
    `ramp` (None, or ended: no ramp), from its live `counts` per revision, the ramping
    revision's `failures`, the pool's demand and `now`.

    With `decide` off the plan only reflects the stored rollout (a replica that does not
    lead routes by it); on, it also takes the step, promotion or rollback that is due,
    and shows the pool as it is once the leader wrote that."""
    if ramp is None or ramp.revision == stable or ramp.state is RolloutState.PROMOTED:
        return _steady(stable, None, counts, pool)
    if ramp.state.ended:
        failed = ramp.revision if ramp.state is not RolloutState.SUPERSEDED else None
        return _steady(stable, failed, counts, pool)
    if isinstance(ramp.strategy, ReplaceStrategy):
        plan = _steady(ramp.revision, None, counts, pool)
        if not decide:
            return plan
        return _ended(plan, ramp, Decision.PROMOTE, "replace", now)
    return _canary(stable, ramp, ramp.strategy, counts, failures if decide else None, pool, now)


def routing_plan(stable: str, ramp: Rollout | None) -> RolloutPlan:
    """The plan of the stored rollout alone, deciding nothing: each revision's role and
    share of new claims (what a replica routes by, and what the API shows)."""
    return rollout_plan(
        stable=stable,
        ramp=ramp,
        counts={},
        failures=RevisionFailures(),
        pool=PoolDemand(),
        now=0.0,
        decide=False,
    )


def _ended(
    plan: RolloutPlan, ramp: Rollout, decision: Decision, why: str, now: float
) -> RolloutPlan:
    """`plan` once the leader ended `ramp` by `decision` (promote or roll back)."""
    promoted = decision is Decision.PROMOTE
    written = ramp.evolve(
        state=RolloutState.PROMOTED if promoted else RolloutState.ROLLED_BACK,
        share=100 if promoted else 0,
        ended_at=now,
        reason=why,
    )
    return replace(plan, decision=decision, why=why, written=written)


def _steady(
    stable: str, failed: str | None, counts: Mapping[str, RevisionCounts], pool: PoolDemand
) -> RolloutPlan:
    """No ramp: the stable revision takes every claim and the whole target."""
    parts = {rev: RevisionPlan(rev, Role.RETIRING, 0.0, 0) for rev in counts}
    if failed is not None:
        parts[failed] = RevisionPlan(failed, Role.FAILED, 0.0, 0)
    parts[stable] = RevisionPlan(
        stable, Role.STABLE, 1.0, desired_warm(pool.warm_target, pool.demand, pool.cap)
    )
    return RolloutPlan(stable=stable, revisions=parts)


def _canary(
    stable: str,
    ramp: Rollout,
    strategy: CanaryStrategy,
    counts: Mapping[str, RevisionCounts],
    failures: RevisionFailures | None,
    pool: PoolDemand,
    now: float,
) -> RolloutPlan:
    """A canary under way; `failures` None: decide nothing."""
    worst = failures.worst() if failures is not None else None
    if worst is not None and worst[1] > strategy.max_failure_ratio:
        name, ratio = worst
        why = f"{name} failures {ratio:.0%} over {strategy.max_failure_ratio:.0%}"
        return _ended(
            _steady(stable, ramp.revision, counts, pool), ramp, Decision.ROLL_BACK, why, now
        )
    own = counts.get(ramp.revision, RevisionCounts())
    others = [c for rev, c in counts.items() if rev != ramp.revision]
    other_capacity = sum(c.capacity for c in others)
    other_live = sum(c.live for c in others)
    whole = desired_warm(pool.warm_target, pool.demand, pool.cap)
    # The ramp may hold at most this much: the cap, else the 100 % equivalent of the
    # others (their busy workers and the pool's warm target) plus the pool's demand.
    room = pool.cap - other_live if pool.cap > 0 else other_capacity + whole
    room = max(0, room)
    last = ramp.step >= len(strategy.steps) - 1
    due = (
        failures is not None
        and ramp.state is RolloutState.RAMPING
        and now - _step_started(ramp) >= strategy.step_interval_s
    )

    def capacity(share: float) -> int:
        if other_capacity == 0:
            # Nothing else live (warm_target 0): size from demand, never a fixed 1.
            return min(room, desired_warm(pool.warm_target, pool.demand, pool.cap))
        return min(room, math.ceil(other_capacity * share))

    # A canary starts *preparing* (share 0): its first step is a step like the others,
    # taken once the new revision holds what it needs, so its first claims find workers.
    preparing = ramp.share <= 0
    share = 0.0 if preparing else strategy.share(ramp.step)
    if preparing:
        needed = capacity(strategy.share(ramp.step))
    else:
        needed = capacity(share if last else strategy.share(ramp.step + 1))
    healthy = worst is None or worst[1] <= strategy.max_failure_ratio
    ready = failures is not None and ramp.state is RolloutState.RAMPING and healthy
    # What the others hold is the yardstick: with nothing else live there is nothing to
    # catch up with (the demand-sized target is where the ramp grows, not a gate).
    held = own.capacity >= (needed if other_capacity else 0)
    if ready and (due or preparing) and held:
        if last and not preparing:
            plan = _steady(ramp.revision, None, counts, pool)
            return _ended(plan, ramp, Decision.PROMOTE, "the last step held", now)
        step = ramp.step if preparing else ramp.step + 1
        advanced = ramp.evolve(step=step, share=strategy.steps[step], step_started_at=now)
        plan = _canary(stable, advanced, strategy, counts, failures, pool, now)
        why = f"the new revision holds {own.capacity} of {needed}: {strategy.steps[step]} %"
        return replace(plan, decision=Decision.ADVANCE, why=why, written=advanced)
    # While a step is due (or the first one prepared), the ramp grows towards what the
    # next step needs.
    target = needed if due or preparing else capacity(share)
    ramp_share_of_warm = math.ceil(whole * share)
    ramp_capacity = min(room, max(target, own.busy + ramp_share_of_warm))
    parts = {rev: RevisionPlan(rev, Role.RETIRING, 0.0, 0) for rev in counts}
    parts[stable] = RevisionPlan(stable, Role.STABLE, 1.0 - share, whole - ramp_share_of_warm)
    role = Role.RAMPING if ramp.state is RolloutState.RAMPING else Role.PAUSED
    parts[ramp.revision] = RevisionPlan(
        ramp.revision, role, share, max(0, ramp_capacity - own.busy)
    )
    return RolloutPlan(
        stable=stable,
        revisions=parts,
        ramp=ramp,
        needed=needed,
        totals={"other_capacity": other_capacity, "room": room},
    )


def _step_started(ramp: Rollout) -> float:
    return ramp.step_started_at if ramp.step_started_at is not None else ramp.started_at
