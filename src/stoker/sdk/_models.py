"""Typed results of the SDK, read from the API's JSON answers.

Each result is a dataclass whose field types say how its JSON member is read (`_decode`),
so a field is declared once, not again in a parser.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import datetime
from typing import Any, Self, TypeVar

T = TypeVar("T")

#: Reads one member of a JSON object.
Reader = Callable[[Mapping[str, Any], str], Any]


def _time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _required_time(body: Mapping[str, Any], key: str) -> datetime:
    value = _time(body[key])
    assert value is not None, key
    return value


def _optional_float(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    return None if value is None else float(value)


def _counts(body: Mapping[str, Any], key: str) -> dict[str, int]:
    return {str(k): int(v) for k, v in body[key].items()}


#: How a member is read, by the field's type: a required one must be present and is
#: converted; an optional one may be absent, and strings are taken as they are.
_READERS: dict[object, Reader] = {
    str: lambda body, key: str(body[key]),
    int: lambda body, key: int(body[key]),
    float: lambda body, key: float(body[key]),
    bool: lambda body, key: bool(body[key]),
    datetime: _required_time,
    str | None: lambda body, key: body.get(key),
    float | None: _optional_float,
    datetime | None: lambda body, key: _time(body.get(key)),
    Mapping[str, int]: _counts,
    Mapping[str, Any]: lambda body, key: dict(body[key]),
    int | None: lambda body, key: body.get(key),
    bool | None: lambda body, key: body.get(key),
    tuple[Mapping[str, Any], ...]: lambda body, key: tuple(dict(r) for r in body.get(key) or ()),
}


def _whole_body(body: Mapping[str, Any], key: str) -> dict[str, Any]:
    return dict(body)


def _plan(cls: type[Any]) -> tuple[tuple[str, Reader], ...]:
    """Each field of `cls` with its reader."""
    hints = typing.get_type_hints(cls)
    plan: list[tuple[str, Reader]] = []
    for member in fields(cls):
        hint = hints[member.name]
        reader = _READERS.get(hint)
        if member.metadata.get("whole_body"):
            reader = _whole_body
        elif reader is None and isinstance(hint, type) and is_dataclass(hint):
            # A nested result (the claim's worker) is read by its own plan.
            reader = functools.partial(_nested, hint)
        elif reader is None:
            raise TypeError(f"no reader for {cls.__name__}.{member.name}: {hint}")
        plan.append((member.name, reader))
    return tuple(plan)


def _nested(cls: type[Any], body: Mapping[str, Any], key: str) -> Any:
    return _decode(cls, body[key])


def _decode(cls: type[T], body: Mapping[str, Any]) -> T:
    """A `cls` read from a JSON object, field by field as its types say."""
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _plan(cls)
    return cls(**{name: read(body, name) for name, read in plan})


#: The plan of each result type, worked out on its first answer.
_PLANS: dict[type[Any], tuple[tuple[str, Reader], ...]] = {}


class Result:
    """Base of the typed results: each is read from its JSON answer by `from_json`."""

    __slots__ = ()

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Self:
        """Parse an answer (a JSON object) into this result."""
        return _decode(cls, body)


@dataclass(frozen=True, slots=True)
class Answer(Result):
    """A result that is a whole answer: it keeps the JSON body it was read from in `raw`
    (a keyword, after the fields of the subclass)."""

    #: The JSON body as received.
    raw: Mapping[str, Any] = field(
        repr=False,
        compare=False,
        default_factory=dict,
        kw_only=True,
        metadata={"whole_body": True},
    )


@dataclass(frozen=True, slots=True)
class WorkerRef(Result):
    """The worker serving a claim: where it listens and the session token it demands."""

    id: str
    endpoint: str
    #: Send as `Authorization: Bearer <token>`; None once the claim ended, or when the
    #: pool's workers do not speak the activation protocol.
    token: str | None
    epoch: int


@dataclass(frozen=True, slots=True)
class ClaimInfo(Answer):
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

    @property
    def bound(self) -> bool:
        """True while the session holds the worker."""
        return self.state == "bound"


@dataclass(frozen=True, slots=True)
class PoolInfo(Answer):
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
    #: The stored pool's generation, what `update_pool(..., generation=)` compares (None
    #: from a server without stored pools).
    generation: int | None = None
    #: True while the pool hands out no new claims.
    draining: bool | None = None
    #: Each revision's `revision`, `state`, `share` (percent of new claims) and `counts`.
    revisions: tuple[Mapping[str, Any], ...] = ()
    #: True while the spawns of its revision fail: until a worker asked for after the last
    #: failure gets ready (None from a server that does not say).
    spawn_failing: bool | None = None
    #: How many of its spawns failed since they last worked.
    spawn_failures: int | None = None
    #: How the last of them failed (`... before ready: exited with code 3`).
    last_spawn_error: str | None = None
    #: The replica whose janitor last sized the pool, and how many seconds ago (None
    #: before any did, or from a server that does not say).
    sized_by: str | None = None
    sizing_age_s: float | None = None
    #: True when no replica has sized the pool for three janitor intervals: `desired_warm`
    #: and `demand` are the last figures published, not current ones.
    sizing_stale: bool | None = None
    #: The answering replica's janitor and fallback-reaper intervals (None from a server
    #: that does not say).
    janitor_interval_s: float | None = None
    reaper_interval_s: float | None = None
    #: The answering replica's start-up slots and the mean seconds a start-up held one
    #: (local processes; None on Kubernetes or from a server that does not say).
    start_limit: int | None = None
    start_slot_s: float | None = None


@dataclass(frozen=True, slots=True)
class DeletedPool(Answer):
    """A pool `delete_pool` deleted: the generation it had, and the rows deleted from each
    table of the store (its ledger and claim log rows stay)."""

    name: str
    generation: int
    #: Rows deleted by table: `pools`, `revisions`, `rollouts`, `forecast`, ...
    removed: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class RolloutInfo(Answer):
    """A pool's rollout of a new revision (docs/guides/rollouts.md)."""

    id: str
    #: ramping, paused, promoted, rolled_back, aborted or superseded.
    state: str
    #: Percent of the pool's new claims the revision gets now, at the canary's `step`.
    share: int
    step: int
    revision: str
    #: The stable revision when it started (what a rollback returns to).
    base_revision: str
    strategy: Mapping[str, Any]
    started_at: float
    ended_at: float | None
    reason: str | None

    @property
    def ended(self) -> bool:
        """True once nothing can change it any more."""
        return self.state not in ("ramping", "paused")


@dataclass(frozen=True, slots=True)
class WorkerInfo(Answer):
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


class Listing(list[T]):
    """One page of a listing, oldest first: a list of its rows that also carries `next`,
    the API's cursor of the page after it. Pass it as `after` (`client.claims(after=...)`)
    for that page; None when this page was not full, so the listing ended here (a full
    last page has a `next` whose page is empty)."""

    def __init__(self, rows: Iterable[T] = (), next: str | None = None) -> None:
        super().__init__(rows)
        #: The `after` of the page after this one; None once the listing ended.
        self.next = next

    def __repr__(self) -> str:
        return f"Listing({list.__repr__(self)}, next={self.next!r})"
