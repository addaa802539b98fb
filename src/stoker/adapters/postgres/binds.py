"""The binds of one loop iteration as one statement (`batches`): each bind's values are
one element of the statement's arrays; it moves every worker at its fence and inserts
the claims of those that moved, as the single statement does, and a worker whose
compare-and-set misses gets None, as alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from psycopg.rows import TupleRow

from stoker.adapters._rows import CLAIM_SELECT, WORKER_COLUMNS
from stoker.adapters._schema import CLAIMS, POSTGRES
from stoker.adapters.postgres.batches import LoopBatches
from stoker.adapters.postgres.connections import Connections
from stoker.adapters.postgres.schema import Names

#: A bind's parameters, in the single statement's order: now, claim id, worker id, epoch,
#: version, org, then the claim's row.
Params = Sequence[Any]


def batch_statement(names: Names) -> str:
    """The binds of a batch in one statement: each bind's values are one element of the
    arrays, in `Params` order."""
    claim = [(f"c_{c.name}", POSTGRES.types[c.kind]) for c in CLAIMS.columns]
    columns = [
        ("now", "double precision"),
        ("claim_id", "text"),
        ("worker_id", "text"),
        ("epoch", "bigint"),
        ("version", "bigint"),
        ("org", "text"),
        *claim,
    ]
    arrays = ", ".join(f"%s::{kind}[]" for _, kind in columns)
    moved = ", ".join(f"w.{name}" for name in WORKER_COLUMNS)
    return (
        f"WITH input AS (SELECT * FROM unnest({arrays}) "
        f"AS i({', '.join(name for name, _ in columns)})), "
        f"moved AS (UPDATE {names.workers} AS w SET state = 'hot', "
        "version = w.version + 1, updated_at = i.now, claim_id = i.claim_id, "
        "idle_since = NULL FROM input AS i "
        "WHERE w.id = i.worker_id AND w.state = 'activating' AND w.epoch = i.epoch "
        f"AND w.version = i.version AND w.org = i.org RETURNING {moved}), "
        f"inserted AS (INSERT INTO {names.claims} ({CLAIM_SELECT}) "
        f"SELECT {', '.join('i.' + name for name, _ in claim)} "
        "FROM input AS i JOIN moved ON moved.id = i.worker_id) "
        "SELECT * FROM moved"
    )


class BindBatches:
    """The binds of one loop iteration, run as one statement (each worker once)."""

    def __init__(self, db: Connections, names: Names, single_sql: str) -> None:
        self._db = db
        self._single_sql = single_sql
        self._batch_sql = batch_statement(names)
        self._batches: LoopBatches[Params, TupleRow | None] = LoopBatches(
            batch=self._batch, one=self._one, group=lambda _: True, claims=lambda p: (p[2],)
        )

    async def bind(self, params: Params) -> TupleRow | None:
        """The moved worker's row, None when its compare-and-set missed."""
        return await self._batches.run(params)

    async def _batch(self, batch: list[Params]) -> list[TupleRow | None]:
        rows = await self._db.all(
            self._batch_sql, [list(column) for column in zip(*batch, strict=True)]
        )
        by_worker = {row[0]: row for row in rows}
        return [by_worker.get(params[2]) for params in batch]

    async def _one(self, params: Params) -> TupleRow | None:
        return await self._db.one(self._single_sql, params)
