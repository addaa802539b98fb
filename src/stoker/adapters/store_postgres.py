"""PostgreSQL store: one database shared by several control-plane replicas.

Built to run behind a transaction-mode connection pooler: every table name is qualified
with the configured schema (no `SET search_path`), nothing lives in the session (only
transaction-scoped advisory locks), and server-side prepared statements can be turned off
with `prepare_threshold=None`.

Concurrency, in READ COMMITTED:

- Every worker write is a CAS `UPDATE ... WHERE id AND version`, checked against the
  transition table in Python first. Every write bumps the version, so the row cannot
  change between the check (which reads org and activated too) and the write.
- Caps and targets are counts. Whatever adds to a count (spawn slots, reserving a warm
  worker for an org) first takes `pg_advisory_xact_lock` on the pool and/or the (pool, org)
  in a statement of its own: a statement's snapshot is taken when it starts, so the count
  must come from a later statement than the lock to see the previous holder's commit.
  Locks are always taken pool first, then org, so they cannot deadlock. The statement that
  takes a lock also bounds how long its transaction may sit idle
  (`idle_in_transaction_session_timeout`, transaction-local): a replica stopped while
  holding a pool's lock (SIGSTOP, a frozen VM) would otherwise block every other
  replica's spawns in that pool until it ran again; PostgreSQL ends its transaction instead.
- `reserve_any` is one statement: pick with `FOR UPDATE SKIP LOCKED LIMIT 1` and update
  the picked row, so replicas claiming from one warm pool never wait on each other.

Times are arguments (SQL never calls `now()`), and psycopg errors surface as `StoreError`;
a multi-statement write runs in one transaction, so a failure leaves nothing half-done.
Pooled connections are not pinged on checkout (a round trip per operation): one broken by
a server restart fails the operation that finds it, like any failed write, and the pool
replaces it.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool

from stoker.adapters._rows import (
    CLAIM_COLUMNS,
    CLAIM_SELECT,
    LIVE_SQL,
    WORKER_COLUMNS,
    WORKER_SELECT,
    check_claim_for,
    check_move,
    check_reservable,
    checked_changes,
    claim_from_row,
    claim_to_row,
    column_value,
    dump_json,
    instance_from_row,
    lease_from_row,
    matches,
    spawn_room,
    spawning_workers,
    worker_from_row,
    worker_to_row,
)
from stoker.domain.errors import StoreError
from stoker.domain.records import Claim, DemandRecord, Instance, LeaseRecord, Worker
from stoker.domain.states import ClaimState, WorkerState
from stoker.ports.store import ReserveResult, SpawnRequest, SpawnResult, StateCount

Connection = psycopg.AsyncConnection[TupleRow]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
#: Takes a transaction-scoped advisory lock, and ends the transaction should it then sit
#: idle for the given milliseconds (set per transaction: a pooler forwards no options).
_LOCK = (
    "SELECT set_config('idle_in_transaction_session_timeout', %s, true), pg_advisory_xact_lock(%s)"
)
_JSON_COLUMNS = frozenset({"runtime_ref"})


def _migrations(s: str) -> list[tuple[int, list[str]]]:
    """Versioned migrations for schema `s` (quoted); version N applies once, in order."""
    return [
        (
            1,
            [
                f"""CREATE TABLE {s}.workers (
                    id text PRIMARY KEY,
                    pool text NOT NULL,
                    revision text NOT NULL,
                    state text NOT NULL,
                    epoch bigint NOT NULL DEFAULT 0,
                    owner text NOT NULL,
                    created_at double precision NOT NULL,
                    updated_at double precision NOT NULL,
                    org text,
                    claim_id text,
                    endpoint text,
                    runtime_ref jsonb NOT NULL DEFAULT '{{}}',
                    activated boolean NOT NULL DEFAULT false,
                    heartbeat_at double precision NOT NULL,
                    idle_since double precision,
                    ttl_s double precision,
                    reason text
                )""",
                # reserve_any: the oldest worker of a pool revision in a state
                f"CREATE INDEX workers_pick ON {s}.workers (pool, revision, state, updated_at, id)",
                f"CREATE INDEX workers_pool_org ON {s}.workers (pool, org, state)",
                f"CREATE INDEX workers_owner ON {s}.workers (owner, state)",
                f"CREATE INDEX workers_state ON {s}.workers (state)",
                f"CREATE INDEX workers_created ON {s}.workers (created_at, id)",
                f"""CREATE TABLE {s}.claims (
                    id text PRIMARY KEY,
                    pool text NOT NULL,
                    org text NOT NULL,
                    worker_id text NOT NULL,
                    worker_epoch bigint NOT NULL,
                    source text NOT NULL,
                    mode text NOT NULL,
                    state text NOT NULL,
                    token text NOT NULL,
                    endpoint text NOT NULL,
                    lease_s double precision NOT NULL,
                    expires_at double precision NOT NULL,
                    created_at double precision NOT NULL,
                    updated_at double precision NOT NULL,
                    owner text NOT NULL,
                    ttl_s double precision,
                    ended_at double precision,
                    reason text
                )""",
                f"CREATE INDEX claims_state_expires ON {s}.claims (state, expires_at)",
                f"CREATE INDEX claims_worker ON {s}.claims (worker_id)",
                f"CREATE INDEX claims_created ON {s}.claims (created_at, id)",
                f"""CREATE TABLE {s}.instances (
                    id text PRIMARY KEY,
                    started_at double precision NOT NULL,
                    heartbeat_at double precision NOT NULL,
                    state text NOT NULL,
                    meta jsonb NOT NULL DEFAULT '{{}}'
                )""",
                f"""CREATE TABLE {s}.leases (
                    name text PRIMARY KEY,
                    holder text NOT NULL,
                    epoch bigint NOT NULL,
                    renewed_at double precision NOT NULL,
                    duration_s double precision NOT NULL
                )""",
            ],
        ),
        (
            2,
            [
                f"""CREATE TABLE {s}.demand (
                    pool text NOT NULL,
                    instance text NOT NULL,
                    misses bigint NOT NULL,
                    waiting integer NOT NULL,
                    updated_at double precision NOT NULL,
                    PRIMARY KEY (pool, instance)
                )""",
                f"CREATE INDEX workers_purge ON {s}.workers (state, updated_at)",
                f"CREATE INDEX claims_purge ON {s}.claims (state, updated_at)",
            ],
        ),
        (
            3,
            [
                # Each index is rewritten by every write that touches its columns: keep only
                # those a query needs (`workers_state` and `claims_state_expires` serve the
                # purge; nothing looks workers up by owner alone, nor claims by worker).
                f"DROP INDEX {s}.workers_purge",
                f"DROP INDEX {s}.workers_owner",
                f"DROP INDEX {s}.claims_purge",
                f"DROP INDEX {s}.claims_worker",
            ],
        ),
        (
            4,
            [
                # Every worker write compares and bumps the row version (a CAS on the row).
                f"ALTER TABLE {s}.workers ADD COLUMN version bigint NOT NULL DEFAULT 0",
            ],
        ),
    ]


def lock_key(*parts: str) -> int:
    """A signed 64-bit advisory lock key for `parts`, the same in every process."""
    digest = hashlib.blake2b("\x00".join(("stoker", *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class PostgresStore:
    """The Store port on PostgreSQL (psycopg 3, one async connection pool per instance)."""

    def __init__(
        self,
        url: str,
        *,
        schema: str = "stoker",
        min_size: int = 1,
        max_size: int = 10,
        prepare_threshold: int | None = 5,
        timeout_s: float = 30.0,
        lock_idle_timeout_s: float = 5.0,
    ) -> None:
        """`url`: a libpq URL or conninfo; `timeout_s`: longest wait for a pooled connection;
        `lock_idle_timeout_s`: how long a transaction holding a lock may sit idle before
        PostgreSQL ends it (its client stalled)."""
        if lock_idle_timeout_s <= 0:
            raise ValueError(f"lock_idle_timeout_s must be > 0, got {lock_idle_timeout_s}")
        if not _IDENTIFIER.fullmatch(schema):
            raise ValueError(f"schema must be a plain SQL identifier, got {schema!r}")
        if min_size < 0 or max_size < max(1, min_size):
            raise ValueError(
                f"need 0 <= min_size <= max_size and max_size >= 1, got {min_size}, {max_size}"
            )
        self.url = url
        self.schema = schema
        self._min_size = min_size
        self._max_size = max_size
        self._prepare_threshold = prepare_threshold
        self._timeout_s = timeout_s
        self._lock_idle_ms = str(max(1, round(lock_idle_timeout_s * 1000)))
        self._pool: AsyncConnectionPool[Connection] | None = None
        self._opening = asyncio.Lock()
        s = f'"{schema}"'
        self._s = s
        self._workers = f"{s}.workers"
        self._claims = f"{s}.claims"
        self._instances = f"{s}.instances"
        self._leases = f"{s}.leases"
        self._versions = f"{s}.schema_migrations"
        self._reserve_any_sql = {
            expect: self._reserve_sql(
                f"SELECT id, pool FROM {self._workers} "
                "WHERE pool = %(pool)s AND revision = %(revision)s AND state = %(expect)s"
                + (" AND org = %(org)s" if expect is WorkerState.HOT_IDLE else "")
                + " ORDER BY updated_at, id LIMIT 1 FOR UPDATE SKIP LOCKED"
            )
            for expect in (WorkerState.WARM, WorkerState.HOT_IDLE)
        }
        self._reserve_sql_by_id = {
            expect: self._reserve_sql(
                f"SELECT id, pool FROM {self._workers} "
                "WHERE id = %(id)s AND state = %(expect)s AND epoch = %(epoch)s "
                "AND version = %(version)s"
                + (" AND org = %(org)s" if expect is WorkerState.HOT_IDLE else "")
                + " FOR UPDATE"
            )
            for expect in (WorkerState.WARM, WorkerState.HOT_IDLE)
        }

    # -- plumbing -------------------------------------------------------------------------

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[Connection]:
        """A pooled connection (autocommit); any psycopg error becomes a StoreError."""
        pool = self._pool
        if pool is None:
            raise StoreError("store is not open")
        try:
            async with pool.connection() as conn:
                yield conn
        except psycopg.Error as exc:
            # PoolTimeout and PoolClosed are OperationalErrors too.
            raise StoreError(f"postgres: {type(exc).__name__}: {exc}") from exc

    @asynccontextmanager
    async def _tx(self) -> AsyncIterator[Connection]:
        """One transaction on a pooled connection, rolled back on any error."""
        async with self._connection() as conn, conn.transaction():
            yield conn

    async def _all(
        self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()
    ) -> list[TupleRow]:
        async with self._connection() as conn:
            cur = await conn.execute(sql, params)
            return await cur.fetchall()

    async def _one(
        self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()
    ) -> TupleRow | None:
        async with self._connection() as conn:
            cur = await conn.execute(sql, params)
            return await cur.fetchone()

    async def open(self) -> None:
        """Open the connection pool and apply pending migrations; a no-op when already open."""
        async with self._opening:
            if self._pool is not None:
                return
            pool: AsyncConnectionPool[Connection] = AsyncConnectionPool(
                self.url,
                kwargs={"autocommit": True, "prepare_threshold": self._prepare_threshold},
                min_size=self._min_size,
                max_size=self._max_size,
                timeout=self._timeout_s,
                name=f"stoker-{self.schema}",
                open=False,
            )
            try:
                await pool.open(wait=self._min_size > 0, timeout=self._timeout_s)
                async with pool.connection() as conn:
                    await self._migrate(conn)
            except BaseException as exc:
                await pool.close()
                if isinstance(exc, psycopg.Error):
                    raise StoreError(
                        f"cannot open postgres store (schema {self.schema}): "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                raise
            self._pool = pool

    async def _migrate(self, conn: Connection) -> None:
        """Apply pending versions under a transaction-scoped lock, so replicas take turns."""
        async with conn.transaction():
            await conn.execute(_LOCK, (self._lock_idle_ms, lock_key("migrate", self.schema)))
            # Create only what is missing: a role without CREATE on the database can run an
            # already migrated schema.
            cur = await conn.execute(
                "SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %s", (self.schema,)
            )
            if await cur.fetchone() is None:
                await conn.execute(f"CREATE SCHEMA {self._s}")
            cur = await conn.execute("SELECT to_regclass(%s)", (self._versions,))
            row = await cur.fetchone()
            if row is None or row[0] is None:
                await conn.execute(f"CREATE TABLE {self._versions} (version integer PRIMARY KEY)")
            cur = await conn.execute(f"SELECT version FROM {self._versions}")
            applied = {r[0] for r in await cur.fetchall()}
            for version, statements in _migrations(self._s):
                if version in applied:
                    continue
                for sql in statements:
                    await conn.execute(sql)
                await conn.execute(
                    f"INSERT INTO {self._versions} (version) VALUES (%s)", (version,)
                )

    async def close(self) -> None:
        """Close the pool and its connections."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    async def schema_version(self) -> int:
        """The highest applied migration."""
        row = await self._one(f"SELECT COALESCE(MAX(version), 0) FROM {self._versions}")
        return int(row[0]) if row else 0

    # -- workers --------------------------------------------------------------------------

    async def _read_worker(
        self, conn: Connection, worker_id: str, *, lock: bool = False
    ) -> Worker | None:
        sql = f"SELECT {WORKER_SELECT} FROM {self._workers} WHERE id = %s"
        cur = await conn.execute(sql + (" FOR UPDATE" if lock else ""), (worker_id,))
        row = await cur.fetchone()
        return worker_from_row(row) if row else None

    async def _cas(
        self,
        conn: Connection,
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
        fields = checked_changes(current, to, changes)
        sets = ["state = %s", "epoch = %s", "version = %s", "updated_at = %s"]
        params: list[Any] = [
            to.value,
            current.epoch + 1 if bump_epoch else current.epoch,
            current.version + 1,
            now,
        ]
        for name, value in fields.items():
            # `name` is one of MUTABLE_WORKER_FIELDS (checked above): safe to interpolate.
            sets.append(f"{name} = %s::jsonb" if name in _JSON_COLUMNS else f"{name} = %s")
            params.append(column_value(name, value))
        params += [current.id, current.version]
        cur = await conn.execute(
            f"UPDATE {self._workers} SET {', '.join(sets)} WHERE id = %s AND version = %s "
            f"RETURNING {WORKER_SELECT}",
            params,
        )
        row = await cur.fetchone()
        return worker_from_row(row) if row else None

    async def reserve_spawn_slots(
        self, req: SpawnRequest, ids: Sequence[str], now: float
    ) -> SpawnResult:
        """Insert spawning rows within the caps and the target, serialised per pool and org."""
        if req.count < 0:
            raise ValueError(f"spawn count must not be negative, got {req.count}")
        locks = []
        if req.pool_cap > 0 or req.target is not None:
            locks.append(lock_key(self.schema, "pool", req.pool))
        if req.org is not None and req.org_cap > 0:
            locks.append(lock_key(self.schema, "org", req.pool, req.org))
        async with self._tx() as conn:
            for key in locks:  # pool before org, everywhere
                await conn.execute(_LOCK, (self._lock_idle_ms, key))
            cur = await conn.execute(
                # Live rows only (every count is of live ones): the index skips the
                # pool's retired history instead of reading all of it.
                "SELECT "
                "count(*), "
                "count(*) FILTER (WHERE org = %(org)s), "
                "count(*) FILTER (WHERE revision = %(revision)s "
                "AND (state = 'warm' OR (state = 'spawning' AND org IS NULL))) "
                f"FROM {self._workers} WHERE pool = %(pool)s AND state IN {LIVE_SQL}",
                {"pool": req.pool, "org": req.org, "revision": req.revision},
            )
            counts = await cur.fetchone()
            pool_live, org_live, neutral = (int(n) for n in counts) if counts else (0, 0, 0)
            room, limited_by = spawn_room(
                req, len(ids), pool_live=pool_live, org_live=org_live, neutral=neutral
            )
            rows = spawning_workers(req, ids[:room], now)
            if rows:
                placeholders = ", ".join(
                    "%s::jsonb" if c in _JSON_COLUMNS else "%s" for c in WORKER_COLUMNS
                )
                async with conn.cursor() as ins:
                    await ins.executemany(
                        f"INSERT INTO {self._workers} ({WORKER_SELECT}) VALUES ({placeholders})",
                        [worker_to_row(w) for w in rows],
                    )
            return SpawnResult(rows, limited_by)

    async def transition(
        self,
        worker_id: str,
        *,
        expect: WorkerState,
        epoch: int,
        version: int,
        to: WorkerState,
        now: float,
        bump_epoch: bool = False,
        changes: Mapping[str, Any] | None = None,
    ) -> Worker | None:
        """CAS `(id, expect, epoch, version)` -> `to`; None on a miss (two statements, no
        transaction)."""
        # Illegal moves and unknown fields raise even when the row would not match.
        check_move(expect, to, changes or {})
        async with self._connection() as conn:
            current = await self._read_worker(conn, worker_id)
            if current is None or not matches(current, expect, epoch, version):
                return None
            return await self._cas(
                conn, current, to=to, now=now, bump_epoch=bump_epoch, changes=changes or {}
            )

    def _reserve_sql(self, pick: str) -> str:
        """Reserve the row `pick` selects (and locks) in one statement.

        The first column says whether a row was picked; the rest is the reserved worker, or
        NULLs when the org's cap (`%(cap)s`, 0 = none) stopped it.
        """
        w = self._workers
        moved = ", ".join(f"w.{c}" for c in WORKER_COLUMNS)
        return (
            f"WITH picked AS ({pick}), "
            "live AS ("
            f"SELECT count(*) AS n FROM {w} AS x JOIN picked ON x.pool = picked.pool "
            f"WHERE x.org = %(org)s AND x.state IN {LIVE_SQL}), "
            "moved AS ("
            f"UPDATE {w} AS w SET state = 'reserved', epoch = w.epoch + 1, "
            "version = w.version + 1, org = %(org)s, "
            "owner = %(owner)s, heartbeat_at = %(now)s, updated_at = %(now)s "
            "FROM picked WHERE w.id = picked.id AND w.state = %(expect)s "
            "AND (%(cap)s = 0 OR (SELECT n FROM live) < %(cap)s) "
            f"RETURNING {moved}) "
            "SELECT EXISTS (SELECT 1 FROM picked), moved.* "
            "FROM (VALUES (1)) AS one LEFT JOIN moved ON true"
        )

    async def _reserve(
        self,
        conn: Connection,
        sql: str,
        params: dict[str, Any],
        *,
        lock: int | None,
    ) -> ReserveResult:
        """Run a reserve statement, after the org's lock when its cap must be checked."""
        if lock is None:
            cur = await conn.execute(sql, params)
        else:
            # Lock and statement are sent together; the statement still starts (and takes
            # its snapshot) only once the lock is granted.
            async with conn.pipeline(), conn.transaction():
                await conn.execute(_LOCK, (self._lock_idle_ms, lock))
                cur = await conn.execute(sql, params)
        row = await cur.fetchone()
        if row is None or row[1] is None:
            return ReserveResult(None, at_org_cap=bool(row and row[0]) and params["cap"] > 0)
        return ReserveResult(worker_from_row(row[1:]))

    async def reserve(
        self,
        worker_id: str,
        *,
        expect: WorkerState,
        epoch: int,
        version: int,
        org: str,
        org_cap: int,
        owner: str,
        now: float,
        activate: bool = False,
    ) -> ReserveResult:
        """CAS one warm or hot_idle worker to reserved for `org` (warm: within the org cap).

        `activate` is not taken up: the reserved worker is returned, and the caller moves
        it on to activating."""
        check_reservable(expect)
        capped = expect is WorkerState.WARM and org_cap > 0
        params = {
            "id": worker_id,
            "expect": expect.value,
            "epoch": epoch,
            "version": version,
            "org": org,
            "owner": owner,
            "now": now,
            "cap": org_cap if capped else 0,
        }
        async with self._connection() as conn:
            lock = None
            if capped:
                # The lock is per (pool, org): read the pool first (a worker's pool never
                # changes), and skip the transaction when the CAS would miss anyway.
                current = await self._read_worker(conn, worker_id)
                if current is None or not matches(current, expect, epoch, version):
                    return ReserveResult(None)
                lock = lock_key(self.schema, "org", current.pool, org)
            return await self._reserve(conn, self._reserve_sql_by_id[expect], params, lock=lock)

    async def reserve_any(
        self,
        pool: str,
        revision: str,
        *,
        expect: WorkerState,
        org: str,
        org_cap: int,
        owner: str,
        now: float,
        activate: bool = False,
    ) -> ReserveResult:
        """Reserve the oldest matching worker nobody else is locking, in one statement
        (`activate` not taken up, as in `reserve`)."""
        check_reservable(expect)
        capped = expect is WorkerState.WARM and org_cap > 0
        params = {
            "pool": pool,
            "revision": revision,
            "expect": expect.value,
            "org": org,
            "owner": owner,
            "now": now,
            "cap": org_cap if capped else 0,
        }
        lock = lock_key(self.schema, "org", pool, org) if capped else None
        async with self._connection() as conn:
            return await self._reserve(conn, self._reserve_any_sql[expect], params, lock=lock)

    async def get_worker(self, worker_id: str) -> Worker | None:
        """One worker row."""
        row = await self._one(
            f"SELECT {WORKER_SELECT} FROM {self._workers} WHERE id = %s", (worker_id,)
        )
        return worker_from_row(row) if row else None

    async def list_workers(
        self,
        *,
        pool: str | None = None,
        states: Collection[WorkerState] | None = None,
        org: str | None = None,
        owner: str | None = None,
        not_owners: Collection[str] | None = None,
        limit: int | None = None,
    ) -> list[Worker]:
        """Rows matching every filter, oldest first."""
        where, params = _filters(
            pool=pool, org=org, owner=owner, states=states, not_owners=not_owners
        )
        sql = f"SELECT {WORKER_SELECT} FROM {self._workers}{where} ORDER BY created_at, id"
        if limit is not None:
            sql += " LIMIT %s"
            params.append(int(limit))
        return [worker_from_row(r) for r in await self._all(sql, params)]

    async def count_workers(self) -> list[StateCount]:
        """Live workers grouped by pool, revision, state and binding."""
        rows = await self._all(
            "SELECT pool, revision, state, org IS NOT NULL, count(*) "
            f"FROM {self._workers} WHERE state IN {LIVE_SQL} GROUP BY 1, 2, 3, 4"
        )
        return [
            StateCount(pool, revision, WorkerState(state), bool(bound), int(n))
            for pool, revision, state, bound, n in rows
        ]

    # -- claims ---------------------------------------------------------------------------

    async def bind(
        self, worker_id: str, *, epoch: int, version: int, claim: Claim, now: float
    ) -> Worker | None:
        """activating -> hot and insert the claim, in one transaction."""
        check_claim_for(worker_id, epoch, claim)
        async with self._tx() as conn:
            current = await self._read_worker(conn, worker_id, lock=True)
            if current is None or not matches(current, WorkerState.ACTIVATING, epoch, version):
                return None
            if current.org != claim.org:
                return None
            worker = await self._cas(
                conn,
                current,
                to=WorkerState.HOT,
                now=now,
                bump_epoch=False,
                changes={"claim_id": claim.id, "idle_since": None},
            )
            if worker is None:
                return None
            placeholders = ", ".join("%s" for _ in CLAIM_COLUMNS)
            await conn.execute(
                f"INSERT INTO {self._claims} ({CLAIM_SELECT}) VALUES ({placeholders})",
                claim_to_row(claim),
            )
            return worker

    async def end_claim(
        self,
        claim_id: str,
        *,
        state: ClaimState,
        worker_to: WorkerState,
        now: float,
        reason: str | None = None,
        worker_changes: Mapping[str, Any] | None = None,
    ) -> tuple[Claim, Worker] | None:
        """End a bound claim and move its hot worker, in one transaction (claim row first)."""
        if state is ClaimState.BOUND:
            raise ValueError("end_claim needs a final claim state")
        check_move(WorkerState.HOT, worker_to, worker_changes or {})
        async with self._tx() as conn:
            cur = await conn.execute(
                f"SELECT {CLAIM_SELECT} FROM {self._claims} "
                "WHERE id = %s AND state = %s FOR UPDATE",
                (claim_id, ClaimState.BOUND.value),
            )
            row = await cur.fetchone()
            if row is None:
                return None
            claim = claim_from_row(row)
            current = await self._read_worker(conn, claim.worker_id, lock=True)
            if (
                current is None
                or current.state is not WorkerState.HOT
                or current.epoch != claim.worker_epoch
                or current.claim_id != claim.id
            ):
                return None
            worker = await self._cas(
                conn,
                current,
                to=worker_to,
                now=now,
                bump_epoch=False,
                changes={"claim_id": None, **(worker_changes or {})},
            )
            if worker is None:
                return None
            cur = await conn.execute(
                f"UPDATE {self._claims} SET state = %s, updated_at = %s, ended_at = %s, "
                f"reason = %s WHERE id = %s RETURNING {CLAIM_SELECT}",
                (state.value, now, now, reason, claim_id),
            )
            ended = await cur.fetchone()
            if ended is None:  # the claim row is locked above: this cannot miss
                raise StoreError(f"claim {claim_id} vanished while ending it")
            return claim_from_row(ended), worker

    async def renew_claim(self, claim_id: str, *, expires_at: float, now: float) -> Claim | None:
        """Extend a bound claim's lease."""
        row = await self._one(
            f"UPDATE {self._claims} SET expires_at = %s, updated_at = %s "
            f"WHERE id = %s AND state = %s RETURNING {CLAIM_SELECT}",
            (expires_at, now, claim_id, ClaimState.BOUND.value),
        )
        return claim_from_row(row) if row else None

    async def get_claim(self, claim_id: str) -> Claim | None:
        """One claim."""
        row = await self._one(
            f"SELECT {CLAIM_SELECT} FROM {self._claims} WHERE id = %s", (claim_id,)
        )
        return claim_from_row(row) if row else None

    async def list_claims(
        self,
        *,
        states: Collection[ClaimState] | None = None,
        expires_before: float | None = None,
        owner: str | None = None,
        limit: int | None = None,
    ) -> list[Claim]:
        """Claims matching every filter, oldest first (`expires_before` is inclusive)."""
        where, params = _filters(owner=owner, states=states)
        if expires_before is not None:
            where += (" AND" if where else " WHERE") + " expires_at <= %s"
            params.append(expires_before)
        sql = f"SELECT {CLAIM_SELECT} FROM {self._claims}{where} ORDER BY created_at, id"
        if limit is not None:
            sql += " LIMIT %s"
            params.append(int(limit))
        return [claim_from_row(r) for r in await self._all(sql, params)]

    # -- replicas and leases ----------------------------------------------------------------

    async def register_instance(
        self, instance_id: str, *, now: float, meta: Mapping[str, Any]
    ) -> None:
        """Insert an active replica."""
        async with self._connection() as conn:
            await conn.execute(
                f"INSERT INTO {self._instances} (id, started_at, heartbeat_at, state, meta) "
                "VALUES (%s, %s, %s, 'active', %s::jsonb)",
                (instance_id, now, now, dump_json(meta)),
            )

    async def heartbeat_instance(self, instance_id: str, *, now: float) -> bool:
        """Stamp the heartbeat of an active replica."""
        async with self._connection() as conn:
            cur = await conn.execute(
                f"UPDATE {self._instances} SET heartbeat_at = %s "
                "WHERE id = %s AND state = 'active'",
                (now, instance_id),
            )
            return cur.rowcount == 1

    async def expire_instances(
        self, *, before: float, now: float, keep: str | None = None
    ) -> list[str]:
        """Expire active replicas with a heartbeat older than `before`, except `keep`."""
        rows = await self._all(
            f"WITH expired AS (UPDATE {self._instances} SET state = 'expired' "
            "WHERE state = 'active' AND heartbeat_at < %s AND id IS DISTINCT FROM %s "
            "RETURNING id, started_at) "
            "SELECT id FROM expired ORDER BY started_at, id",
            (before, keep),
        )
        return [r[0] for r in rows]

    async def stop_instance(self, instance_id: str, *, now: float) -> None:
        """Mark a replica stopped."""
        async with self._connection() as conn:
            await conn.execute(
                f"UPDATE {self._instances} SET state = 'stopped', heartbeat_at = %s WHERE id = %s",
                (now, instance_id),
            )

    async def list_instances(self) -> list[Instance]:
        """All replicas."""
        rows = await self._all(
            f"SELECT id, started_at, heartbeat_at, state, meta FROM {self._instances} "
            "ORDER BY started_at, id"
        )
        return [instance_from_row(r) for r in rows]

    async def acquire_lease(
        self, name: str, *, holder: str, now: float, duration_s: float
    ) -> LeaseRecord | None:
        """Take or renew the lease in one statement: insert, or update if ours, free or expired.

        Renewing an unexpired lease keeps its epoch; anything else starts a new term.
        """
        row = await self._one(
            f"INSERT INTO {self._leases} AS l (name, holder, epoch, renewed_at, duration_s) "
            "VALUES (%(name)s, %(holder)s, 1, %(now)s, %(duration)s) "
            "ON CONFLICT (name) DO UPDATE SET "
            "holder = EXCLUDED.holder, "
            "epoch = CASE WHEN l.holder = EXCLUDED.holder "
            "AND %(now)s < l.renewed_at + l.duration_s THEN l.epoch ELSE l.epoch + 1 END, "
            "renewed_at = EXCLUDED.renewed_at, duration_s = EXCLUDED.duration_s "
            "WHERE l.holder = EXCLUDED.holder OR l.holder = '' "
            "OR %(now)s >= l.renewed_at + l.duration_s "
            "RETURNING name, holder, epoch, renewed_at, duration_s",
            {"name": name, "holder": holder, "now": now, "duration": duration_s},
        )
        return lease_from_row(row) if row else None

    async def release_lease(self, name: str, *, holder: str, now: float) -> bool:
        """Give the lease up if we hold it."""
        async with self._connection() as conn:
            cur = await conn.execute(
                f"UPDATE {self._leases} SET holder = '', renewed_at = %s "
                "WHERE name = %s AND holder = %s",
                (now, name, holder),
            )
            return cur.rowcount == 1

    async def get_lease(self, name: str) -> LeaseRecord | None:
        """The lease row."""
        row = await self._one(
            f"SELECT name, holder, epoch, renewed_at, duration_s FROM {self._leases} "
            "WHERE name = %s",
            (name,),
        )
        return lease_from_row(row) if row else None

    # -- demand and housekeeping -------------------------------------------------------------

    async def record_demand(
        self, instance_id: str, demand: Mapping[str, tuple[int, int]], *, now: float
    ) -> None:
        """Upsert this replica's demand rows in one statement."""
        if not demand:
            return
        pools = sorted(demand)
        async with self._connection() as conn:
            await conn.execute(
                f"INSERT INTO {self._s}.demand (pool, instance, misses, waiting, updated_at) "
                "SELECT p, %s, m, w, %s FROM unnest(%s::text[], %s::bigint[], %s::int[]) "
                "AS t(p, m, w) ON CONFLICT (pool, instance) DO UPDATE SET "
                "misses = EXCLUDED.misses, waiting = EXCLUDED.waiting, "
                "updated_at = EXCLUDED.updated_at",
                (
                    instance_id,
                    now,
                    pools,
                    [demand[p][0] for p in pools],
                    [demand[p][1] for p in pools],
                ),
            )

    async def read_demand(self) -> list[DemandRecord]:
        """Every replica's demand rows."""
        rows = await self._all(
            f"SELECT pool, instance, misses, waiting, updated_at FROM {self._s}.demand "
            "ORDER BY pool, instance"
        )
        return [DemandRecord(p, i, int(m), int(w), float(u)) for p, i, m, w, u in rows]

    async def purge(self, *, before: float) -> int:
        """Delete terminal history older than `before`, in one transaction."""
        async with self._tx() as conn:
            deleted = 0
            for sql in (
                f"DELETE FROM {self._s}.workers WHERE state = 'retired' AND updated_at < %s",
                f"DELETE FROM {self._s}.claims WHERE state <> 'bound' AND updated_at < %s",
                f"DELETE FROM {self._s}.demand WHERE instance IN (SELECT id FROM "
                f"{self._instances} WHERE state <> 'active' AND heartbeat_at < %s)",
                f"DELETE FROM {self._instances} WHERE state <> 'active' AND heartbeat_at < %s",
            ):
                cur = await conn.execute(sql, (before,))
                deleted += cur.rowcount
            return deleted


def _filters(
    *,
    pool: str | None = None,
    org: str | None = None,
    owner: str | None = None,
    states: Collection[Any] | None = None,
    not_owners: Collection[str] | None = None,
) -> tuple[str, list[Any]]:
    """A WHERE clause for the filters given; one SQL text per combination (prepared once)."""
    clauses: list[str] = []
    params: list[Any] = []
    for column, value in (("pool", pool), ("org", org), ("owner", owner)):
        if value is not None:
            clauses.append(f"{column} = %s")
            params.append(value)
    if not_owners:
        clauses.append("(owner IS NULL OR owner <> ALL(%s))")
        params.append(list(not_owners))
    if states is not None:
        clauses.append("state = ANY(%s)")
        params.append([s.value for s in states])
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), params
