"""Durable records as the store returns them. Immutable: a change is a new record."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, TypeVar

from stoker.domain.states import ClaimMode, ClaimSource, ClaimState, WorkerState


@dataclass(frozen=True, slots=True)
class Worker:
    """One worker: exactly one row in the store describes it."""

    id: str
    pool: str
    revision: str
    state: WorkerState
    epoch: int
    owner: str
    created_at: float
    updated_at: float
    #: The row version: every write of the row bumps it, and every write compares it (a
    #: write from a stale read misses). `epoch` stays the fencing token of activations.
    version: int = 0
    org: str | None = None
    claim_id: str | None = None
    endpoint: str | None = None
    #: Runtime handle: pid and start time of a process, or the name of a pod.
    runtime_ref: Mapping[str, Any] = field(default_factory=dict)
    #: True once the worker entered `activating`: it has seen an org and is never neutral again.
    activated: bool = False
    heartbeat_at: float = 0.0
    idle_since: float | None = None
    ttl_s: float | None = None
    reason: str | None = None
    #: When `owner` last changed (a reservation by another replica, an adoption); None
    #: while the spawning replica holds it, and for rows written before the field existed.
    taken_at: float | None = None
    #: `taken_at` before that change: when the owner before took it. A replica taking back
    #: a worker another replica took from it lost it then.
    prior_taken_at: float | None = None

    def evolve(self, **changes: Any) -> Worker:
        """A copy with `changes` applied."""
        return _evolved(self, _WORKER_FIELDS, changes)


#: How a stored session token begins: what follows is the SHA-256 of the token, in hex.
DIGEST_PREFIX = "sha256:"


def token_digest(token: str) -> str:
    """What the store keeps of a session token: its SHA-256 (idempotent; "" stays "").

    Tokens are 192 random bits, so a plain hash is enough: no salt or slow hash could make
    guessing one from its digest any harder.
    """
    if not token or token.startswith(DIGEST_PREFIX):
        return token
    return DIGEST_PREFIX + hashlib.sha256(token.encode()).hexdigest()


def is_minted(token: str) -> bool:
    """True for a session token as minted (not empty, not a stored digest)."""
    return bool(token) and not token.startswith(DIGEST_PREFIX)


@dataclass(frozen=True, slots=True)
class Claim:
    """A claim bound to a worker: the session's lease."""

    id: str
    pool: str
    org: str
    worker_id: str
    worker_epoch: int
    source: ClaimSource
    mode: ClaimMode
    state: ClaimState
    #: The session token: as minted on the claim the binding returns (the one answer
    #: that carries it); a claim read from the store holds only its digest
    #: (`token_digest`), so that reading the store yields no usable token. "" for pools
    #: with `activation: none`.
    token: str
    endpoint: str
    lease_s: float
    expires_at: float
    created_at: float
    updated_at: float
    owner: str
    ttl_s: float | None = None
    ended_at: float | None = None
    reason: str | None = None
    #: The digest of the client's `Idempotency-Key` (`domain.idempotency`), unique per org;
    #: None for a claim sent without one.
    idempotency_key: str | None = None
    #: The digest of the request the key was first sent with: the same key with another
    #: request is refused.
    request_digest: str | None = None
    #: The session token sealed with the key, so that a retry on any replica gets it
    #: back and reading the store does not.
    sealed_token: str | None = None

    def evolve(self, **changes: Any) -> Claim:
        """A copy with `changes` applied."""
        return _evolved(self, _CLAIM_FIELDS, changes)


_R = TypeVar("_R")


class _Fields:
    """A record type's fields in order: all read at once, each placed by its name."""

    __slots__ = ("place", "read")

    def __init__(self, record_type: type) -> None:
        names = tuple(f.name for f in fields(record_type))
        self.read = attrgetter(*names)
        self.place = {name: i for i, name in enumerate(names)}


def _evolved(record: _R, of: _Fields, changes: dict[str, Any]) -> _R:
    """`dataclasses.replace` without looking the fields up on every call (a hot path: every
    write of a worker or claim makes one). An unknown field is a TypeError, as there.

    The values go to the constructor by position: half the cost of a dict of all the
    fields passed by keyword."""
    values = list(of.read(record))
    place = of.place
    for name, value in changes.items():
        i = place.get(name)
        if i is None:
            raise TypeError(f"{type(record).__name__} has no field {name!r}")
        values[i] = value
    return type(record)(*values)


_WORKER_FIELDS = _Fields(Worker)
_CLAIM_FIELDS = _Fields(Claim)


@dataclass(frozen=True, slots=True)
class Instance:
    """One control-plane replica as registered in the store."""

    id: str
    started_at: float
    heartbeat_at: float
    state: str
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DemandRecord:
    """One replica's demand signal for one pool: cumulative misses, claims queued now, and
    cumulative claims that wanted a neutral worker (served warm or cold: not by reuse)."""

    pool: str
    instance: str
    misses: int
    waiting: int
    updated_at: float
    claims: int = 0


@dataclass(frozen=True, slots=True)
class PoolSizingRecord:
    """How the leading replica's janitor last sized one pool, as it published it after its
    pass (`control.published_sizing`): what every replica's pool listing shows. One row per
    pool, replaced by each pass of whichever replica leads."""

    pool: str
    #: The replica whose janitor sized the pool, and when (its clock, at the pass).
    instance: str
    sized_at: float
    desired_warm: int
    #: Warm workers wanted beyond the static target.
    demand: int
    #: The terms of the sizing (the fields of `control.sizing.SizingStatus`); empty when the
    #: janitor sized the pool without them (a simulator's baseline).
    sizing: Mapping[str, Any] = field(default_factory=dict)
    #: Why the pool's rollout under way waits ("": it does not); None without a rollout.
    rollout_waits: str | None = None


@dataclass(frozen=True, slots=True)
class ForecastBucket:
    """One bucket of a pool's learned new-session rate (`policy.forecast`): the rate's
    exponentially weighted mean and variance (claims per second) in one hour of the week
    (`level` "week", bucket 0-167 from Monday 00:00 UTC) or one hour of a weekday or
    weekend day (`level` "day", 0-23 weekdays, 24-47 weekends), and how many hours it
    learned from."""

    pool: str
    level: str
    bucket: int
    mean: float
    var: float
    seen: int
    updated_at: float


@dataclass(frozen=True, slots=True)
class OrgForecastBucket:
    """One bucket of an org's learned new-session rate in a pool (`policy.org_forecast`):
    the rate's exponentially weighted mean and variance (claims per second) in one hour of
    a weekday (`bucket` 0-23) or of a weekend day (24-47), and how many hours it learned
    from."""

    pool: str
    org: str
    bucket: int
    mean: float
    var: float
    seen: int
    updated_at: float


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """A leadership lease: who holds it, since when, and its fencing epoch."""

    name: str
    holder: str
    epoch: int
    renewed_at: float
    duration_s: float

    def expired(self, now: float) -> bool:
        """True once the holder failed to renew within the duration."""
        return now >= self.renewed_at + self.duration_s


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """What a client asks for (`POST /v1/claims`, docs/concepts/claims.md)."""

    pool: str
    org: str
    mode: ClaimMode = ClaimMode.PREFER_WARM
    #: How long to wait for a worker; None uses the pool's `claim_timeout_s`.
    timeout_s: float | None = None
    #: Lease length; None uses the pool's `lease_s`.
    lease_s: float | None = None
    #: hot_idle TTL wanted after release; None falls back to org, pool, 60 s.
    ttl_s: float | None = None
    #: Late-bound config handed to the worker at activation.
    config: Mapping[str, Any] = field(default_factory=dict)
    #: The client's `Idempotency-Key`: a retry with the same key gets the same claim.
    idempotency_key: str | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class SpawnProgress:
    """How a spawned worker that is not ready yet is getting on, as the runtime sees it.

    `stage` is a word for logs: `unschedulable` (no node fits it), `node_coming` (a node
    is nominated for it), `scheduling`, `pulling` (its image), `starting`,
    `image_pull_failing`, `container_failing`, `not_ready` (it runs, its readiness probe
    fails). `waiting`: it waits on the cluster (a node to fit it or on its way, its image),
    so the stuck sweep gives it the pool's `timeouts.pending_s` rather than `spawn_s`.
    `failure`: why it cannot start as it is (reported once as `worker_stalled`); `detail`:
    the cluster's message; `started_at`: when its process started (seconds since the
    epoch), from which `spawn_s` counts again.
    """

    stage: str
    waiting: bool = False
    failure: str | None = None
    detail: str | None = None
    started_at: float | None = None
