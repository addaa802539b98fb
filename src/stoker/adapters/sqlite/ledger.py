"""The SQLite store's ledger cells and claim log rows (docs/warmth.md, docs/claim-log.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
from stoker.adapters.sqlite.batching import GroupCommit
from stoker.domain.ledger import HOUR_S, ClaimEnding, ClaimLogEntry, LedgerCounts, LedgerKey

_MARKS = ", ".join("?" * len(LEDGER_COLUMNS))
_UPSERT = (
    f"INSERT INTO ledger ({', '.join(LEDGER_COLUMNS)}) VALUES ({_MARKS}) "
    f"ON CONFLICT ({', '.join(LEDGER.key)}) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in LEDGER_COLUMNS if c not in LEDGER.key)
)
_LOG_INSERT = (
    f"INSERT INTO claim_log ({', '.join(LOG_COLUMNS)}) "
    f"VALUES ({', '.join('?' * len(LOG_COLUMNS))}) ON CONFLICT (id) DO UPDATE SET "
)
#: An arrival keeps an ending's outcome; an ending keeps an arrival's time and wait.
_ARRIVAL = _LOG_INSERT + ", ".join(
    [
        *(f"{c} = excluded.{c}" for c in ARRIVAL_SETS),
        "outcome = CASE WHEN claim_log.held_s IS NULL THEN excluded.outcome "
        "ELSE claim_log.outcome END",
    ]
)
_ENDING = _LOG_INSERT + ", ".join(f"{c} = excluded.{c}" for c in ENDING_SETS)


class LedgerRows:
    """The ledger and the claim log on SQLite."""

    _writes: GroupCommit

    async def record_ledger(
        self, instance_id: str, cells: Mapping[LedgerKey, LedgerCounts], *, now: float
    ) -> bool:
        """Upsert this replica's cells, unless its registration is no longer active (read
        in the same write transaction: no expiry lands between the check and the write)."""
        rows = ledger_rows(instance_id, cells, now)
        if not rows:
            return True
        async with self._writes.tx() as db:
            gone = db.execute(
                "SELECT 1 FROM instances WHERE id = ? AND state <> 'active'", (instance_id,)
            ).fetchone()
            if gone is None:
                db.executemany(_UPSERT, rows)
        return gone is None

    async def read_ledger(
        self, pool: str, *, since: float, until: float
    ) -> list[tuple[LedgerKey, LedgerCounts]]:
        """Every replica's cells of the pool overlapping [since, until)."""
        rows = self._writes.read(
            f"SELECT {', '.join(LEDGER_COLUMNS)} FROM ledger "
            "WHERE pool = ? AND hour > ? AND hour < ? ORDER BY hour, revision, org, instance",
            (pool, since - HOUR_S, until),
        )
        return [ledger_from_row(row) for row in rows]

    async def ledger_written_at(self, instance_id: str) -> float | None:
        """The latest write time of the replica's cells."""
        rows = self._writes.read(
            "SELECT max(updated_at) FROM ledger WHERE instance = ?", (instance_id,)
        )
        return None if not rows or rows[0][0] is None else float(rows[0][0])

    async def first_takes(self, since: Sequence[tuple[str, float]]) -> list[float | None]:
        """Each worker's first change of owner after its time, one indexed look-up each."""
        found: list[float | None] = []
        for worker_id, after in since:
            ((first,),) = self._writes.read(
                "SELECT min(taken_at) FROM worker_takes WHERE worker_id = ? AND taken_at > ?",
                (worker_id, after),
            )
            found.append(None if first is None else float(first))
        return found

    async def record_claim_log(
        self, arrivals: Sequence[ClaimLogEntry], endings: Sequence[ClaimEnding]
    ) -> None:
        """Upsert arrivals and endings, each keeping what the other wrote."""
        if not arrivals and not endings:
            return
        async with self._writes.tx() as db:
            db.executemany(_ARRIVAL, [arrival_row(a) for a in arrivals])
            db.executemany(_ENDING, [ending_row(e) for e in endings])

    async def read_claim_log(
        self,
        *,
        since: float,
        until: float,
        pool: str | None = None,
        after: tuple[float, str] | None = None,
        limit: int = 1000,
    ) -> list[ClaimLogEntry]:
        """A page of the log, by arrival and id."""
        sql = f"SELECT {', '.join(LOG_COLUMNS)} FROM claim_log WHERE at >= ? AND at < ?"
        params: list[object] = [since, until]
        if pool is not None:
            sql += " AND pool = ?"
            params.append(pool)
        if after is not None:
            sql += " AND (at > ? OR (at = ? AND id > ?))"
            params += [after[0], after[0], after[1]]
        sql += " ORDER BY at, id LIMIT ?"
        params.append(max(0, limit))
        return [log_from_row(row) for row in self._writes.read(sql, params)]

    async def purge_ledger(self, *, before: float, limit: int) -> int:
        """Delete at most `limit` old cells and log rows, oldest first."""
        if limit <= 0:
            return 0
        async with self._writes.tx() as db:
            deleted = db.execute(
                "DELETE FROM ledger WHERE rowid IN (SELECT rowid FROM ledger "
                "WHERE hour <= ? ORDER BY hour LIMIT ?)",
                (before - HOUR_S, limit),
            ).rowcount
            if deleted < limit:
                deleted += db.execute(
                    "DELETE FROM claim_log WHERE rowid IN (SELECT rowid FROM claim_log "
                    "WHERE at < ? ORDER BY at LIMIT ?)",
                    (before, limit - deleted),
                ).rowcount
            return int(deleted)
