"""PostgreSQL store: one database shared by several control-plane replicas.

Built to run behind a transaction-mode connection pooler: every table name is qualified
with the configured schema (no `SET search_path`), nothing lives in the session (only
transaction-scoped advisory locks), and server-side prepared statements can be turned off
with `prepare_threshold=None`. Times are arguments (SQL never calls `now()`).

The parts: `connections` (the pool; psycopg errors surface as `StoreError`), `schema`
(tables and migrations), `locks` (advisory locks), `workers` (the worker and claim rows,
and how their writes keep caps under concurrency) and `replicas` (replicas, leases,
demand, purge) `pools` (stored pools, on `stoker.adapters._pools`), `binds` (the binds of one
loop iteration in one statement) and `feed` (the workers' change feed, LISTEN/NOTIFY). This module
opens and closes the store.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from stoker.adapters._pools import PoolRows, PoolSql
from stoker.adapters.postgres import feed
from stoker.adapters.postgres.binds import BindBatches
from stoker.adapters.postgres.connections import Connection, Connections, PoolOptions
from stoker.adapters.postgres.ledger import LedgerRows
from stoker.adapters.postgres.pools import PostgresPoolHooks
from stoker.adapters.postgres.replicas import ReplicaRows
from stoker.adapters.postgres.reserves import ParkedOrWarmBatches
from stoker.adapters.postgres.schema import Names, migrate
from stoker.adapters.postgres.workers import (
    WorkerRows,
    bind_statement,
    parked_or_warm_statement,
    reserve_statements,
)
from stoker.domain.records import Worker

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


class PostgresStore(WorkerRows, ReplicaRows, LedgerRows, PostgresPoolHooks, PoolRows):
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
        synchronous_commit: bool = True,
    ) -> None:
        """`url`: a libpq URL or conninfo; `timeout_s`: longest wait for a pooled connection;
        `lock_idle_timeout_s`: how long any transaction (one holding a lock or a row
        included) may sit idle before PostgreSQL ends it (its client stalled);
        `synchronous_commit`: whether a commit waits for the disk (off: a database crash may
        lose the last commits, see the `store_options` reference)."""
        if lock_idle_timeout_s <= 0:
            raise ValueError(f"lock_idle_timeout_s must be > 0, got {lock_idle_timeout_s}")
        if not _IDENTIFIER.fullmatch(schema):
            raise ValueError(f"schema must be a plain SQL identifier, got {schema!r}")
        idle_ms = max(1, round(lock_idle_timeout_s * 1000))
        options = PoolOptions(
            min_size, max_size, prepare_threshold, timeout_s, idle_ms, synchronous_commit
        )
        self.url = url
        self.schema = schema
        self._db = Connections(url, schema=schema, options=options)
        self._lock_idle_ms = str(idle_ms)
        self._names = Names(schema)
        self._pool_sql = PoolSql(schema=self._names.quoted)
        self._reserve_any_sql, self._reserve_sql_by_id = reserve_statements(self._names)
        self._binds = BindBatches(self._db, self._names, bind_statement(self._names))
        self._parked_or_warm_sql = parked_or_warm_statement(self._names)
        self._parked_or_warm = ParkedOrWarmBatches(
            self._db, self._names, self._parked_or_warm_alone
        )

    async def open(self) -> None:
        """Open the connection pool and apply pending migrations; a no-op when already open."""
        await self._db.open(self._migrate)

    async def _migrate(self, conn: Connection) -> None:
        await migrate(conn, self._names, self._lock_idle_ms)

    async def close(self) -> None:
        """Close the pool and its connections."""
        await self._db.close()

    async def follow_workers(
        self,
        on_worker: Callable[[Worker], None],
        on_listening: Callable[[], Awaitable[None]],
        on_lost: Callable[[], None],
    ) -> None:
        """Follow the workers' change feed (`WorkerFeed`) on a connection of its own."""
        await feed.follow(self.url, self._names.channel, on_worker, on_listening, on_lost)

    async def schema_version(self) -> int:
        """The highest applied migration."""
        row = await self._db.one(f"SELECT COALESCE(MAX(version), 0) FROM {self._names.versions}")
        return int(row[0]) if row else 0
