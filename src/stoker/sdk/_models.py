"""Typed results of the SDK, parsed from the API's JSON answers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


def _time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True, slots=True)
class WorkerRef:
    """The worker serving a claim: where it listens and the session token it demands."""

    id: str
    endpoint: str
    #: Send as `Authorization: Bearer <token>`; None once the claim ended, or when the
    #: pool's workers do not speak the activation protocol.
    token: str | None
    epoch: int


@dataclass(frozen=True, slots=True)
class ClaimInfo:
    """A claim as the server reported it."""

    id: str
    pool: str
    org: str
    #: bound, released, expired or failed.
    state: str
    #: reuse, warm or cold.
    source: str
    mode: str
    worker: WorkerRef
    lease_s: float
    expires_at: datetime
    created_at: datetime
    ended_at: datetime | None
    reason: str | None
    ttl_s: float | None
    #: The JSON body as received.
    raw: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def bound(self) -> bool:
        """True while the session holds the worker."""
        return self.state == "bound"

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ClaimInfo:
        """Parse a claim answer."""
        worker = body["worker"]
        expires_at = _time(body["expires_at"])
        created_at = _time(body["created_at"])
        assert expires_at is not None and created_at is not None
        return cls(
            id=str(body["id"]),
            pool=str(body["pool"]),
            org=str(body["org"]),
            state=str(body["state"]),
            source=str(body["source"]),
            mode=str(body["mode"]),
            worker=WorkerRef(
                id=str(worker["id"]),
                endpoint=str(worker["endpoint"]),
                token=worker.get("token"),
                epoch=int(worker["epoch"]),
            ),
            lease_s=float(body["lease_s"]),
            expires_at=expires_at,
            created_at=created_at,
            ended_at=_time(body.get("ended_at")),
            reason=body.get("reason"),
            ttl_s=_opt_float(body.get("ttl_s")),
            raw=dict(body),
        )


@dataclass(frozen=True, slots=True)
class PoolInfo:
    """A pool's targets, demand, cap and workers by state."""

    name: str
    revision: str
    warm_target: int
    desired_warm: int
    demand: int
    #: 0 = unbounded.
    cap: int
    max_workers_per_org: int
    reuse: str
    counts: Mapping[str, int]

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> PoolInfo:
        """Parse a pool answer."""
        return cls(
            name=str(body["name"]),
            revision=str(body["revision"]),
            warm_target=int(body["warm_target"]),
            desired_warm=int(body["desired_warm"]),
            demand=int(body["demand"]),
            cap=int(body["cap"]),
            max_workers_per_org=int(body["max_workers_per_org"]),
            reuse=str(body["reuse"]),
            counts={str(k): int(v) for k, v in body["counts"].items()},
        )


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One worker as the store records it (admin listing)."""

    id: str
    pool: str
    revision: str
    state: str
    epoch: int
    org: str | None
    claim_id: str | None
    endpoint: str | None
    owner: str
    activated: bool
    created_at: datetime
    updated_at: datetime
    idle_since: datetime | None
    ttl_s: float | None
    reason: str | None

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> WorkerInfo:
        """Parse one worker of `GET /v1/workers`."""
        created_at = _time(body["created_at"])
        updated_at = _time(body["updated_at"])
        assert created_at is not None and updated_at is not None
        return cls(
            id=str(body["id"]),
            pool=str(body["pool"]),
            revision=str(body["revision"]),
            state=str(body["state"]),
            epoch=int(body["epoch"]),
            org=body.get("org"),
            claim_id=body.get("claim_id"),
            endpoint=body.get("endpoint"),
            owner=str(body["owner"]),
            activated=bool(body["activated"]),
            created_at=created_at,
            updated_at=updated_at,
            idle_since=_time(body.get("idle_since")),
            ttl_s=_opt_float(body.get("ttl_s")),
            reason=body.get("reason"),
        )
