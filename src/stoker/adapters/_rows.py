"""What the SQL store adapters share: row <-> record mapping (in the column order of the
tables in `_schema`) and the checks every worker write makes before it reaches a table, so
both adapters refuse the same writes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from stoker.adapters._schema import CLAIMS, FORECAST, WORKERS
from stoker.domain.errors import IllegalTransition
from stoker.domain.records import (
    Claim,
    DemandRecord,
    Instance,
    LeaseRecord,
    Worker,
    token_digest,
)
from stoker.domain.states import (
    LIVE,
    RESERVABLE,
    TERMINAL,
    TRANSITIONS,
    ClaimMode,
    ClaimSource,
    ClaimState,
    WorkerState,
    check_org_change,
    check_transition,
)
from stoker.ports.store import MUTABLE_WORKER_FIELDS, DemandCounts, Fence, SpawnRequest

#: `state IN LIVE_SQL` selects live rows by the state indexes (`state != 'retired'` cannot
#: use them, and reads the whole history).
LIVE_SQL = "(" + ", ".join(f"'{s.value}'" for s in sorted(LIVE)) + ")"

#: Column order of the rows read and written below (the tables are described in `_schema`).
WORKER_COLUMNS = WORKERS.names
CLAIM_COLUMNS = CLAIMS.names
WORKER_SELECT = ", ".join(WORKER_COLUMNS)
CLAIM_SELECT = ", ".join(CLAIM_COLUMNS)


def worker_from_row(row: Sequence[Any]) -> Worker:
    """A `Worker` from a row in `WORKER_COLUMNS` order."""
    (
        id_,
        pool,
        revision,
        state,
        epoch,
        owner,
        created_at,
        updated_at,
        version,
        org,
        claim_id,
        endpoint,
        runtime_ref,
        activated,
        heartbeat_at,
        idle_since,
        ttl_s,
        reason,
    ) = row
    return Worker(
        id=id_,
        pool=pool,
        revision=revision,
        state=WorkerState(state),
        epoch=int(epoch),
        owner=owner,
        created_at=float(created_at),
        updated_at=float(updated_at),
        version=int(version),
        org=org,
        claim_id=claim_id,
        endpoint=endpoint,
        runtime_ref=load_json_object(runtime_ref),
        activated=bool(activated),
        heartbeat_at=float(heartbeat_at),
        idle_since=None if idle_since is None else float(idle_since),
        ttl_s=None if ttl_s is None else float(ttl_s),
        reason=reason,
    )


def worker_to_row(w: Worker) -> tuple[Any, ...]:
    """A row in `WORKER_COLUMNS` order."""
    return (
        w.id,
        w.pool,
        w.revision,
        w.state.value,
        w.epoch,
        w.owner,
        w.created_at,
        w.updated_at,
        w.version,
        w.org,
        w.claim_id,
        w.endpoint,
        dump_json(w.runtime_ref),
        w.activated,
        w.heartbeat_at,
        w.idle_since,
        w.ttl_s,
        w.reason,
    )


def claim_from_row(row: Sequence[Any]) -> Claim:
    """A `Claim` from a row in `CLAIM_COLUMNS` order."""
    (
        id_,
        pool,
        org,
        worker_id,
        worker_epoch,
        source,
        mode,
        state,
        token,
        endpoint,
        lease_s,
        expires_at,
        created_at,
        updated_at,
        owner,
        ttl_s,
        ended_at,
        reason,
        idempotency_key,
        request_digest,
        sealed_token,
    ) = row
    return Claim(
        id=id_,
        pool=pool,
        org=org,
        worker_id=worker_id,
        worker_epoch=int(worker_epoch),
        source=ClaimSource(source),
        mode=ClaimMode(mode),
        state=ClaimState(state),
        token=token,
        endpoint=endpoint,
        lease_s=float(lease_s),
        expires_at=float(expires_at),
        created_at=float(created_at),
        updated_at=float(updated_at),
        owner=owner,
        ttl_s=None if ttl_s is None else float(ttl_s),
        ended_at=None if ended_at is None else float(ended_at),
        reason=reason,
        idempotency_key=idempotency_key,
        request_digest=request_digest,
        sealed_token=sealed_token,
    )


def claim_to_row(c: Claim) -> tuple[Any, ...]:
    """A row in `CLAIM_COLUMNS` order."""
    return (
        c.id,
        c.pool,
        c.org,
        c.worker_id,
        c.worker_epoch,
        c.source.value,
        c.mode.value,
        c.state.value,
        token_digest(c.token),
        c.endpoint,
        c.lease_s,
        c.expires_at,
        c.created_at,
        c.updated_at,
        c.owner,
        c.ttl_s,
        c.ended_at,
        c.reason,
        c.idempotency_key,
        c.request_digest,
        c.sealed_token,
    )


def instance_from_row(row: Sequence[Any]) -> Instance:
    """An `Instance` from `(id, started_at, heartbeat_at, state, meta)`."""
    id_, started_at, heartbeat_at, state, meta = row
    return Instance(
        id=id_,
        started_at=float(started_at),
        heartbeat_at=float(heartbeat_at),
        state=state,
        meta=load_json_object(meta),
    )


def demand_row(counts: DemandCounts) -> tuple[int, int, int]:
    """(misses, waiting, claims) of a replica's published counts (claims 0 when left out)."""
    return (counts[0], counts[1], counts[2] if len(counts) > 2 else 0)


def demand_from_row(row: Sequence[Any]) -> DemandRecord:
    """A `DemandRecord` from `(pool, instance, misses, waiting, updated_at, claims)`."""
    pool, instance, misses, waiting, updated_at, claims = row
    return DemandRecord(pool, instance, int(misses), int(waiting), float(updated_at), int(claims))


def forecast_select(table: str) -> str:
    """Every row of the forecast table `table` (its columns are `ForecastBucket`'s fields,
    in order: `ForecastBucket(*row)`, `dataclasses.astuple(bucket)`)."""
    return f"SELECT {', '.join(FORECAST.names)} FROM {table} ORDER BY pool, level, bucket"


def lease_from_row(row: Sequence[Any]) -> LeaseRecord:
    """A `LeaseRecord` from `(name, holder, epoch, renewed_at, duration_s)`."""
    name, holder, epoch, renewed_at, duration_s = row
    return LeaseRecord(
        name=name,
        holder=holder,
        epoch=int(epoch),
        renewed_at=float(renewed_at),
        duration_s=float(duration_s),
    )


def load_json_object(value: Any) -> dict[str, Any]:
    """A JSON object column: text (SQLite) or jsonb already decoded by the driver (PostgreSQL)."""
    if value is None or value == "":
        return {}
    if isinstance(value, str | bytes | bytearray):
        return dict(json.loads(value))
    return dict(value)


def dump_json(value: Mapping[str, Any]) -> str:
    """Compact, key-sorted JSON (stable bytes for the same value)."""
    return json.dumps(dict(value), sort_keys=True, separators=(",", ":"))


def column_value(name: str, value: Any) -> Any:
    """Convert one mutable field to its column representation."""
    if name == "runtime_ref":
        return dump_json(value)
    if name == "activated":
        return bool(value)
    return value


# -- write checks ----------------------------------------------------------------------------


def check_fields(changes: Mapping[str, Any]) -> None:
    """Raise ValueError unless every changed field is one a transition may set."""
    unknown = set(changes) - MUTABLE_WORKER_FIELDS
    if unknown:
        raise ValueError(f"cannot set worker fields {sorted(unknown)}")


def check_move(expect: WorkerState, to: WorkerState, changes: Mapping[str, Any]) -> None:
    """The checks that need no row: they raise even when the CAS would miss.

    A same-state update of a terminal row is a write to it too, so it is illegal.
    """
    check_fields(changes)
    if to not in TRANSITIONS[expect] and (to is not expect or expect in TERMINAL):
        check_transition(expect, to)


def check_reservable(expect: WorkerState) -> None:
    """Only warm and hot_idle workers are reserved for a claim."""
    if expect not in RESERVABLE:
        raise ValueError(f"cannot reserve a {expect} worker (only {sorted(RESERVABLE)})")


def checked_changes(current: Worker, to: WorkerState, changes: Mapping[str, Any]) -> dict[str, Any]:
    """The checked field changes of moving `current` (as read) to `to` (`stoker.domain.states`).

    Beyond the table and the org rule: a warm worker is neutral (no org), and `activated` is
    set on entering `activating` and never cleared, since a worker that saw an org's data
    must never become warm again (I2). Raises IllegalTransition or ValueError.
    """
    check_move(current.state, to, changes)
    if to is not current.state:
        check_transition(current.state, to, activated=current.activated)
    if "org" in changes:
        check_org_change(current.org, changes["org"], to=to, activated=current.activated)
    out = dict(changes)
    if to is WorkerState.ACTIVATING:
        out.setdefault("activated", True)
    if (current.activated or to is WorkerState.ACTIVATING) and not out.get("activated", True):
        raise IllegalTransition(f"worker {current.id} was activated; that is never undone")
    if to is WorkerState.WARM and out.get("org", current.org) is not None:
        raise IllegalTransition(f"a warm worker is neutral: clear the org of {current.id}")
    return out


def checked_ending_changes(worker_to: WorkerState, changes: Mapping[str, Any]) -> dict[str, Any]:
    """The checked field changes of moving a bound claim's hot worker to `worker_to`,
    without reading the row: a hot worker was activated for the claim's org, and ending the
    claim changes neither (its `claim_id` is cleared). Raises IllegalTransition or
    ValueError, as `checked_changes` would for that row."""
    check_move(WorkerState.HOT, worker_to, changes)
    if worker_to is not WorkerState.HOT:
        check_transition(WorkerState.HOT, worker_to, activated=True)
    if "org" in changes:
        raise IllegalTransition("ending a claim keeps its worker's org")
    if not changes.get("activated", True):
        raise IllegalTransition("a hot worker was activated; that is never undone")
    return {**changes, "claim_id": None}


def fenced(current: Worker, fence: Fence) -> bool:
    """True when the row read is the one a write's compare-and-set expects."""
    return matches(current, fence["expect"], fence["epoch"], fence["version"])


def matches(current: Worker, state: WorkerState, epoch: int, version: int) -> bool:
    """True when the row read is the one a caller's compare-and-set expects."""
    return current.state is state and current.epoch == epoch and current.version == version


def check_ending(state: ClaimState, worker_to: WorkerState, changes: Mapping[str, Any]) -> None:
    """An ended claim's state must be final, and its hot worker's move legal."""
    if state is ClaimState.BOUND:
        raise ValueError("end_claim needs a final claim state")
    check_move(WorkerState.HOT, worker_to, changes)


def may_bind(current: Worker | None, claim: Claim, epoch: int, version: int) -> TypeGuard[Worker]:
    """True when `current` (as read) is the activating worker a bind at `epoch` and
    `version` expects, activated for the claim's org."""
    return (
        current is not None
        and matches(current, WorkerState.ACTIVATING, epoch, version)
        and current.org == claim.org
    )


def holds(current: Worker | None, claim: Claim) -> TypeGuard[Worker]:
    """True when `current` (as read) is the hot worker `claim` is bound to, at its epoch."""
    return (
        current is not None
        and current.state is WorkerState.HOT
        and current.epoch == claim.worker_epoch
        and current.claim_id == claim.id
    )


def check_claim_for(worker_id: str, epoch: int, claim: Claim) -> None:
    """A claim to bind must be bound, and name the worker and the epoch it is bound at."""
    if claim.state is not ClaimState.BOUND:
        raise ValueError(f"claim {claim.id} to bind is {claim.state}, not bound")
    if (claim.worker_id, claim.worker_epoch) != (worker_id, epoch):
        raise ValueError(
            f"claim {claim.id} names worker {claim.worker_id} at epoch {claim.worker_epoch}, "
            f"not {worker_id} at {epoch}"
        )


def spawn_room(
    req: SpawnRequest, n_ids: int, *, pool_live: int, org_live: int, neutral: int
) -> tuple[int, str | None]:
    """How many spawn slots fit, and the limit that stopped the rest (the tightest one).

    `pool_live` and `org_live` count live workers of the pool (and of `req.org`), `neutral`
    the warm and neutral spawning workers of the revision, all read under the adapter's
    serialisation so that two callers cannot both see the same room.
    """
    if req.count < 0:
        raise ValueError(f"spawn count must not be negative, got {req.count}")
    room, limited_by = min(req.count, n_ids), None
    limits: list[tuple[str, int]] = []
    if req.pool_cap > 0:
        limits.append(("pool_cap", req.pool_cap - pool_live))
    if req.org is not None and req.org_cap > 0:
        limits.append(("org_cap", req.org_cap - org_live))
    if req.target is not None:
        limits.append(("target", req.target - neutral))
    for name, left in limits:
        if left < room:
            room, limited_by = max(0, left), name
    return room, limited_by


def spawning_workers(req: SpawnRequest, ids: Sequence[str], now: float) -> list[Worker]:
    """The rows of new spawn slots: `spawning`, epoch 0, the org of a cold spawn or none."""
    return [
        Worker(
            id=worker_id,
            pool=req.pool,
            revision=req.revision,
            state=WorkerState.SPAWNING,
            epoch=0,
            owner=req.owner,
            created_at=now,
            updated_at=now,
            org=req.org,
            heartbeat_at=now,
        )
        for worker_id in ids
    ]
