"""The connection pool of one PostgreSQL store: psycopg errors surface as `StoreError`.

Pooled connections are in autocommit; a multi-statement write takes `tx()`, so a failure
leaves nothing half-done. Connections are not pinged on checkout (a round trip per
operation): one broken by a server restart fails the operation that finds it, like any
failed write, and the pool replaces it.

Every connection bounds how long a transaction may sit idle
(`idle_in_transaction_session_timeout`, set once when the pool opens the connection): a
replica stopped inside a transaction (SIGSTOP, a frozen VM) would otherwise hold its row
locks, and every other replica touching those rows would wait until it ran again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import AsyncCursor
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool

from stoker.domain.errors import StoreError

Connection = psycopg.AsyncConnection[TupleRow]
Params = Sequence[Any] | Mapping[str, Any]


class PooledConnection(psycopg.AsyncConnection[TupleRow]):
    """A connection of the pool, with the cursor its single statements reuse (a new
    cursor per statement costs about a tenth of a round trip)."""

    _reused: AsyncCursor[TupleRow] | None = None

    def reused_cursor(self) -> AsyncCursor[TupleRow]:
        """This connection's cursor for one statement at a time, made once."""
        cur = self._reused
        if cur is None:
            cur = self._reused = self.cursor()
        return cur


@dataclass(frozen=True, slots=True)
class PoolOptions:
    """How many connections to keep and open, whether statements are prepared on the server
    (None: never, as behind a transaction-mode pooler), the longest wait for one, how
    long a transaction may sit idle before the server ends it (0: no bound),
    and whether a commit waits for the disk (False: `synchronous_commit = off`)."""

    min_size: int = 1
    max_size: int = 10
    prepare_threshold: int | None = 5
    timeout_s: float = 30.0
    idle_in_transaction_ms: int = 0
    synchronous_commit: bool = True

    def __post_init__(self) -> None:
        if self.min_size < 0 or self.max_size < max(1, self.min_size):
            raise ValueError(
                "need 0 <= min_size <= max_size and max_size >= 1, "
                f"got {self.min_size}, {self.max_size}"
            )
        if self.idle_in_transaction_ms < 0:
            raise ValueError(
                f"idle_in_transaction_ms must not be negative, got {self.idle_in_transaction_ms}"
            )


class Connections:
    """A psycopg pool, opened once, for the store of `schema`."""

    def __init__(self, url: str, *, schema: str, options: PoolOptions) -> None:
        self.url = url
        self._schema = schema
        self._options = options
        self._pool: AsyncConnectionPool[PooledConnection] | None = None
        self._opening = asyncio.Lock()

    async def open(self, prepare: Callable[[Connection], Awaitable[None]]) -> None:
        """Open the pool and run `prepare` (the migrations) on one connection; a no-op
        when already open."""
        async with self._opening:
            if self._pool is not None:
                return
            o = self._options
            pool: AsyncConnectionPool[PooledConnection] = AsyncConnectionPool(
                self.url,
                connection_class=PooledConnection,
                kwargs={"autocommit": True, "prepare_threshold": o.prepare_threshold},
                min_size=o.min_size,
                max_size=o.max_size,
                timeout=o.timeout_s,
                name=f"stoker-{self._schema}",
                configure=self._configure,
                open=False,
            )
            try:
                await pool.open(wait=o.min_size > 0, timeout=o.timeout_s)
                async with pool.connection() as conn:
                    await prepare(conn)
            except BaseException as exc:
                await pool.close()
                if isinstance(exc, psycopg.Error):
                    raise StoreError(
                        f"cannot open postgres store (schema {self._schema}): "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                raise
            self._pool = pool

    async def _configure(self, conn: Connection) -> None:
        """Session settings of a new connection, in one statement (in autocommit: no
        transaction stays open)."""
        o = self._options
        await conn.execute(
            "SELECT set_config('idle_in_transaction_session_timeout', %s, false), "
            "set_config('synchronous_commit', %s, false)",
            (str(o.idle_in_transaction_ms), "on" if o.synchronous_commit else "off"),
        )

    async def close(self) -> None:
        """Close the pool and its connections."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[PooledConnection]:
        """A pooled connection (autocommit); any psycopg error becomes a StoreError.

        A cancellation that arrives while the pool hands this task a connection is
        delivered, not lost: on Python 3.11 the pool's wait (`asyncio.wait_for`) can return
        the connection and drop the cancellation, and a loop being stopped would then go
        on running (`test_a_cancellation_racing_the_hand_over_is_delivered`).
        """
        pool = self._pool
        if pool is None:
            raise StoreError("store is not open")
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        try:
            # Not `pool.connection()`: its exit commits, a call for nothing in autocommit
            # (`tx` commits or rolls back its own transaction).
            conn = await pool.getconn()
            try:
                if task is not None and task.cancelling() > cancels:
                    raise asyncio.CancelledError
                yield conn
            finally:
                await pool.putconn(conn)
        except psycopg.Error as exc:
            # PoolTimeout and PoolClosed are OperationalErrors too.
            raise StoreError(f"postgres: {type(exc).__name__}: {exc}") from exc

    @asynccontextmanager
    async def tx(self) -> AsyncIterator[PooledConnection]:
        """One transaction on a pooled connection, rolled back on any error."""
        async with self.connection() as conn, conn.transaction():
            yield conn

    async def all(self, sql: str, params: Params = ()) -> list[TupleRow]:
        """The rows of one statement."""
        async with self.connection() as conn:
            cur = conn.reused_cursor()
            await cur.execute(sql, params)
            return await cur.fetchall()

    async def one(self, sql: str, params: Params = ()) -> TupleRow | None:
        """The first row of one statement, if any."""
        async with self.connection() as conn:
            cur = conn.reused_cursor()
            await cur.execute(sql, params)
            return await cur.fetchone()
