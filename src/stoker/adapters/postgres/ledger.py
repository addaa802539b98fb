"""The PostgreSQL store's ledger cells and claim log rows (docs/warmth.md,
docs/claim-log.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import groupby

from stoker.adapters._ledger import (
    ARRIVAL_SETS,
    ENDING_SETS,
    LEDGER_COLUMNS,
    LOG_COLUMNS,
    arrival_row,
    ending_row,
    ledger_from_row,
    ledger_rows,
    log_from_row,
)
from stoker.adapters._schema import LEDGER
from stoker.adapters.postgres.connections import Connections
from stoker.adapters.postgres.schema import Names
from stoker.domain.ledger import HOUR_S, ClaimEnding, ClaimLogEntry, LedgerCounts, LedgerKey


def _values(columns: Sequence[str]) -> str:
    return ", ".join("%s::jsonb" if c == "hists" else "%s" for c in columns)


class LedgerRows:
    """The ledger and the claim log on PostgreSQL."""

    _db: Connections
    _names: Names

    def _upsert(self) -> str:
        return (
            f"INSERT INTO {self._names.ledger} ({', '.join(LEDGER_COLUMNS)}) "
            f"VALUES ({_values(LEDGER_COLUMNS)}) "
            f"ON CONFLICT ({', '.join(LEDGER.key)}) DO UPDATE SET "
            + ", ".join(f"{c} = EXCLUDED.{c}" for c in LEDGER_COLUMNS if c not in LEDGER.key)
        )

    def _log_insert(self) -> str:
        return (
            f"INSERT INTO {self._names.claim_log} AS c ({', '.join(LOG_COLUMNS)}) "
            f"VALUES ({_values(LOG_COLUMNS)}) ON CONFLICT (id) DO UPDATE SET "
        )

    async def record_ledger(
        self, instance_id: str, cells: Mapping[LedgerKey, LedgerCounts], *, now: float
    ) -> bool:
        """Upsert this replica's cells in one transaction, unless its registration is no
        longer active. The registration is read `FOR SHARE`: an expiry waits for the write
        to commit (and the adopter's later read of `ledger_written_at` sees it), or the
        write sees the expiry."""
        rows = ledger_rows(instance_id, cells, now)
        if not rows:
            return True
        async with self._db.tx() as conn, conn.cursor() as cur:
            await cur.execute(
                f"SELECT state FROM {self._names.instances} WHERE id = %s FOR SHARE",
                (instance_id,),
            )
            row = await cur.fetchone()
            if row is not None and row[0] != "active":
                return False
            await cur.executemany(self._upsert(), rows)
        return True

    async def read_ledger(
        self, pool: str, *, since: float, until: float
    ) -> list[tuple[LedgerKey, LedgerCounts]]:
        """Every replica's cells of the pool overlapping [since, until)."""
        rows = await self._db.all(
            f"SELECT {', '.join(LEDGER_COLUMNS)} FROM {self._names.ledger} "
            "WHERE pool = %s AND hour > %s AND hour < %s ORDER BY hour, revision, org, instance",
            (pool, since - HOUR_S, until),
        )
        return [ledger_from_row(row) for row in rows]

    async def ledger_written_at(self, instance_id: str) -> float | None:
        """The latest write time of the replica's cells."""
        row = await self._db.one(
            f"SELECT max(updated_at) FROM {self._names.ledger} WHERE instance = %s",
            (instance_id,),
        )
        return None if row is None or row[0] is None else float(row[0])

    async def first_takes(self, since: Sequence[tuple[str, float]]) -> list[float | None]:
        """Each worker's first change of owner after its time, in one query."""
        if not since:
            return []
        rows = await self._db.all(
            f"SELECT (SELECT min(t.taken_at) FROM {self._names.worker_takes} AS t "
            "WHERE t.worker_id = q.id AND t.taken_at > q.since) "
            "FROM unnest(%s::text[], %s::double precision[]) WITH ORDINALITY AS q(id, since, n) "
            "ORDER BY q.n",
            ([w for w, _ in since], [t for _, t in since]),
        )
        return [None if first is None else float(first) for (first,) in rows]

    async def record_claim_log(
        self, arrivals: Sequence[ClaimLogEntry], endings: Sequence[ClaimEnding]
    ) -> None:
        """Upsert arrivals and endings, each keeping what the other wrote."""
        if not arrivals and not endings:
            return
        arrival = self._log_insert() + ", ".join(
            [
                *(f"{c} = EXCLUDED.{c}" for c in ARRIVAL_SETS),
                "outcome = CASE WHEN c.held_s IS NULL THEN EXCLUDED.outcome ELSE c.outcome END",
            ]
        )
        ending = self._log_insert() + ", ".join(f"{c} = EXCLUDED.{c}" for c in ENDING_SETS)
        # Every row in the order of its id, arrivals and endings alike: one replica writes
        # a claim's arrival and another its ending, and two transactions that lock the same
        # rows in different orders deadlock (one replica's arrival of X then ending of W,
        # the other's arrival of W then ending of X).
        rows = sorted(
            [(a.id, 0, arrival, arrival_row(a)) for a in arrivals]
            + [(e.id, 1, ending, ending_row(e)) for e in endings],
            key=lambda row: (row[0], row[1]),
        )
        async with self._db.tx() as conn, conn.cursor() as cur:
            for statement, run in groupby(rows, key=lambda row: row[2]):
                await cur.executemany(statement, [params for *_, params in run])

    async def read_claim_log(
        self,
        *,
        since: float,
        until: float,
        pool: str | None = None,
        after: tuple[float, str] | None = None,
        limit: int = 1000,
    ) -> list[ClaimLogEntry]:
        """A page of the log, by arrival and id (the `claim_log_at` index)."""
        sql = (
            f"SELECT {', '.join(LOG_COLUMNS)} FROM {self._names.claim_log} "
            "WHERE at >= %s AND at < %s"
        )
        params: list[object] = [since, until]
        if pool is not None:
            sql += " AND pool = %s"
            params.append(pool)
        if after is not None:
            sql += " AND (at, id) > (%s, %s)"
            params += [after[0], after[1]]
        sql += " ORDER BY at, id LIMIT %s"
        params.append(max(0, limit))
        return [log_from_row(row) for row in await self._db.all(sql, tuple(params))]

    async def purge_ledger(self, *, before: float, limit: int) -> int:
        """Delete at most `limit` old cells and log rows, oldest first."""
        if limit <= 0:
            return 0
        n = self._names
        async with self._db.tx() as conn:
            cur = await conn.execute(
                f"DELETE FROM {n.ledger} WHERE ctid IN (SELECT ctid FROM {n.ledger} "
                "WHERE hour <= %s ORDER BY hour LIMIT %s)",
                (before - HOUR_S, limit),
            )
            deleted = cur.rowcount
            if deleted < limit:
                cur = await conn.execute(
                    f"DELETE FROM {n.claim_log} WHERE ctid IN (SELECT ctid FROM {n.claim_log} "
                    "WHERE at < %s ORDER BY at LIMIT %s)",
                    (before, limit - deleted),
                )
                deleted += cur.rowcount
            return deleted
