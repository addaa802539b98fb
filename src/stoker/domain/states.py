"""Worker and claim states, and the one table of legal worker transitions
(docs/concepts/lifecycle.md).

Every write of a worker's state is checked against `TRANSITIONS` by `check_transition`;
the store adapters call it before they touch a row, so an illegal move never reaches disk.
"""

from __future__ import annotations

from enum import StrEnum

from stoker.domain.errors import IllegalTransition


class WorkerState(StrEnum):
    """Durable lifecycle state of a worker (one column in the store)."""

    SPAWNING = "spawning"
    WARM = "warm"
    RESERVED = "reserved"
    ACTIVATING = "activating"
    HOT = "hot"
    HOT_IDLE = "hot_idle"
    DRAINING = "draining"
    RETIRED = "retired"


S = WorkerState

#: Legal moves. Any non-terminal state may drain or retire; `retired` is terminal.
TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    S.SPAWNING: frozenset({S.WARM, S.RESERVED, S.DRAINING, S.RETIRED}),
    S.WARM: frozenset({S.RESERVED, S.DRAINING, S.RETIRED}),
    # A reservation whose requester left goes back: to warm if the worker never entered
    # `activating` (rule 4), else to its org's hot_idle.
    S.RESERVED: frozenset({S.ACTIVATING, S.WARM, S.HOT_IDLE, S.DRAINING, S.RETIRED}),
    S.ACTIVATING: frozenset({S.HOT, S.HOT_IDLE, S.DRAINING, S.RETIRED}),
    S.HOT: frozenset({S.HOT_IDLE, S.DRAINING, S.RETIRED}),
    S.HOT_IDLE: frozenset({S.RESERVED, S.DRAINING, S.RETIRED}),
    S.DRAINING: frozenset({S.RETIRED}),
    S.RETIRED: frozenset(),
}

TERMINAL: frozenset[WorkerState] = frozenset({S.RETIRED})
#: States that occupy a slot against pool and org caps.
LIVE: frozenset[WorkerState] = frozenset(set(S) - TERMINAL)
#: States that are in flight and must progress or be retired within a timeout (I4).
IN_FLIGHT: frozenset[WorkerState] = frozenset({S.SPAWNING, S.RESERVED, S.ACTIVATING})
#: States in which a worker is bound to an org and must not be disrupted by the cluster.
BUSY: frozenset[WorkerState] = frozenset({S.ACTIVATING, S.HOT, S.HOT_IDLE})
#: States that reserve a worker for a claim (each bumps the epoch).
RESERVABLE: frozenset[WorkerState] = frozenset({S.WARM, S.HOT_IDLE})


def check_transition(current: WorkerState, to: WorkerState, *, activated: bool = False) -> None:
    """Raise `IllegalTransition` unless `current -> to` is in the table.

    `activated` says whether the worker ever entered `activating`: such a worker has seen
    an org's data and may never become neutral (`warm`) again.
    """
    if to not in TRANSITIONS[current]:
        raise IllegalTransition(f"{current} -> {to} is not a legal worker transition")
    if current is S.RESERVED and to is S.WARM and activated:
        raise IllegalTransition("reserved -> warm is illegal for a worker that was activated")
    if current is S.RESERVED and to is S.HOT_IDLE and not activated:
        raise IllegalTransition("reserved -> hot_idle needs a worker that was activated before")


def check_org_change(
    current: str | None, new: str | None, *, to: WorkerState, activated: bool
) -> None:
    """Org is written once: empty -> X at reservation, never X -> Y (rule 4).

    The ways back to empty are a never-activated worker returning to `warm`, and a spawn
    slot whose claim took another worker (its org only held a place in the org's cap).
    """
    if new == current:
        return
    if current is None:
        return
    if new is None and to in (S.WARM, S.SPAWNING) and not activated:
        return
    raise IllegalTransition(f"org of a worker cannot change from {current!r} to {new!r}")


class ClaimState(StrEnum):
    """State of a claim once it is bound to a worker (pending claims live in memory only)."""

    BOUND = "bound"
    RELEASED = "released"
    EXPIRED = "expired"
    FAILED = "failed"


class ClaimMode(StrEnum):
    """How a claim may be served (`mode` of `POST /v1/claims`, docs/concepts/claims.md)."""

    PREFER_WARM = "prefer_warm"
    REQUIRE_WARM = "require_warm"
    COLD = "cold"


class ClaimSource(StrEnum):
    """Where the worker of a bound claim came from: `reuse` (parked for its org), `warm`
    (ready when the claim looked), `cold` (the claim waited for a worker to start: its own
    spawn, or any other that got ready first)."""

    REUSE = "reuse"
    WARM = "warm"
    COLD = "cold"


class Reuse(StrEnum):
    """A pool's reuse policy on release."""

    SAME_ORG = "same_org"
    NEVER = "never"


class RetireReason(StrEnum):
    """Why a worker was retired; one label value of `stoker_retirements_total`."""

    TTL = "ttl"
    EXCESS = "excess"
    SPAWN_FAILURE = "spawn_failure"
    ACTIVATION_FAILURE = "activation_failure"
    LEASE_EXPIRED = "lease_expired"
    #: The session reached its pool's or org's `max_claim_s`.
    MAX_CLAIM = "max_claim"
    LOST = "lost"
    EVICTED = "evicted"
    STUCK = "stuck"
    ROLLOUT = "rollout"
    #: The worker's revision rolled back or its rollout was aborted.
    ROLLOUT_FAILED = "rollout_failed"
    SHUTDOWN = "shutdown"
    NO_REUSE = "no_reuse"
    ORPHANED = "orphaned"
    POOL_REMOVED = "pool_removed"
    #: A pool at its cap gave a parked worker's place to a claim of another org.
    RECLAIMED = "reclaimed"


class MissReason(StrEnum):
    """Why a claim found no warm or reusable worker (`org_cap` is not demand)."""

    NO_WARM = "no_warm"
    ORG_CAP = "org_cap"
    POOL_CAP = "pool_cap"
