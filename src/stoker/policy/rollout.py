"""The rollout plan: what each revision of a pool gets while a new one ramps (pure).

`rollout_plan` is the one answer to "is this pool ramping, and how": spawning sizes each
revision from it, routing splits new claims by its shares, the janitor retires by its
roles, and the API and metrics show it. Nothing else derives a ramp.

The rules (docs/guides/rollouts.md; picchu #602, #614-#617, #648, whose bugs
each avoids):

- a session never moves to another revision, so the ramping revision is sized from the
  claims it will get: its step's share of the pool's own demand-driven warm target (the
  rate and forecast one), or more when the orgs routed to it made more of the pool's
  claims (routing is sticky by org); the stable revision's target shrinks by as much.
  Busy sessions of any revision never size it, and neither do its own workers (no
  feedback loop: 100 -> 232); the pool's target is within its cap;
- every step, the first included, takes effect (new claims routed by its share) only once
  the ramping revision holds its step's warm workers (90 % of them, or of the part the
  stable revision holds of its own target when it holds less); it grows towards the next step
  ahead of it (a replacement time, at least half an interval), so that it holds them when
  the step is due; the stable revision gives up its part when the step takes effect, or
  while the ramp grows when the pool's cap leaves no room for both;
- a step that cannot be held within the strategy's `hold_deadline_s` pauses the rollout
  with the reason;
- a step advances after `step_interval_s` while the revision's failure ratios (summed
  over every replica) stay under `max_failure_ratio`; the last one promotes;
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
#: The share of the pool's claims the routed orgs made counts from this many claims on.
MIN_ROUTED_CLAIMS = 20
#: A step is held once the revision has this much of its step's warm workers: claims
#: routed to it take some while the rest get ready (picchu's 0.90, #611).
HOLD_RATIO = 0.9


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
    #: The step could not be held within the strategy's deadline.
    PAUSE = "pause"
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
    """Attempts and failures of the ramping revision since its rollout started, summed
    over every replica, and how many of the pool's claims its routing took."""

    spawns: int = 0
    spawn_failures: int = 0
    activations: int = 0
    activation_failures: int = 0
    claims: int = 0
    claim_errors: int = 0
    #: Claims of the pool that wanted a neutral worker while the rollout was under way,
    #: and those of them routed to the ramping revision.
    neutral: int = 0
    routed: int = 0

    def routed_share(self) -> float | None:
        """The share of the pool's neutral claims the orgs routed to the revision made
        (None: too few claims to tell)."""
        if self.neutral < MIN_ROUTED_CLAIMS:
            return None
        return min(1.0, self.routed / self.neutral)

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
    #: Seconds from a spawn to a ready worker, plus a pass: how early a revision starts to
    #: grow towards its next step.
    lead_s: float = 0.0


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
    #: Warm workers the ramping revision must hold before its next step takes effect
    #: (0: no ramp).
    needed: int = 0
    #: Why the rollout waits, in words ("": it does not).
    waits: str = ""
    #: Whether a step that is due waits for the revision's warm workers.
    held_back: bool = False
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
    whole = desired_warm(pool.warm_target, pool.demand, pool.cap)
    routed = failures.routed_share() if failures is not None else None

    def portion(share: float) -> int:
        """The ramp's part of the pool's warm target at `share` of new claims."""
        if share <= 0:
            return 0
        return min(whole, math.ceil(whole * max(share, routed or 0.0)))

    # A canary starts *preparing* (share 0): its first step is a step like the others,
    # taken once the new revision holds its workers, so that its first claims find them.
    preparing = ramp.share <= 0
    last = ramp.step >= len(strategy.steps) - 1
    share = 0.0 if preparing else strategy.share(ramp.step)
    coming = strategy.share(ramp.step if preparing or last else ramp.step + 1)
    due_at = _step_started(ramp) + (0.0 if preparing else strategy.step_interval_s)
    ramping = ramp.state is RolloutState.RAMPING
    # It grows towards the next step ahead of it, so that it holds the step's workers when
    # the step is due: a replacement time early, and at least half an interval (a new
    # revision's first spawns pull its image; the pool's estimate knows the old one's).
    lead = max(pool.lead_s, strategy.step_interval_s / 2)
    growing = ramping and not (last and not preparing) and now >= due_at - lead
    ramp_warm = portion(coming if growing else share)
    # The stable revision gives up its part once the step takes effect; while the ramp
    # grows it keeps it (its claims still come), unless the pool's cap leaves no room for
    # both, the ramp's spawns going first.
    stable_warm = whole - portion(share)
    live = sum(c.live for c in counts.values())
    if pool.cap > 0 and live + max(0, ramp_warm - own.warm - own.spawning) > pool.cap:
        stable_warm = whole - ramp_warm
    needed = portion(coming)
    # Held: 90 % of the step's warm workers, or of the part of them the stable revision
    # holds of its own (a pool whose claims take its workers as fast as they get ready
    # holds none anywhere: the new revision need not be readier than the old one).
    base = counts.get(stable, RevisionCounts())
    filled = min(1.0, base.warm / stable_warm) if stable_warm > 0 else 1.0
    held = own.warm >= math.ceil(needed * HOLD_RATIO * filled)
    due = ramping and now >= due_at
    role = Role.RAMPING if ramping else Role.PAUSED
    parts = {rev: RevisionPlan(rev, Role.RETIRING, 0.0, 0) for rev in counts}
    # The ramp first: at a full pool its spawns go before the stable revision's refills.
    parts.pop(ramp.revision, None)
    parts = {ramp.revision: RevisionPlan(ramp.revision, role, share, ramp_warm), **parts}
    parts[stable] = RevisionPlan(stable, Role.STABLE, 1.0 - share, max(0, stable_warm))
    plan = RolloutPlan(
        stable=stable,
        revisions=parts,
        ramp=ramp,
        needed=needed,
        waits=_waits(ramp, own, needed, held, due_at - now, pool, live),
        held_back=due and not held and not (last and not preparing),
        totals={"whole": whole, "live": live},
    )
    if failures is None or not due:
        return plan
    if last and not preparing:
        promoted = _steady(ramp.revision, None, counts, pool)
        return _ended(promoted, ramp, Decision.PROMOTE, "the last step held", now)
    if held:
        step = ramp.step if preparing else ramp.step + 1
        advanced = ramp.evolve(step=step, share=strategy.steps[step], step_started_at=now)
        after = _canary(stable, advanced, strategy, counts, failures, pool, now)
        why = f"the new revision holds {own.warm} of {needed} warm workers: {advanced.share} %"
        return replace(after, decision=Decision.ADVANCE, why=why, written=advanced)
    if now - due_at >= strategy.hold_deadline_s:
        waited = f"waited {now - due_at:.0f} s (deadline {strategy.hold_deadline_s:.0f} s)"
        why = f"{plan.waits}: {waited}"
        paused = ramp.evolve(state=RolloutState.PAUSED, reason=why)
        after = _canary(stable, paused, strategy, counts, failures, pool, now)
        return replace(after, decision=Decision.PAUSE, why=why, written=paused)
    return plan


def _waits(
    ramp: Rollout,
    own: RevisionCounts,
    needed: int,
    held: bool,
    due_in: float,
    pool: PoolDemand,
    live: int,
) -> str:
    """Why the rollout waits now, in words (`due_in`: seconds until its next step is due)."""
    if ramp.state is RolloutState.PAUSED:
        return f"paused: {ramp.reason}" if ramp.reason else "paused"
    if due_in > 0:
        return f"the step's interval: the next step is due in {due_in:.0f} s"
    if held:
        return ""
    why = f"the new revision holds {own.warm} of the {needed} warm workers its step needs"
    if pool.cap > 0 and live >= pool.cap:
        why += f", the pool is at its cap of {pool.cap}"
    return why


def _step_started(ramp: Rollout) -> float:
    return ramp.step_started_at if ramp.step_started_at is not None else ramp.started_at
