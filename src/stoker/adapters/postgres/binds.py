"""Group commit of binds: the binds asked for in one iteration of the event loop go to
PostgreSQL as one statement, one round trip and one commit for all of them.

In a burst of claims many activations end together; each bind was a round trip and a
commit that waited for the WAL of its own. A batch moves every worker at its fence and
inserts the claims of those that moved, as the single statement does; a worker whose
compare-and-set misses gets None, as alone. A batch that fails (an Idempotency-Key taken,
a lost connection) is run again bind by bind, so each caller gets the answer its own
statement gives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from psycopg.rows import TupleRow

from stoker.adapters._rows import CLAIM_SELECT, WORKER_COLUMNS
from stoker.adapters._schema import CLAIMS, POSTGRES
from stoker.adapters.postgres.connections import Connections
from stoker.adapters.postgres.schema import Names
from stoker.domain.errors import StoreError

#: A bind's parameters, in the single statement's order: now, claim id, worker id, epoch,
#: version, org, then the claim's row.
Params = Sequence[Any]
_Waiting = tuple[Params, "asyncio.Future[TupleRow | None]"]


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
    """Collects the binds of one loop iteration and runs them as one statement."""

    def __init__(self, db: Connections, names: Names, single_sql: str) -> None:
        self._db = db
        self._single_sql = single_sql
        self._batch_sql = batch_statement(names)
        self._waiting: list[_Waiting] = []
        self._running: set[asyncio.Task[None]] = set()

    async def bind(self, params: Params) -> TupleRow | None:
        """The moved worker's row, None when its compare-and-set missed."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[TupleRow | None] = loop.create_future()
        if not self._waiting:
            loop.call_soon(self._flush)
        self._waiting.append((params, answer))
        return await answer

    def _flush(self) -> None:
        batch, self._waiting = self._waiting, []
        task = asyncio.ensure_future(self._run(batch))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[_Waiting]) -> None:
        workers = {params[2] for params, _ in batch}
        if len(batch) > 1 and len(workers) == len(batch):
            try:
                rows = await self._db.all(
                    self._batch_sql,
                    [list(column) for column in zip(*(p for p, _ in batch), strict=True)],
                )
            except StoreError:
                pass  # each on its own, below: each gets its own statement's answer
            else:
                by_worker = {row[0]: row for row in rows}
                for params, answer in batch:
                    if not answer.done():
                        answer.set_result(by_worker.get(params[2]))
                return
        await asyncio.gather(*(self._one(params, answer) for params, answer in batch))

    async def _one(self, params: Params, answer: asyncio.Future[TupleRow | None]) -> None:
        try:
            row = await self._db.one(self._single_sql, params)
        except StoreError as exc:
            if not answer.done():
                answer.set_exception(exc)
            return
        if not answer.done():
            answer.set_result(row)
