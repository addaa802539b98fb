"""Request and response bodies of the HTTP API (docs/concepts/claims.md).

Request models forbid unknown fields and bound every value, so that no input can reach the
control plane in a shape it does not expect. Response models document the answers in the
OpenAPI document; handlers build them with `model_construct` from records that are already
valid, which keeps validation off the hot path.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass
from starlette.responses import Response

from stoker.control.history import PoolSample
from stoker.control.journal import Event, EventKind
from stoker.control.status import PoolStatus
from stoker.domain.records import Claim, Worker, is_minted
from stoker.domain.states import ClaimMode, ClaimSource, ClaimState, WorkerState

#: Largest nesting of the late-bound config (objects and arrays).
CONFIG_MAX_DEPTH = 32
#: Longest name of a pool or an org.
NAME_MAX = 128


def _printable_name(value: str) -> str:
    # Printable unicode is welcome; control characters and lone surrogates are not (the
    # latter cannot even be stored as UTF-8).
    if not value.isprintable() or value != value.strip():
        raise ValueError("must be printable, without leading or trailing spaces")
    return value


def _json_config(value: dict[str, Any]) -> dict[str, Any]:
    """Reject what the worker could not receive: deep nesting, NaN, unencodable strings."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > CONFIG_MAX_DEPTH:
            raise ValueError(f"config nests deeper than {CONFIG_MAX_DEPTH} levels")
        if isinstance(item, dict):
            for key, sub in item.items():
                _encodable(key)
                stack.append((sub, depth + 1))
        elif isinstance(item, list):
            stack.extend((sub, depth + 1) for sub in item)
        elif isinstance(item, str):
            _encodable(item)
        elif isinstance(item, float) and not math.isfinite(item):
            raise ValueError("config numbers must be finite")
    return value


def _encodable(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("config strings must be valid unicode (no lone surrogates)") from None


Name = Annotated[str, Field(min_length=1, max_length=NAME_MAX), AfterValidator(_printable_name)]
ClaimConfig = Annotated[dict[str, Any], AfterValidator(_json_config)]


class _Request(BaseModel):
    """A request body: unknown keys are errors, and numbers must be JSON numbers (strict:
    `true` or `"5"` is a 422, not a 1 s lease or a 5 s timeout)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ClaimCreate(_Request):
    """`POST /v1/claims`."""

    pool: Name
    org: Name
    mode: ClaimMode = ClaimMode.PREFER_WARM
    #: Longest wait for a worker; default: the pool's claim_timeout_s.
    timeout_s: float | None = Field(None, ge=0, le=3600, strict=True)
    #: Lease length; default: the pool's lease_s.
    lease_s: float | None = Field(None, ge=1, le=86400, strict=True)
    #: hot_idle TTL wanted after release; default: org, then pool, then 60 s.
    ttl_s: float | None = Field(None, ge=0, le=86400, strict=True)
    #: Late-bound config handed to the worker at activation.
    config: ClaimConfig = Field(default_factory=dict)


class ClaimRenew(_Request):
    """`POST /v1/claims/{id}/renew`: a new lease length (default: the claim's own)."""

    lease_s: float | None = Field(None, ge=1, le=86400, strict=True)


# -- responses ------------------------------------------------------------------------------


class ModelResponse(Response):
    """An `application/json` answer whose body is a response model.

    The model is serialized by pydantic, not validated again, and the headers are built
    here rather than by `Response.__init__`'s general path: this is the answer to every
    claim and release.
    """

    media_type = "application/json"

    def __init__(
        self, body: BaseModel, status_code: int = 200, location: str | None = None
    ) -> None:
        self.status_code = status_code
        self.background = None
        self.body = body.model_dump_json().encode()
        self.raw_headers = [
            (b"content-length", str(len(self.body)).encode()),
            (b"content-type", b"application/json"),
        ]
        if location is not None:
            self.raw_headers.append((b"location", location.encode("latin-1")))


@functools.lru_cache(maxsize=4096)
def timestamp(seconds: float) -> str:
    """RFC 3339 UTC with milliseconds."""
    # Cached: a claim's creation and expiry are rendered again by its renewal and release.
    text = datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z")


def optional_timestamp(seconds: float | None) -> str | None:
    """`timestamp`, or None for None."""
    return None if seconds is None else timestamp(seconds)


class WorkerRef(BaseModel):
    """The worker serving a claim."""

    id: str
    endpoint: str
    #: Session credential the worker demands (`Authorization: Bearer <token>`), in the
    #: answer to the claim only: the server keeps only its digest, so any later read of the
    #: claim (get, renew, release) has null, as do pools with `activation: none`.
    token: str | None
    epoch: int


class ClaimOut(BaseModel):
    """A claim: the session's lease on one worker."""

    id: str
    pool: str
    org: str
    state: ClaimState
    source: ClaimSource
    mode: ClaimMode
    worker: WorkerRef
    lease_s: float
    expires_at: str
    created_at: str
    ended_at: str | None
    reason: str | None
    ttl_s: float | None

    @classmethod
    def of(cls, claim: Claim, *, new: bool = False) -> ClaimOut:
        """The response body of `claim`; `new`: the answer to the claim, with its token."""
        bound = new and claim.state is ClaimState.BOUND and is_minted(claim.token)
        return cls.model_construct(
            id=claim.id,
            pool=claim.pool,
            org=claim.org,
            state=claim.state,
            source=claim.source,
            mode=claim.mode,
            worker=WorkerRef.model_construct(
                id=claim.worker_id,
                endpoint=claim.endpoint,
                token=claim.token if bound else None,
                epoch=claim.worker_epoch,
            ),
            lease_s=claim.lease_s,
            expires_at=timestamp(claim.expires_at),
            created_at=timestamp(claim.created_at),
            ended_at=optional_timestamp(claim.ended_at),
            reason=claim.reason,
            ttl_s=claim.ttl_s,
        )


def _fields(model: type[BaseModel], record: object, **converted: Any) -> dict[str, Any]:
    """The values of `model`'s fields, read by name from `record` except those `converted`
    (admin views, which show a record as it is: one list of names, the model's)."""
    return {
        name: converted[name] if name in converted else getattr(record, name)
        for name in model.model_fields
    }


# The fields are `PoolStatus`'s, declared once there; this subclass gives them the name and
# the description the OpenAPI document shows.
@pydantic_dataclass(frozen=True)
class PoolOut(PoolStatus):
    """A pool's targets, demand and workers by state."""


class WorkerOut(BaseModel):
    """One worker as the store records it (admin view)."""

    id: str
    pool: str
    revision: str
    state: WorkerState
    epoch: int
    org: str | None
    claim_id: str | None
    endpoint: str | None
    owner: str
    activated: bool
    created_at: str
    updated_at: str
    idle_since: str | None
    ttl_s: float | None
    reason: str | None

    @classmethod
    def of(cls, worker: Worker) -> WorkerOut:
        """The response body of one worker."""
        return cls.model_construct(
            **_fields(
                cls,
                worker,
                created_at=timestamp(worker.created_at),
                updated_at=timestamp(worker.updated_at),
                idle_since=optional_timestamp(worker.idle_since),
            )
        )


class WorkerList(BaseModel):
    """`GET /v1/workers`."""

    workers: list[WorkerOut]
    next: str | None = Field(
        default=None, description="On a full page: `after` for the next one (it may be empty)."
    )


class ClaimList(BaseModel):
    """`GET /v1/claims`."""

    claims: list[ClaimOut]
    next: str | None = Field(
        default=None, description="On a full page: `after` for the next one (it may be empty)."
    )


class EventOut(BaseModel):
    """One event this replica recorded: a spawn, a retirement (with its reason) or a
    failure (`detail`: the error)."""

    seq: int
    at: str
    kind: EventKind
    pool: str | None
    worker: str | None
    org: str | None
    reason: str | None
    detail: str | None

    @classmethod
    def of(cls, event: Event) -> EventOut:
        """The response body of one event."""
        return cls.model_construct(**_fields(cls, event, at=timestamp(event.at)))


class EventList(BaseModel):
    """`GET /v1/events`: newest first; `replica`: the server that recorded them."""

    replica: str
    events: list[EventOut]


class PoolHistory(BaseModel):
    """`GET /v1/history`: each pool's samples over the last hour, oldest first."""

    replica: str
    interval_s: float
    now: float
    pools: dict[str, list[PoolSample]]

    @classmethod
    def of(
        cls, replica: str, interval_s: float, now: float, pools: Mapping[str, list[PoolSample]]
    ) -> PoolHistory:
        """The response body of the history."""
        return cls.model_construct(
            replica=replica,
            interval_s=interval_s,
            now=now,
            pools={name: list(samples) for name, samples in pools.items()},
        )


class Health(BaseModel):
    """`GET /healthz` when the process runs."""

    status: str
    #: The version of stoker this replica runs (`stoker version`).
    version: str


class DegradedPool(BaseModel):
    """A pool in trouble that `/readyz` reports (the replica still serves the others)."""

    pool: str
    #: `pass_failing`: the janitor's (or reaper's) step for the pool failed pass after
    #: pass; `spawn_failing`: the spawns of one of its revisions keep failing.
    problem: Literal["pass_failing", "spawn_failing"]
    #: Passes failed in a row, or spawns failed since the revision's spawns last worked.
    in_a_row: int
    #: The last error.
    detail: str
    #: The revision whose spawns fail (`spawn_failing` only).
    revision: str | None = None


class Readiness(BaseModel):
    """`GET /readyz` when the replica serves claims: `ready`, or `degraded` while some pools
    are in trouble (listed in `degraded`; a load balancer keeps the replica, an operator
    reads why)."""

    status: Literal["ready", "degraded"]
    degraded: list[DegradedPool] = []


class FieldError(BaseModel):
    """One reason a request body or parameter was rejected."""

    loc: list[str | int]
    msg: str
    type: str


class Problem(BaseModel):
    """An RFC 9457 problem: every error answer of the API."""

    type: str
    title: str
    status: int
    detail: str
    #: Stable machine-readable code (the last segment of `type`).
    code: str
    #: 503: why no worker came (`no_capacity`, `pool_cap`, `shutting_down`, ...).
    reason: str | None = None
    #: 429: seconds after which a retry may succeed (also in the `Retry-After` header).
    retry_after: float | None = None
    #: 422: what was wrong with which field.
    errors: list[FieldError] | None = None
