"""The Store port: durable state of workers, claims, replicas and leases.

The store is the authority. Every worker write is a compare-and-set on the row's
`version`, which every write bumps (so two writers from one read cannot both win, even
when neither changes the state), besides `(id, state, epoch)`, and is checked against the
transition table; a CAS that misses returns None and changes nothing. `epoch` is the
fencing token of activations: only a reservation bumps it. Terminal rows are never written
again. Times are passed in by the caller (SQL never reads a clock), so the store runs
unchanged on virtual time.

The port has sides: `StoreReader` (gets, lists, counts), `StoreWriter` (every write of a
worker or a claim, held by the lifecycle alone) and `ReplicaStore` (the reader plus what a
replica writes about itself: registration, leases, demand, the leader's sizing of each
pool, purge; and the writes of stored pools, each a compare-and-set on the pool's
generation). `Store` is all of them, what an adapter implements.

Adapters: `stoker.adapters.sqlite` and `stoker.adapters.postgres`; both pass the contract
suite in `tests/store_contract.py`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, Protocol, TypedDict, Unpack, runtime_checkable

from stoker.domain.ledger import ClaimEnding, ClaimLogEntry, LedgerCounts, LedgerKey
from stoker.domain.pools import DeletedPool, Rollout, StoredPool, StoredRevision
from stoker.domain.records import (
    Claim,
    DemandRecord,
    ForecastBucket,
    Instance,
    LeaseRecord,
    OrgForecastBucket,
    PoolSizingRecord,
    Worker,
)
from stoker.domain.specs import RuntimeTemplate
from stoker.domain.states import ClaimState, WorkerState

#: One replica's demand counters of one pool: (cumulative misses, claims waiting now) and,
#: optionally, cumulative claims that wanted a neutral worker.
DemandCounts = tuple[int, int] | tuple[int, int, int]

#: Fields of a worker row that a transition may set besides `state`.
MUTABLE_WORKER_FIELDS = frozenset(
    {
        "org",
        "owner",
        "claim_id",
        "endpoint",
        "runtime_ref",
        "activated",
        "heartbeat_at",
        "idle_since",
        "ttl_s",
        "reason",
    }
)


class Fence(TypedDict):
    """A worker as its writer last read it: the compare-and-set of a write (its state,
    epoch and row version)."""

    expect: WorkerState
    epoch: int
    version: int


class Move(Fence):
    """A transition from the `Fence` to `to` at `now`, setting `changes` (fields of
    `MUTABLE_WORKER_FIELDS`); `bump_epoch` bumps the epoch too."""

    to: WorkerState
    now: float
    bump_epoch: NotRequired[bool]
    changes: NotRequired[Mapping[str, Any] | None]


class Reservation(TypedDict):
    """Whom a worker in state `expect` is reserved for: `org`, within `org_cap` live
    workers of its pool (0: no cap), owned by replica `owner`; `activate` lets the store
    move it on to `activating` in the same write."""

    expect: WorkerState
    org: str
    org_cap: int
    owner: str
    activate: NotRequired[bool]


class FencedReservation(Reservation):
    """A `Reservation` of one worker as last read (its `epoch` and row `version`)."""

    epoch: int
    version: int


class ParkedOrAny(Reservation):
    """A reservation of a warm worker that a worker the org parked goes before: the pool
    and the revisions (in order) where the store looks for one."""

    pool: str
    revisions: Sequence[str]


class ParkedOrWarm(ParkedOrAny):
    """A `ParkedOrAny` naming its warm worker as last read (its `epoch`, row `version` and
    `revision`)."""

    epoch: int
    version: int
    revision: str


class WorkerQuery(TypedDict, total=False):
    """The filters of `list_workers`: each one given (and not None) narrows the list."""

    pool: str | None
    states: Collection[WorkerState] | None
    org: str | None
    owner: str | None
    #: Rows owned by none of these replicas (or by none).
    not_owners: Collection[str] | None
    #: Only rows after this `(created_at, id)` in listing order: the next page.
    after: tuple[float, str] | None
    limit: int | None


class ClaimQuery(TypedDict, total=False):
    """The filters of `list_claims`: each one given (and not None) narrows the list."""

    states: Collection[ClaimState] | None
    #: Inclusive.
    expires_before: float | None
    owner: str | None
    #: Only claims after this `(created_at, id)` in listing order: the next page.
    after: tuple[float, str] | None
    limit: int | None


class Ending(TypedDict):
    """How `end_claim` ends a bound claim: in `state` at `now` for `reason`, its hot
    worker moved to `worker_to` with `worker_changes`."""

    state: ClaimState
    worker_to: WorkerState
    now: float
    reason: NotRequired[str | None]
    worker_changes: NotRequired[Mapping[str, Any] | None]


def fence(worker: Worker) -> Fence:
    """The compare-and-set of a write to `worker` as read."""
    return {"expect": worker.state, "epoch": worker.epoch, "version": worker.version}


@dataclass(frozen=True, slots=True)
class SpawnRequest:
    """Spawn slots to reserve atomically against the pool and org caps."""

    pool: str
    revision: str
    count: int
    owner: str
    #: Set for a cold spawn on behalf of one org's claim; None for a neutral warm spawn.
    org: str | None = None
    #: Live workers allowed in the pool (0 = unbounded).
    pool_cap: int = 0
    #: Live workers allowed per org in the pool (0 = unbounded).
    org_cap: int = 0
    #: For neutral spawns: fill only up to this many warm + neutral spawning workers of the
    #: revision, so two reconcilers acting at once cannot overshoot a target (I7).
    target: int | None = None


@dataclass(frozen=True, slots=True)
class SpawnResult:
    """Slots reserved, and which limit stopped the rest (None when all were reserved)."""

    workers: list[Worker]
    limited_by: str | None = None


@dataclass(frozen=True, slots=True)
class ReserveResult:
    """Outcome of reserving a warm or hot_idle worker for a claim."""

    worker: Worker | None
    #: True when nothing was reserved because the org is at its cap.
    at_org_cap: bool = False
    #: True when the worker reserved was parked (hot_idle) rather than warm.
    parked: bool = False


@dataclass(frozen=True, slots=True)
class StateCount:
    """Number of live workers of one pool, revision, state and binding."""

    pool: str
    revision: str
    state: WorkerState
    bound: bool
    count: int


class StoreReader(Protocol):
    """The reading side: gets, lists and counts. Every control part but the lifecycle
    sees the store through this side (or `ReplicaStore`), never the writer."""

    async def schema_version(self) -> int:
        """The applied schema version."""
        ...

    async def get_worker(self, worker_id: str) -> Worker | None:
        """One worker row, terminal or not."""
        ...

    async def list_workers(self, **query: Unpack[WorkerQuery]) -> list[Worker]:
        """Rows matching every filter given, oldest first.

        `not_owners` keeps rows whose owner is none of these (or no owner at all): the
        janitor finds the workers of dead replicas without reading everyone else's.
        """
        ...

    async def count_workers(self) -> list[StateCount]:
        """Counts of live workers grouped by pool, revision, state and binding."""
        ...

    async def get_claim(self, claim_id: str) -> Claim | None:
        """One claim."""
        ...

    async def claim_by_key(self, org: str, idempotency_key: str) -> Claim | None:
        """The org's claim stored with `idempotency_key` (the digest of the client's
        `Idempotency-Key`), whatever its state; None when there is none."""
        ...

    async def list_claims(self, **query: Unpack[ClaimQuery]) -> list[Claim]:
        """Claims matching every filter given, oldest first."""
        ...

    async def list_instances(self) -> list[Instance]:
        """All replicas the store knows."""
        ...

    async def get_lease(self, name: str) -> LeaseRecord | None:
        """The lease as stored."""
        ...

    async def read_demand(self) -> list[DemandRecord]:
        """Every replica's last published demand."""
        ...

    async def read_sizing(self) -> list[PoolSizingRecord]:
        """Each pool's sizing as the leader last published it, by pool."""
        ...

    # -- stored pools (`stoker.domain.pools`) -------------------------------------------------

    async def list_pools(self) -> list[StoredPool]:
        """Every stored pool, by name, each at its stable revision."""
        ...

    async def get_pool(self, name: str) -> StoredPool | None:
        """One stored pool."""
        ...

    async def pool_generations(self) -> dict[str, int]:
        """Each stored pool's generation: the cheap read that tells a replica whether to read
        the pools again."""
        ...

    async def list_revisions(self, pool: str) -> list[StoredRevision]:
        """The templates the pool has had, oldest first."""
        ...

    async def get_rollout(self, rollout_id: str) -> Rollout | None:
        """One rollout, active or ended."""
        ...

    async def list_rollouts(self, *, pool: str | None = None) -> list[Rollout]:
        """The pool's rollouts, oldest first; without `pool`, every pool's *active* ones."""
        ...

    async def read_outcomes(self, rollout_ids: Sequence[str]) -> dict[str, dict[str, int]]:
        """Every replica's outcome counts of the rollouts `rollout_ids`, summed: rollout id
        -> outcome -> count (a rollout nobody counted for is left out)."""
        ...

    async def read_forecast(self) -> list[ForecastBucket]:
        """Every pool's learned forecast buckets."""
        ...

    async def read_org_forecast(self) -> list[OrgForecastBucket]:
        """Every pool's learned per-org forecast buckets, by pool, org and bucket."""
        ...

    async def claims_by_org(self, *, since: float, before: float) -> list[tuple[str, str, int]]:
        """(pool, org, claims) for the claims created in [`since`, `before`), whatever
        became of them, by pool and org (the per-org forecast learns from them)."""
        ...


class StoreWriter(Protocol):
    """The writing side: every write of a worker or a claim. Only
    `stoker.control.lifecycle` holds it (tests/control/test_store_writer_rule.py checks).
    """

    # -- workers --------------------------------------------------------------------------

    async def reserve_spawn_slots(
        self, req: SpawnRequest, ids: Sequence[str], now: float
    ) -> SpawnResult:
        """Insert up to `req.count` `spawning` rows (ids taken in order) within the caps.

        Fewer rows than asked when a cap or the target stops it (`limited_by` is then
        "pool_cap", "org_cap" or "target"). Two callers at once can never together exceed
        a cap or a target (I5, I7).
        """
        ...

    async def transition(self, worker_id: str, **move: Unpack[Move]) -> Worker | None:
        """CAS `(id, expect, epoch, version)` -> `to` with `changes`; None on a miss.

        Raises `IllegalTransition` for a move the table forbids. `to == expect` updates
        fields without a state change (adoption, endpoint, heartbeat); it bumps the version
        too, so of two such writes from one read only the first lands.
        """
        ...

    async def reserve(
        self, worker_id: str, *, now: float, **by: Unpack[FencedReservation]
    ) -> ReserveResult:
        """CAS a `warm` or `hot_idle` worker (`expect`, `epoch`, `version` as read) to
        `reserved` for `org`, bumping its epoch.

        A warm worker is reserved only while the org holds fewer than `org_cap` live workers
        of its pool; a hot_idle worker must already belong to `org`.

        With `activate`, a store may also move the reserved worker on to `activating`
        (`activated` set, `heartbeat_at` stamped, epoch unchanged) in the same write: the
        result's worker is then `activating`, else `reserved`, and the caller makes that
        move itself.
        """
        ...

    async def reserve_any(
        self, pool: str, revision: str, *, now: float, **by: Unpack[Reservation]
    ) -> ReserveResult:
        """Like `reserve`, for any matching worker of the pool revision (one round trip);
        the CAS is on the version the store reads as it picks."""
        ...

    # -- claims ---------------------------------------------------------------------------

    async def bind(
        self, worker_id: str, *, epoch: int, version: int, claim: Claim, now: float
    ) -> Worker | None:
        """Atomically move an `activating` worker (at `epoch` and `version`) to `hot` and
        insert its bound claim. Raises `ClaimKeyTaken` (and changes nothing) when the org
        has a claim with the claim's `idempotency_key` already."""
        ...

    async def end_claim(self, claim_id: str, **end: Unpack[Ending]) -> tuple[Claim, Worker] | None:
        """Atomically end a bound claim and move its `hot` worker to `worker_to`.

        None when the claim is not bound any more or its worker is not the claim's hot
        worker at the claim's epoch (then nothing changes). The claim is the fence: the
        worker write compares the version read with the claim, under its lock.
        """
        ...

    async def renew_claim(self, claim_id: str, *, expires_at: float, now: float) -> Claim | None:
        """Extend a bound claim's lease; None if it is not bound."""
        ...


class ReplicaStore(StoreReader, Protocol):
    """What a replica's own loops write besides workers and claims: its connection,
    its registration and heartbeat, leases, demand rows, the leader's sizing of each pool
    and the history purge."""

    async def open(self) -> None:
        """Connect and apply pending schema migrations (safe from several replicas at once)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...

    # -- replicas and leases ----------------------------------------------------------------

    async def register_instance(
        self, instance_id: str, *, now: float, meta: Mapping[str, Any]
    ) -> None:
        """Record a new replica as active."""
        ...

    async def heartbeat_instance(self, instance_id: str, *, now: float) -> bool:
        """Stamp a replica's heartbeat; False if it was expired meanwhile."""
        ...

    async def expire_instances(
        self, *, before: float, now: float, keep: str | None = None
    ) -> list[str]:
        """Mark active replicas whose heartbeat is older than `before` expired; their ids.

        `keep` is never expired: a replica whose loop was busy past the expiry must not
        declare itself dead when its own janitor runs before its heartbeat does.
        """
        ...

    async def stop_instance(self, instance_id: str, *, now: float) -> None:
        """Mark a replica stopped on a clean shutdown."""
        ...

    async def acquire_lease(
        self, name: str, *, holder: str, now: float, duration_s: float
    ) -> LeaseRecord | None:
        """Take or renew a lease by CAS: free, expired or already ours. None if held by another.

        Taking the lease from another holder bumps its epoch (the fencing token).
        """
        ...

    async def release_lease(self, name: str, *, holder: str, now: float) -> bool:
        """Give a lease up if we hold it."""
        ...

    # -- demand and housekeeping -------------------------------------------------------------

    async def record_demand(
        self, instance_id: str, demand: Mapping[str, DemandCounts], *, now: float
    ) -> None:
        """Publish this replica's demand per pool: (cumulative misses, claims waiting now,
        cumulative claims that wanted a neutral worker; 0 when left out).

        The leader's janitor reads every replica's rows, so the claims of any replica
        make the pool's demand rate (`stoker.policy.demand`).
        """
        ...

    async def record_sizing(self, sizings: Sequence[PoolSizingRecord]) -> None:
        """Publish the leader's last sizing of each pool in `sizings`, in one write: each
        replaces the pool's row, whoever wrote it (every replica's pool listing reads them,
        `read_sizing`)."""
        ...

    async def record_outcomes(
        self, instance_id: str, counts: Mapping[str, Mapping[str, int]], *, now: float
    ) -> None:
        """Publish this replica's cumulative outcome counts of rollouts' revisions (rollout
        id -> outcome -> count), replacing its earlier ones: the leader's verdict sums every
        replica's (`read_outcomes`)."""
        ...

    # -- stored pools: every write compares and bumps the pool's generation ------------------

    async def create_pool(self, pool: StoredPool, *, now: float) -> StoredPool | None:
        """Insert a pool at generation 1 with its stable revision's row; None (and nothing
        written) when the store has the pool already: of two replicas seeding it, one wins."""
        ...

    async def update_pool(self, pool: StoredPool, *, now: float) -> StoredPool:
        """Write `pool`'s settings, default strategy and draining flag, by CAS on
        `pool.generation`; the pool as stored after. The stable revision changes only with a
        rollout. Raises `StaleGeneration` when the pool moved on, `NotFound` when it is gone.
        """
        ...

    async def start_rollout(
        self, rollout: Rollout, template: RuntimeTemplate, *, generation: int, now: float
    ) -> StoredPool:
        """One write, by CAS on the pool's `generation`: record the revision's `template`
        (kept if known), end the pool's active rollout as `superseded`, insert `rollout`
        and, when it starts `promoted` (a replace), make its revision the stable one. The
        pool as stored after; `StaleGeneration` or `NotFound` like `update_pool`."""
        ...

    async def update_rollout(self, rollout: Rollout, *, generation: int, now: float) -> StoredPool:
        """One write, by CAS on the pool's `generation`: the rollout's state, step, share,
        times and reason and, when it is `promoted`, its revision as the pool's stable one.
        `NotFound` when the pool is gone; `StaleGeneration` when it moved on."""
        ...

    async def delete_pool(self, name: str, *, generation: int | None = None) -> DeletedPool:
        """Delete a pool in one transaction that checks, under the pool's lock, that it may
        go (`stoker.domain.pools.check_deletable`): `NotFound` when there is no such pool,
        `StaleGeneration` when it is not at `generation` (None: any), `PoolInUse` when it is
        not draining, rolls out, or has live workers or bound claims; then nothing is
        deleted. Else its row, revisions, rollouts and their outcome counts, forecast and
        per-org forecast buckets, published sizing and every replica's demand rows go. The
        ledger, the claim log, retired workers and ended claims stay: history, with its own
        retention."""
        ...

    async def record_forecast(self, buckets: Sequence[ForecastBucket]) -> None:
        """Insert or replace forecast buckets (by pool, level and bucket)."""
        ...

    async def record_org_forecast(
        self, buckets: Sequence[OrgForecastBucket], *, drop: Sequence[tuple[str, str]] = ()
    ) -> None:
        """In one write: delete every bucket of the (pool, org) pairs in `drop` (orgs no
        longer forecast), then insert or replace `buckets` (by pool, org and bucket)."""
        ...

    # -- the ledger and the claim log (docs/warmth.md, docs/claim-log.md) --------------------

    async def record_ledger(
        self, instance_id: str, cells: Mapping[LedgerKey, LedgerCounts], *, now: float
    ) -> bool:
        """Publish this replica's cumulative counts of ledger cells, replacing its earlier
        ones of the same cells: a failed write loses nothing, the next one writes them again.

        False, and nothing written, when the replica's registration is no longer active
        (expired or stopped; checked in the same transaction): its workers are adopted or
        retired by others, who count them from its last write (`ledger_written_at`) on, so
        a replica that outlives its expiry never counts their time a second time. A replica
        the store has no registration of writes as an active one."""
        ...

    async def read_ledger(
        self, pool: str, *, since: float, until: float
    ) -> list[tuple[LedgerKey, LedgerCounts]]:
        """Every replica's cells of `pool` whose hour starts before `until` and ends after
        `since`, unsummed (one per cell and replica), by hour."""
        ...

    async def ledger_written_at(self, instance_id: str) -> float | None:
        """When replica `instance_id` last wrote its ledger cells (the `now` of that write;
        every span it had open is counted up to there), or None if it never did."""
        ...

    async def first_takes(self, since: Sequence[tuple[str, float]]) -> list[float | None]:
        """For each (worker id, time) of `since`, in order, the first change of the worker's
        owner after that time (a replica took it for a claim, or adopted it: the `taken_at`
        that move stamped), or None if its owner did not change since. Changes older than
        the history's retention (`purge`) are forgotten."""
        ...

    async def record_claim_log(
        self, arrivals: Sequence[ClaimLogEntry], endings: Sequence[ClaimEnding]
    ) -> None:
        """Write claims' log rows: an arrival sets the row's arrival, mode, source, wait and
        revision (and its outcome only while the row has no ending); an ending sets its
        hold and outcome. Either may come first, from any replica."""
        ...

    async def read_claim_log(
        self,
        *,
        since: float,
        until: float,
        pool: str | None = None,
        after: tuple[float, str] | None = None,
        limit: int = 1000,
    ) -> list[ClaimLogEntry]:
        """Up to `limit` log rows that arrived in [`since`, `until`) (of `pool` if given), by
        arrival and id, after the `(at, id)` `after` if given: the next page."""
        ...

    async def purge_ledger(self, *, before: float, limit: int) -> int:
        """Delete at most `limit` rows in all of ledger cells whose hour ended by `before`
        and claim log rows that arrived before it; the rows deleted."""
        ...

    async def purge(self, *, before: float) -> int:
        """Delete history older than `before`: retired workers, ended claims, the rows of
        stopped or expired replicas and their demand, the outcome counts of rollouts that
        ended, pools' sizings published before it, workers' changes of owner. Returns the
        rows deleted."""
        ...


class Store(ReplicaStore, StoreWriter, Protocol):
    """Durable state, both sides: what an adapter implements. See the module docstring
    for the rules every adapter keeps."""


@runtime_checkable
class ParkedFirst(Protocol):
    """A store whose round trips cost (PostgreSQL) that looks for a worker an org parked
    and reserves a given warm worker when there is none, in one write."""

    async def reserve_parked_or(
        self, worker_id: str, *, now: float, **by: Unpack[ParkedOrWarm]
    ) -> ReserveResult:
        """Reserve, as `reserve_any` with `expect` hot_idle, the worker `org` parked at the
        first of `revisions` that has one; when there is none, reserve the warm worker
        `worker_id` of `pool` as `reserve` does (`by` is its fence and `org_cap`). The
        result's worker is either, told apart by `parked` (not by the id: a book's warm
        worker may since have been parked by the same org)."""
        ...

    async def reserve_parked_or_any(
        self, revision: str, *, now: float, **by: Unpack[ParkedOrAny]
    ) -> ReserveResult:
        """As `reserve_parked_or`, but when `org` parked none, reserve any warm worker of
        `pool` at `revision` as `reserve_any` does (no org cap: `org_cap` must be 0)."""
        ...


@runtime_checkable
class WorkerFeed(Protocol):
    """A store that announces its worker changes as they commit (PostgreSQL: LISTEN/NOTIFY):
    every row that becomes claimable (PostgreSQL: `warm`), whoever wrote it."""

    async def follow_workers(
        self,
        on_worker: Callable[[Worker], None],
        on_listening: Callable[[], Awaitable[None]],
        on_lost: Callable[[], None],
    ) -> None:
        """Hand every announced row to `on_worker` until cancelled, reconnecting after a
        failure; await `on_listening` each time it listens (again), before any row it
        announces, and call `on_lost` when the connection failed."""
        ...
