"""The SQLite store's stored pools: the two hooks of `stoker.adapters._pools.PoolRows`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stoker.adapters._pools import DeletionCheck, Params, PoolSql, PoolWrite, WriteOutcome
from stoker.adapters.sqlite.batching import GroupCommit
from stoker.domain.errors import NotFound

SQL = PoolSql()


class SqlitePoolHooks:
    """Reads on the connection; a write in the group commit's transaction (`BEGIN
    IMMEDIATE`: no other process writes meanwhile)."""

    _writes: GroupCommit
    _pool_sql = SQL

    async def _pool_rows(self, sql: str, params: Params) -> Sequence[Sequence[Any]]:
        return self._writes.read(sql, params)

    async def _pool_write(self, write: PoolWrite) -> WriteOutcome:
        async with self._writes.tx() as db:
            if db.execute(*write.cas).rowcount != 1:
                current = db.execute(SQL.generation_of, {"name": write.pool}).fetchone()
                return WriteOutcome(None, None if current is None else int(current[0]))
            changed = 0
            for statement in write.rest:
                changed = db.execute(*statement).rowcount
            if write.required is not None and changed != 1:
                raise NotFound(write.required)  # the savepoint undoes the bump
            return WriteOutcome(db.execute(SQL.pool_by_name, {"name": write.pool}).fetchone())

    async def _pool_delete(self, name: str, check: DeletionCheck) -> tuple[int, dict[str, int]]:
        params = {"pool": name}
        async with self._writes.tx() as db:
            pool = db.execute(SQL.pool_to_delete, params).fetchone()
            check(pool, db.execute(SQL.pool_in_use, params).fetchone())
            assert pool is not None  # the check raises NotFound
            removed = {table: db.execute(sql, params).rowcount for table, sql in SQL.pool_cascade}
            return int(pool[0]), removed
