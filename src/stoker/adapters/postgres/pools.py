"""The PostgreSQL store's stored pools: the two hooks of `stoker.adapters._pools.PoolRows`.

A write's first statement updates the pool row where the generation still matches: a
concurrent writer waits for that row's lock and then finds the generation moved on. A
deletion locks the pool's row, then takes the pool's spawn lock (`locks`, as a spawn within
the pool's cap does) before it counts what still uses the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stoker.adapters._pools import DeletionCheck, Params, PoolSql, PoolWrite, WriteOutcome
from stoker.adapters.postgres.connections import Connections
from stoker.adapters.postgres.locks import LOCK, lock_key
from stoker.adapters.postgres.schema import Names
from stoker.domain.errors import NotFound


class PostgresPoolHooks:
    """Reads on a pooled connection; a write in one transaction."""

    _db: Connections
    _pool_sql: PoolSql
    _names: Names
    _lock_idle_ms: str

    async def _pool_rows(self, sql: str, params: Params) -> Sequence[Sequence[Any]]:
        return await self._db.all(sql, params)

    async def _pool_write(self, write: PoolWrite) -> WriteOutcome:
        sql = self._pool_sql
        async with self._db.tx() as conn:
            cur = await conn.execute(*write.cas)
            if cur.rowcount != 1:
                cur = await conn.execute(sql.generation_of, {"name": write.pool})
                current = await cur.fetchone()
                return WriteOutcome(None, None if current is None else int(current[0]))
            changed = 0
            for statement in write.rest:
                changed = (await conn.execute(*statement)).rowcount
            if write.required is not None and changed != 1:
                raise NotFound(write.required)  # the transaction rolls back
            cur = await conn.execute(sql.pool_by_name, {"name": write.pool})
            return WriteOutcome(await cur.fetchone())

    async def _pool_delete(self, name: str, check: DeletionCheck) -> tuple[int, dict[str, int]]:
        sql, params = self._pool_sql, {"pool": name}
        async with self._db.tx() as conn:
            pool = await (await conn.execute(sql.pool_to_delete, params)).fetchone()
            if pool is not None:
                key = lock_key(self._names.schema, "pool", name)
                await conn.execute(LOCK, (self._lock_idle_ms, key))
            in_use = await (await conn.execute(sql.pool_in_use, params)).fetchone()
            check(pool, in_use or (0, 0, None))
            assert pool is not None  # the check raises NotFound
            removed = {}
            for table, statement in sql.pool_cascade:
                removed[table] = (await conn.execute(statement, params)).rowcount
            return int(pool[0]), removed
