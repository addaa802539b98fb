"""What the SQL store adapters share: row <-> record mapping (in the column order of the
tables in `_schema`) and the checks every worker write makes before it reaches a table, so
both adapters refuse the same writes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from enum import EnumMeta
from operator import attrgetter, itemgetter
from typing import Any, Generic, TypeGuard, TypeVar

from stoker.adapters._schema import (
    CLAIMS,
    DEMAND,
    FORECAST,
    INSTANCES,
    LEASES,
    ORG_FORECAST,
    POOL_SIZING,
    WORKERS,
    Column,
    Kind,
    Table,
)
from stoker.domain.errors import IllegalTransition
from stoker.domain.records import (
    Claim,
    DemandRecord,
    Instance,
    LeaseRecord,
    OrgForecastBucket,
    PoolSizingRecord,
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

R = TypeVar("R")


def demand_row(counts: DemandCounts) -> tuple[int, int, int]:
    """(misses, waiting, claims) of a replica's published counts (claims 0 when left out)."""
    return (counts[0], counts[1], counts[2] if len(counts) > 2 else 0)


def forecast_select(table: str) -> str:
    """Every row of the forecast table `table` (its columns are `ForecastBucket`'s fields,
    in order: `ForecastBucket(*row)`, `dataclasses.astuple(bucket)`)."""
    return f"SELECT {', '.join(FORECAST.names)} FROM {table} ORDER BY pool, level, bucket"


def org_forecast_select(table: str) -> str:
    """Every row of the per-org forecast table `table` (its columns are
    `OrgForecastBucket`'s fields, in order)."""
    return f"SELECT {', '.join(ORG_FORECAST.names)} FROM {table} ORDER BY pool, org, bucket"


def claims_by_org_select(table: str, mark: str) -> str:
    """Claims per pool and org created in [since, before) (`mark`: the store's parameter
    marker, twice)."""
    return (
        f"SELECT pool, org, count(*) FROM {table} WHERE created_at >= {mark} "
        f"AND created_at < {mark} GROUP BY pool, org ORDER BY pool, org"
    )


#: `column IN values` (or `NOT IN`) as one store writes it, and the parameters it takes.
ListTest = Callable[[str, Sequence[Any]], tuple[str, list[Any]]]


@dataclass(frozen=True, slots=True)
class ListingFilters:
    """The WHERE clause of `list_workers` and `list_claims` in one store's SQL: its
    parameter marker, and how it tests a column against a list of values."""

    mark: str
    among: ListTest
    #: Only ever given a non-empty list.
    not_among: ListTest

    def where(self, query: Mapping[str, Any]) -> tuple[str, list[Any]]:
        """A WHERE clause for the filters given (`WorkerQuery`, `ClaimQuery`; '' for none),
        and its parameters."""
        clauses: list[str] = []
        params: list[Any] = []
        for column in ("pool", "org", "owner"):
            value = query.get(column)
            if value is not None:
                clauses.append(f"{column} = {self.mark}")
                params.append(value)
        not_owners = query.get("not_owners")
        if not_owners:
            sql, values = self.not_among("owner", list(not_owners))
            clauses.append(f"(owner IS NULL OR {sql})")
            params += values
        states = query.get("states")
        if states is not None:
            sql, values = self.among("state", [s.value for s in states])
            clauses.append(sql)
            params += values
        if (expires_before := query.get("expires_before")) is not None:
            clauses.append(f"expires_at <= {self.mark}")
            params.append(expires_before)
        if (after := query.get("after")) is not None:
            # Listings run oldest first, by (created_at, id): the rows after a page's last.
            clauses.append(f"(created_at, id) > ({self.mark}, {self.mark})")
            params += [float(after[0]), str(after[1])]
        return (" WHERE " + " AND ".join(clauses) if clauses else ""), params


#: Flat JSON objects decoded from text, by the text (see `load_json_object`), and the most
#: kept (then the memo starts afresh).
_FLAT_OBJECTS: dict[str, dict[str, Any]] = {}
_FLAT_OBJECTS_MAX = 4096
_SCALARS = (str, int, float, bool, type(None))


def load_json_object(value: Any) -> dict[str, Any]:
    """A JSON object column: text (SQLite) or jsonb already decoded by the driver (PostgreSQL).

    A worker's `runtime_ref` is read with every write of its row and rarely changes: the
    object of a text seen before is copied from the last decoding when its values are all
    scalars (a copy then shares nothing), and decoded again otherwise."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        known = _FLAT_OBJECTS.get(value)
        if known is not None:
            return dict(known)
        decoded = dict(json.loads(value))
        if all(isinstance(v, _SCALARS) for v in decoded.values()):
            if len(_FLAT_OBJECTS) >= _FLAT_OBJECTS_MAX:
                _FLAT_OBJECTS.clear()
            _FLAT_OBJECTS[value] = dict(decoded)
        return decoded
    if isinstance(value, bytes | bytearray):
        return dict(json.loads(value))
    return dict(value)


#: `json.dumps` with arguments builds an encoder per call; this one is built once.
_COMPACT_SORTED = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def dump_json(value: Mapping[str, Any]) -> str:
    """Compact, key-sorted JSON (stable bytes for the same value)."""
    return _COMPACT_SORTED.encode(dict(value))


def column_value(name: str, value: Any) -> Any:
    """Convert one mutable field to its column representation."""
    if name == "runtime_ref":
        return dump_json(value)
    if name == "activated":
        return bool(value)
    return value


class RecordRows(Generic[R]):
    """The rows of one record type whose fields are a table's columns (by name): each value
    read is converted by its column's kind (or by its own decoder: an enum's, say), and
    written as stored (an enum's value, a JSON object's text, or by its own encoder)."""

    def __init__(
        self,
        record: type[R],
        table: Table,
        *,
        decode: Mapping[str, Callable[[Any], Any]] | None = None,
        encode: Mapping[str, Callable[[Any], Any]] | None = None,
    ) -> None:
        decode, encode = decode or {}, encode or {}
        self._record = record
        self._width = len(table.columns)
        # Each field in the record's order: its column's place in the row, and its decoder.
        reads = [
            (table.names.index(f.name), _decoder(table.column(f.name), decode.get(f.name)))
            for f in fields(record)  # type: ignore[arg-type]
        ]
        # The row's values in the record's order (the same order: the row as it is), then
        # only the values that are not read as they are stored are converted, in place.
        order = [i for i, _ in reads]
        self._order = None if order == list(range(len(order))) else _items(order)
        self._converts = tuple(
            (at, read) for at, (_, read) in enumerate(reads) if read is not _same
        )
        self._fields = attrgetter(*table.names)
        encoders = (encode.get(c.name) or _encoder(c, decode.get(c.name)) for c in table.columns)
        self._encoders = tuple((i, e) for i, e in enumerate(encoders) if e is not None)

    def from_row(self, row: Sequence[Any]) -> R:
        """The record of a row in the table's column order."""
        if len(row) != self._width:
            raise ValueError(
                f"a {self._record.__name__} row has {self._width} columns, not {len(row)}"
            )
        values = list(row) if self._order is None else list(self._order(row))
        for at, read in self._converts:
            values[at] = read(values[at])
        return self._record(*values)

    def to_row(self, record: R) -> tuple[Any, ...]:
        """A row in the table's column order."""
        row = list(self._fields(record))
        for i, encode in self._encoders:
            row[i] = encode(row[i])
        return tuple(row)


def _same(value: Any) -> Any:
    return value


def _items(places: list[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """The items of a row at `places`, in that order, as a tuple."""
    pick = itemgetter(*places)
    if len(places) == 1:
        return lambda row: (pick(row),)
    return pick


#: How a value of each kind is read from a row.
_READ: dict[Kind, Callable[[Any], Any]] = {
    Kind.TEXT: _same,
    Kind.INT: int,
    Kind.INT32: int,
    Kind.REAL: float,
    Kind.FLAG: bool,
    Kind.JSON: load_json_object,
}


def _enum_reader(enum: EnumMeta) -> Callable[[Any], Any]:
    """`enum(value)` by a look-up of its members' values (an enum's call runs two Python
    frames, for every state, source and mode of every row read); anything else, an
    unknown value included, goes to the enum itself."""
    members = {member.value: member for member in enum}  # type: ignore[var-annotated]

    def read(value: Any) -> Any:
        try:
            return members[value]
        except (KeyError, TypeError):
            return enum(value)

    return read


def _decoder(column: Column, own: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    read = own or _READ[column.kind]
    if isinstance(read, EnumMeta):
        read = _enum_reader(read)
    if column.nullable and read is not _same:
        return lambda value: None if value is None else read(value)
    return read


def _encoder(column: Column, decoder: Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
    """How a field is written when it is not stored as it is: an enum as its value."""
    if isinstance(decoder, EnumMeta):
        return attrgetter("value")
    return dump_json if column.kind is Kind.JSON else None


WORKER_ROWS = RecordRows(Worker, WORKERS, decode={"state": WorkerState})
#: A claim's token is stored as its digest only.
CLAIM_ROWS = RecordRows(
    Claim,
    CLAIMS,
    decode={"source": ClaimSource, "mode": ClaimMode, "state": ClaimState},
    encode={"token": token_digest},
)
#: A `Worker` from a row in `WORKER_COLUMNS` order, and back.
worker_from_row, worker_to_row = WORKER_ROWS.from_row, WORKER_ROWS.to_row
#: A `Claim` from a row in `CLAIM_COLUMNS` order, and back.
claim_from_row, claim_to_row = CLAIM_ROWS.from_row, CLAIM_ROWS.to_row
#: An `Instance` from `(id, started_at, heartbeat_at, state, meta)`.
instance_from_row = RecordRows(Instance, INSTANCES).from_row
#: A `DemandRecord` from `(pool, instance, misses, waiting, updated_at, claims)`.
demand_from_row = RecordRows(DemandRecord, DEMAND).from_row
#: A `LeaseRecord` from `(name, holder, epoch, renewed_at, duration_s)`.
lease_from_row = RecordRows(LeaseRecord, LEASES).from_row
#: An `OrgForecastBucket` from a row of `org_forecast_select`, and back.
ORG_FORECAST_ROWS = RecordRows(OrgForecastBucket, ORG_FORECAST)
#: A `PoolSizingRecord` from a row of `POOL_SIZING`, and back.
POOL_SIZING_ROWS = RecordRows(PoolSizingRecord, POOL_SIZING)
#: Every pool's published sizing, in `POOL_SIZING`'s column order, by pool.
POOL_SIZING_SELECT = f"SELECT {', '.join(POOL_SIZING.names)} FROM {{table}} ORDER BY pool"


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


def stamp_taken(current: Worker, fields: dict[str, Any], now: float) -> dict[str, Any]:
    """`fields` (the checked changes of a move of `current`), with `taken_at` stamped `now`
    when the move gives the row another owner (a replica took the worker, for a claim or
    by adoption), and `prior_taken_at` keeping the `taken_at` before. The replica the
    worker left counts it up to there, however often it is taken again (or back) before
    that replica's next ledger flush (`stoker.control.ledger`)."""
    owner = fields.get("owner")
    if owner is not None and owner != current.owner:
        fields["prior_taken_at"] = current.taken_at
        fields["taken_at"] = now
    return fields


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
