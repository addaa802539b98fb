"""Row <-> record mapping shared by the SQL store adapters (column order lives here)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from stoker.domain.records import Claim, Instance, LeaseRecord, Worker
from stoker.domain.states import ClaimMode, ClaimSource, ClaimState, WorkerState

WORKER_COLUMNS = (
    "id",
    "pool",
    "revision",
    "state",
    "epoch",
    "owner",
    "created_at",
    "updated_at",
    "org",
    "claim_id",
    "endpoint",
    "runtime_ref",
    "activated",
    "heartbeat_at",
    "idle_since",
    "ttl_s",
    "reason",
)
CLAIM_COLUMNS = (
    "id",
    "pool",
    "org",
    "worker_id",
    "worker_epoch",
    "source",
    "mode",
    "state",
    "token",
    "endpoint",
    "lease_s",
    "expires_at",
    "created_at",
    "updated_at",
    "owner",
    "ttl_s",
    "ended_at",
    "reason",
)
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
        org=org,
        claim_id=claim_id,
        endpoint=endpoint,
        runtime_ref=json.loads(runtime_ref) if runtime_ref else {},
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
        c.token,
        c.endpoint,
        c.lease_s,
        c.expires_at,
        c.created_at,
        c.updated_at,
        c.owner,
        c.ttl_s,
        c.ended_at,
        c.reason,
    )


def instance_from_row(row: Sequence[Any]) -> Instance:
    """An `Instance` from `(id, started_at, heartbeat_at, state, meta)`."""
    id_, started_at, heartbeat_at, state, meta = row
    return Instance(
        id=id_,
        started_at=float(started_at),
        heartbeat_at=float(heartbeat_at),
        state=state,
        meta=json.loads(meta) if meta else {},
    )


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
