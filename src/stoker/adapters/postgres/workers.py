"""The worker and claim rows of the PostgreSQL store: reads, and writes that are each a
compare-and-set.

In READ COMMITTED:

- Every worker write is a CAS `UPDATE ... WHERE id AND version`, checked against the
  transition table in Python first. Every write bumps the version, so the row cannot
  change between the check (which reads org and activated too) and the write.
- Caps and targets are counts. Whatever adds to a count (spawn slots, reserving a warm
  worker for an org) first takes an advisory lock (`locks`) on the pool and/or the
  (pool, org) in a statement of its own: a statement's snapshot is taken when it starts, so
  the count must come from a later statement than the lock to see the previous holder's
  commit. Locks are always taken pool first, then org, so they cannot deadlock.
- `reserve_any` is one statement: pick with `FOR UPDATE SKIP LOCKED LIMIT 1` and update
  the picked row, so replicas claiming from one warm pool never wait on each other; a
  warm one newest first, away from the oldest ones its owner hands out by id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Unpack

import psycopg
from psycopg.rows import TupleRow

from stoker.adapters._rows import (
    CLAIM_COLUMNS,
    CLAIM_SELECT,
    LIVE_SQL,
    WORKER_COLUMNS,
    WORKER_SELECT,
    ListingFilters,
    check_claim_for,
    check_ending,
    check_move,
    check_reservable,
    checked_changes,
    checked_ending_changes,
    claim_from_row,
    claim_to_row,
    column_value,
    fenced,
    spawn_room,
    spawning_workers,
    stamp_taken,
    worker_from_row,
    worker_to_row,
)
from stoker.adapters._schema import CLAIMS, POSTGRES
from stoker.adapters.postgres.binds import BindBatches
from stoker.adapters.postgres.connections import Connection, Connections, PooledConnection
from stoker.adapters.postgres.locks import LOCK, lock_key
from stoker.adapters.postgres.reserves import ParkedOrWarmBatches, took_statement
from stoker.adapters.postgres.schema import IDEMPOTENCY_INDEX, Names
from stoker.domain.errors import ClaimKeyTaken, StoreError
from stoker.domain.records import Claim, Worker
from stoker.domain.states import ClaimState, WorkerState
from stoker.ports.store import (
    ClaimQuery,
    Ending,
    FencedReservation,
    Move,
    ParkedOrAny,
    ParkedOrWarm,
    Reservation,
    ReserveResult,
    SpawnRequest,
    SpawnResult,
    StateCount,
    WorkerQuery,
)

_JSON_COLUMNS = frozenset({"runtime_ref"})
_WORKER_VALUES = ", ".join("%s::jsonb" if c in _JSON_COLUMNS else "%s" for c in WORKER_COLUMNS)
#: The claim's values with their column types, for an INSERT ... SELECT (where PostgreSQL
#: cannot infer them from the target columns).
_CLAIM_TYPED = ", ".join(f"%s::{POSTGRES.types[c.kind]}" for c in CLAIMS.columns)
#: A list is one array parameter: one SQL text per combination of filters (prepared once).
_FILTERS = ListingFilters(
    "%s",
    among=lambda column, values: (f"{column} = ANY(%s)", [list(values)]),
    not_among=lambda column, values: (f"{column} <> ALL(%s)", [list(values)]),
)


class WorkerRows:
    """Spawn slots, transitions, reservations, binding and ending claims, renewals; the
    reads of workers and claims."""

    _db: Connections
    _names: Names
    _lock_idle_ms: str
    #: The reserve statements of the store's schema (`reserve_statements`), by state.
    _reserve_any_sql: dict[WorkerState, str]
    #: The binds of one loop iteration go as one statement.
    _binds: BindBatches
    _reserve_sql_by_id: dict[WorkerState, str]
    _parked_or_warm_sql: str
    #: The parked-or-warm reservations of one loop iteration go as one statement.
    _parked_or_warm: ParkedOrWarmBatches

    async def reserve_spawn_slots(
        self, req: SpawnRequest, ids: Sequence[str], now: float
    ) -> SpawnResult:
        """Insert spawning rows within the caps and the target, serialised per pool and org."""
        if req.count < 0:
            raise ValueError(f"spawn count must not be negative, got {req.count}")
        schema = self._names.schema
        locks = []
        if req.pool_cap > 0 or req.target is not None:
            locks.append(lock_key(schema, "pool", req.pool))
        if req.org is not None and req.org_cap > 0:
            locks.append(lock_key(schema, "org", req.pool, req.org))
        async with self._db.tx() as conn:
            for key in locks:  # pool before org, everywhere
                await conn.execute(LOCK, (self._lock_idle_ms, key))
            cur = await conn.execute(
                # Live rows only (every count is of live ones): the index skips the
                # pool's retired history instead of reading all of it.
                "SELECT "
                "count(*), "
                "count(*) FILTER (WHERE org = %(org)s), "
                "count(*) FILTER (WHERE revision = %(revision)s "
                "AND (state = 'warm' OR (state = 'spawning' AND org IS NULL))) "
                f"FROM {self._names.workers} WHERE pool = %(pool)s AND state IN {LIVE_SQL}",
                {"pool": req.pool, "org": req.org, "revision": req.revision},
            )
            counts = await cur.fetchone()
            pool_live, org_live, neutral = (int(n) for n in counts) if counts else (0, 0, 0)
            room, limited_by = spawn_room(
                req, len(ids), pool_live=pool_live, org_live=org_live, neutral=neutral
            )
            rows = spawning_workers(req, ids[:room], now)
            if rows:
                async with conn.cursor() as ins:
                    await ins.executemany(
                        f"INSERT INTO {self._names.workers} ({WORKER_SELECT}) "
                        f"VALUES ({_WORKER_VALUES})",
                        [worker_to_row(w) for w in rows],
                    )
            return SpawnResult(rows, limited_by)

    async def transition(self, worker_id: str, **move: Unpack[Move]) -> Worker | None:
        """CAS `(id, expect, epoch, version)` -> `to`; None on a miss (two statements, no
        transaction)."""
        to, changes = move["to"], move.get("changes") or {}
        # Illegal moves and unknown fields raise even when the row would not match.
        check_move(move["expect"], to, changes)
        async with self._db.connection() as conn:
            current = await _read_worker(conn, self._names, worker_id)
            if current is None or not fenced(current, move):
                return None
            return await _cas(
                conn,
                self._names,
                current,
                to=to,
                now=move["now"],
                bump_epoch=move.get("bump_epoch", False),
                changes=changes,
            )

    async def _reserve(
        self,
        conn: PooledConnection,
        sql: str,
        params: dict[str, Any],
        *,
        lock: int | None,
    ) -> ReserveResult:
        """Run a reserve statement, after the org's lock when its cap must be checked."""
        if lock is None:
            cur = conn.reused_cursor()
            await cur.execute(sql, params)
        else:
            # Lock and statement are sent together; the statement still starts (and takes
            # its snapshot) only once the lock is granted.
            async with conn.pipeline(), conn.transaction():
                await conn.execute(LOCK, (self._lock_idle_ms, lock))
                cur = await conn.execute(sql, params)
        row = await cur.fetchone()
        if row is None or row[2] is None:
            return ReserveResult(None, at_org_cap=bool(row and row[0]) and params["cap"] > 0)
        return ReserveResult(worker_from_row(row[2:]), parked=row[1])

    async def reserve(
        self, worker_id: str, *, now: float, **by: Unpack[FencedReservation]
    ) -> ReserveResult:
        """CAS one warm or hot_idle worker to reserved for `org` (warm: within the org cap),
        and with `activate` on to activating, in one statement."""
        params = _reserve_params(by, now)
        params |= {"id": worker_id, "epoch": by["epoch"], "version": by["version"]}
        async with self._db.connection() as conn:
            lock = None
            if params["cap"]:
                # The lock is per (pool, org): read the pool first (a worker's pool never
                # changes), and skip the transaction when the CAS would miss anyway.
                current = await _read_worker(conn, self._names, worker_id)
                if current is None or not fenced(current, by):
                    return ReserveResult(None)
                lock = lock_key(self._names.schema, "org", current.pool, by["org"])
            sql = self._reserve_sql_by_id[by["expect"]]
            return await self._reserve(conn, sql, params, lock=lock)

    async def reserve_any(
        self, pool: str, revision: str, *, now: float, **by: Unpack[Reservation]
    ) -> ReserveResult:
        """Reserve the oldest matching worker nobody else is locking, in one statement
        (moved on to activating with `activate`, as in `reserve`)."""
        params = _reserve_params(by, now) | {"pool": pool, "revision": revision}
        lock = lock_key(self._names.schema, "org", pool, by["org"]) if params["cap"] else None
        async with self._db.connection() as conn:
            sql = self._reserve_any_sql[by["expect"]]
            return await self._reserve(conn, sql, params, lock=lock)

    async def reserve_parked_or(
        self, worker_id: str, *, now: float, **by: Unpack[ParkedOrWarm]
    ) -> ReserveResult:
        """A worker `org` parked, else the warm `worker_id` (within the org cap), reserved
        and with `activate` moved on to activating, in one statement (`ParkedFirst`)."""
        if by["expect"] is not WorkerState.WARM:
            raise ValueError(f"the worker reserved when none is parked is warm, not {by['expect']}")
        params = _reserve_params(by, now) | {
            "id": worker_id,
            "epoch": by["epoch"],
            "version": by["version"],
            "pool": by["pool"],
            "revisions": list(by["revisions"]),
            "revision": by["revision"],
        }
        # With the others of the loop iteration, in one statement (`reserves`).
        return await self._parked_or_warm.reserve(params)

    async def reserve_parked_or_any(
        self, revision: str, *, now: float, **by: Unpack[ParkedOrAny]
    ) -> ReserveResult:
        """A worker `org` parked, else any warm worker of `revision` nobody else is locking
        (newest first, as `reserve_any`), reserved and with `activate` moved on to
        activating, in one statement (`ParkedFirst`; no org cap)."""
        if by["expect"] is not WorkerState.WARM or by["org_cap"]:
            raise ValueError("the worker reserved when none is parked is warm, with no org cap")
        params = _reserve_params(by, now) | {
            "id": None,
            "epoch": None,
            "version": None,
            "pool": by["pool"],
            "revisions": list(by["revisions"]),
            "revision": revision,
        }
        return await self._parked_or_warm.reserve(params)

    async def _parked_or_warm_alone(self, params: dict[str, Any]) -> ReserveResult:
        """`reserve_parked_or` in a statement of its own (after the org's lock with a cap)."""
        lock = None
        if params["cap"]:
            lock = lock_key(self._names.schema, "org", params["pool"], params["org"])
        async with self._db.connection() as conn:
            return await self._reserve(conn, self._parked_or_warm_sql, params, lock=lock)

    async def bind(
        self, worker_id: str, *, epoch: int, version: int, claim: Claim, now: float
    ) -> Worker | None:
        """activating -> hot and insert the claim, in one statement (with the other binds of
        the loop iteration): the claim row is inserted only when the worker's
        compare-and-set lands."""
        check_claim_for(worker_id, epoch, claim)
        check_move(WorkerState.ACTIVATING, WorkerState.HOT, {"claim_id": claim.id})
        try:
            row = await self._binds.bind(
                (now, claim.id, worker_id, epoch, version, claim.org, *claim_to_row(claim))
            )
        except StoreError as exc:
            # One statement (a batch that fails runs again bind by bind): the unique index
            # refused the claim, and the worker's move was undone with it.
            cause = exc.__cause__
            if (
                isinstance(cause, psycopg.errors.UniqueViolation)
                and cause.diag.constraint_name == IDEMPOTENCY_INDEX
            ):
                raise ClaimKeyTaken(
                    f"org {claim.org!r} has a claim with this Idempotency-Key"
                ) from None
            raise
        return worker_from_row(row) if row else None

    async def end_claim(self, claim_id: str, **end: Unpack[Ending]) -> tuple[Claim, Worker] | None:
        """End a bound claim and move its hot worker, in one statement that locks both rows
        first (claim row first, as everywhere)."""
        state, worker_to, now = end["state"], end["worker_to"], end["now"]
        reason, worker_changes = end.get("reason"), end.get("worker_changes")
        check_ending(state, worker_to, worker_changes or {})
        fields = checked_ending_changes(worker_to, worker_changes or {})
        sets, values = _sets(fields)
        w, c = self._names.workers, self._names.claims
        moved = ", ".join(f"w.{name}" for name in WORKER_COLUMNS)
        ended = ", ".join(f"c.{name}" for name in CLAIM_COLUMNS)
        sql = (
            "WITH target AS ("
            f"SELECT c.id AS claim_id, w.id AS worker_id FROM {c} AS c "
            f"JOIN {w} AS w ON w.id = c.worker_id "
            "WHERE c.id = %s AND c.state = 'bound' AND w.state = 'hot' "
            "AND w.epoch = c.worker_epoch AND w.claim_id = c.id FOR UPDATE OF c, w), "
            "moved AS ("
            f"UPDATE {w} AS w SET state = %s, version = w.version + 1, updated_at = %s"
            f"{''.join(', ' + set_ for set_ in sets)} "
            f"FROM target WHERE w.id = target.worker_id RETURNING {moved}), "
            "ended AS ("
            f"UPDATE {c} AS c SET state = %s, updated_at = %s, ended_at = %s, reason = %s "
            f"FROM target WHERE c.id = target.claim_id RETURNING {ended}) "
            "SELECT ended.*, moved.* FROM ended, moved"
        )
        params = [claim_id, worker_to.value, now, *values, state.value, now, now, reason]
        row = await self._db.one(sql, params)
        if row is None:
            return None
        n = len(CLAIM_COLUMNS)
        return claim_from_row(row[:n]), worker_from_row(row[n:])

    async def renew_claim(self, claim_id: str, *, expires_at: float, now: float) -> Claim | None:
        """Extend a bound claim's lease."""
        row = await self._db.one(
            f"UPDATE {self._names.claims} SET expires_at = %s, updated_at = %s "
            f"WHERE id = %s AND state = %s RETURNING {CLAIM_SELECT}",
            (expires_at, now, claim_id, ClaimState.BOUND.value),
        )
        return claim_from_row(row) if row else None

    async def get_worker(self, worker_id: str) -> Worker | None:
        """One worker row."""
        row = await self._db.one(self._names.worker_by_id, (worker_id,))
        return worker_from_row(row) if row else None

    async def list_workers(self, **query: Unpack[WorkerQuery]) -> list[Worker]:
        """Rows matching every filter, oldest first."""
        rows = await self._listed(WORKER_SELECT, self._names.workers, query)
        return [worker_from_row(r) for r in rows]

    async def count_workers(self) -> list[StateCount]:
        """Live workers grouped by pool, revision, state and binding."""
        rows = await self._db.all(
            "SELECT pool, revision, state, org IS NOT NULL, count(*) "
            f"FROM {self._names.workers} WHERE state IN {LIVE_SQL} GROUP BY 1, 2, 3, 4"
        )
        return [
            StateCount(pool, revision, WorkerState(state), bool(bound), int(n))
            for pool, revision, state, bound, n in rows
        ]

    async def get_claim(self, claim_id: str) -> Claim | None:
        """One claim."""
        row = await self._db.one(self._names.claim_by_id, (claim_id,))
        return claim_from_row(row) if row else None

    async def claim_by_key(self, org: str, idempotency_key: str) -> Claim | None:
        """The org's claim stored with `idempotency_key` (a digest), if any."""
        row = await self._db.one(self._names.claim_by_key, (org, idempotency_key))
        return claim_from_row(row) if row else None

    async def list_claims(self, **query: Unpack[ClaimQuery]) -> list[Claim]:
        """Claims matching every filter, oldest first (`expires_before` is inclusive)."""
        rows = await self._listed(CLAIM_SELECT, self._names.claims, query)
        return [claim_from_row(r) for r in rows]

    async def _listed(self, columns: str, table: str, query: Mapping[str, Any]) -> list[TupleRow]:
        """`columns` of the rows of `table` matching every filter, oldest first."""
        where, params = _FILTERS.where(query)
        sql = f"SELECT {columns} FROM {table}{where} ORDER BY created_at, id"
        if (limit := query.get("limit")) is not None:
            sql += " LIMIT %s"
            params.append(int(limit))
        return await self._db.all(sql, params)


def _reserve_params(by: Reservation, now: float) -> dict[str, Any]:
    """The parameters both reserve statements take; `cap` is 0 unless a warm worker's org
    cap must be checked (under the org's lock)."""
    expect = by["expect"]
    check_reservable(expect)
    capped = expect is WorkerState.WARM and by["org_cap"] > 0
    return {
        "expect": expect.value,
        "org": by["org"],
        "owner": by["owner"],
        "now": now,
        "cap": by["org_cap"] if capped else 0,
        "activate": by.get("activate", False),
    }


def reserve_statements(names: Names) -> tuple[dict[WorkerState, str], dict[WorkerState, str]]:
    """The statements of `reserve_any` and of `reserve` (by id), by the state reserved."""
    pick_any = (
        f"SELECT id, pool, state FROM {names.workers} "
        "WHERE pool = %(pool)s AND revision = %(revision)s AND state = %(expect)s{org} "
        "ORDER BY {order} LIMIT 1 FOR UPDATE SKIP LOCKED"
    )
    pick_by_id = (
        f"SELECT id, pool, state FROM {names.workers} "
        "WHERE id = %(id)s AND state = %(expect)s AND epoch = %(epoch)s "
        "AND version = %(version)s{org} FOR UPDATE"
    )
    by_org = {WorkerState.WARM: "", WorkerState.HOT_IDLE: " AND org = %(org)s"}
    # A warm worker is taken newest first: the replica that spawned the pool reserves
    # its own by id from its queue, oldest first, so the others' picks start at the
    # other end instead of walking past the rows it has locked or just taken (a burst
    # on three replicas bound in about half the time, with a third less PostgreSQL CPU
    # per claim: benchmarks/replicas.py). A parked worker is its org's alone.
    order = {WorkerState.WARM: "updated_at DESC, id DESC", WorkerState.HOT_IDLE: "updated_at, id"}
    return (
        {
            state: _reserve_sql(names, pick_any.format(org=org, order=order[state]))
            for state, org in by_org.items()
        },
        {state: _reserve_sql(names, pick_by_id.format(org=org)) for state, org in by_org.items()},
    )


def parked_or_warm_statement(names: Names) -> str:
    """The statement of `reserve_parked_or`: the oldest worker `%(org)s` parked at the
    first of `%(revisions)s` that has one (nobody else locking it), else the warm worker
    `%(id)s` at its fence; the org's cap only holds the warm one back."""
    w = names.workers
    parked = (
        f"SELECT id, pool, state FROM {w} WHERE pool = %(pool)s "
        "AND revision = ANY(%(revisions)s::text[]) AND state = 'hot_idle' AND org = %(org)s "
        "ORDER BY array_position(%(revisions)s::text[], revision), updated_at, id "
        "LIMIT 1 FOR UPDATE SKIP LOCKED"
    )
    warm = (
        f"SELECT id, pool, state FROM {w} WHERE id = %(id)s AND state = 'warm' "
        "AND epoch = %(epoch)s AND version = %(version)s "
        "AND NOT EXISTS (SELECT 1 FROM parked) FOR UPDATE"
    )
    pick = "SELECT * FROM parked UNION ALL SELECT * FROM warm"
    return _reserve_sql(names, pick, before=f"parked AS ({parked}), warm AS ({warm}), ")


def _reserve_sql(names: Names, pick: str, *, before: str = "") -> str:
    """Reserve the row `pick` selects (and locks) in one statement, moved on to activating
    with `%(activate)s` (the move the transition table allows next, in the same write);
    `before`: the common table expressions `pick` reads.

    The first column says whether a row was picked, the second whether it was parked
    (hot_idle); the rest is the reserved worker, or NULLs when the org's cap (`%(cap)s`,
    0 = none) stopped a warm one.
    """
    w = names.workers
    moved = ", ".join(f"w.{c}" for c in WORKER_COLUMNS)
    return (
        f"WITH {before}picked AS ({pick}), "
        "live AS ("
        f"SELECT count(*) AS n FROM {w} AS x JOIN picked ON x.pool = picked.pool "
        f"WHERE x.org = %(org)s AND x.state IN {LIVE_SQL}), "
        "moved AS ("
        f"UPDATE {w} AS w SET "
        "state = CASE WHEN %(activate)s THEN 'activating' ELSE 'reserved' END, "
        "activated = w.activated OR %(activate)s, epoch = w.epoch + 1, "
        "version = w.version + 1, org = %(org)s, "
        "owner = %(owner)s, heartbeat_at = %(now)s, updated_at = %(now)s, "
        "taken_at = CASE WHEN w.owner = %(owner)s THEN w.taken_at ELSE %(now)s END, "
        "prior_taken_at = CASE WHEN w.owner = %(owner)s THEN w.prior_taken_at "
        "ELSE w.taken_at END "
        "FROM picked WHERE w.id = picked.id AND w.state = picked.state "
        "AND (%(cap)s = 0 OR picked.state = 'hot_idle' OR (SELECT n FROM live) < %(cap)s) "
        f"RETURNING {moved}), "
        f"{took_statement(names)} "
        "SELECT EXISTS (SELECT 1 FROM picked), "
        "EXISTS (SELECT 1 FROM picked WHERE state = 'hot_idle'), moved.* "
        "FROM (VALUES (1)) AS one LEFT JOIN moved ON true"
    )


async def _read_worker(
    conn: Connection, names: Names, worker_id: str, *, lock: bool = False
) -> Worker | None:
    """One worker row (locked for the transaction with `lock`)."""
    sql = names.worker_by_id + (" FOR UPDATE" if lock else "")
    cur = await conn.execute(sql, (worker_id,))
    row = await cur.fetchone()
    return worker_from_row(row) if row else None


async def _cas(
    conn: Connection,
    names: Names,
    current: Worker,
    *,
    to: WorkerState,
    now: float,
    bump_epoch: bool,
    changes: Mapping[str, Any],
) -> Worker | None:
    """Write a checked transition of `current` (as read); None if the row moved meanwhile.

    The compare is on the version, which every write bumps: the checks read `org` and
    `activated` too, and those cannot have changed either.
    """
    fields = stamp_taken(current, checked_changes(current, to, changes), now)
    field_sets, values = _sets(fields)
    sets = ["state = %s", "epoch = %s", "version = %s", "updated_at = %s", *field_sets]
    params: list[Any] = [
        to.value,
        current.epoch + 1 if bump_epoch else current.epoch,
        current.version + 1,
        now,
        *values,
        current.id,
        current.version,
    ]
    update = (
        f"UPDATE {names.workers} SET {', '.join(sets)} WHERE id = %s AND version = %s "
        f"RETURNING {WORKER_SELECT}"
    )
    if "taken_at" in fields:
        # A change of owner is kept in the same statement, as the reservations keep theirs.
        update = f"WITH moved AS ({update}), {took_statement(names)} SELECT * FROM moved"
    cur = await conn.execute(update, params)
    row = await cur.fetchone()
    return worker_from_row(row) if row else None


def _sets(fields: Mapping[str, Any]) -> tuple[list[str], list[Any]]:
    """`name = %s` for each checked field change, and the values in column form."""
    sets, values = [], []
    for name, value in fields.items():
        # `name` is one of MUTABLE_WORKER_FIELDS (checked by the caller), or `taken_at` or
        # `prior_taken_at` (`stamp_taken`): safe to interpolate.
        sets.append(f"{name} = %s::jsonb" if name in _JSON_COLUMNS else f"{name} = %s")
        values.append(column_value(name, value))
    return sets, values


def bind_statement(names: Names) -> str:
    """activating -> hot for the claim's org at the expected epoch and version, and the
    claim's row inserted from the moved worker's row (nothing when the CAS misses)."""
    moved = ", ".join(f"w.{name}" for name in WORKER_COLUMNS)
    return (
        f"WITH moved AS (UPDATE {names.workers} AS w SET state = 'hot', "
        "version = w.version + 1, updated_at = %s, claim_id = %s, idle_since = NULL "
        "WHERE w.id = %s AND w.state = 'activating' AND w.epoch = %s AND w.version = %s "
        f"AND w.org = %s RETURNING {moved}), "
        f"inserted AS (INSERT INTO {names.claims} ({CLAIM_SELECT}) "
        f"SELECT {_CLAIM_TYPED} FROM moved) "
        "SELECT * FROM moved"
    )
