"""The SQLite store's rows about replicas: registrations, leases, demand, and the purge of
old history."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import astuple
from typing import Any

from stoker.adapters._rows import (
    ORG_FORECAST_ROWS,
    POOL_SIZING_ROWS,
    POOL_SIZING_SELECT,
    claims_by_org_select,
    demand_from_row,
    demand_row,
    dump_json,
    forecast_select,
    lease_from_row,
    org_forecast_select,
)
from stoker.adapters._schema import FORECAST, ORG_FORECAST, POOL_SIZING, ROLLOUT_OUTCOMES, Table
from stoker.adapters.sqlite.batching import GroupCommit
from stoker.adapters.sqlite.decoded import DecodedRows
from stoker.adapters.sqlite.ownership import FileIdentity
from stoker.domain import records
from stoker.domain.records import (
    DemandRecord,
    ForecastBucket,
    Instance,
    LeaseRecord,
    PoolSizingRecord,
)
from stoker.ports.store import DemandCounts


def _upsert(table: Table) -> str:
    """Insert a row of `table` (its columns in order) or replace the one with its key."""
    names = table.names
    updates = ", ".join(f"{c} = excluded.{c}" for c in names if c not in table.key)
    return (
        f"INSERT INTO {table.name} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))}) "
        f"ON CONFLICT ({', '.join(table.key)}) DO UPDATE SET {updates}"
    )


_LEASE = "SELECT name, holder, epoch, renewed_at, duration_s FROM leases WHERE name = ?"


class ReplicaRows:
    """Replicas, leases, demand and the purge."""

    _writes: GroupCommit
    _decoded: DecodedRows
    _identity: FileIdentity | None

    async def register_instance(
        self, instance_id: str, *, now: float, meta: Mapping[str, Any]
    ) -> None:
        """Insert an active replica."""
        async with self._writes.tx() as db:
            db.execute(
                "INSERT INTO instances (id, started_at, heartbeat_at, state, meta) "
                "VALUES (?, ?, ?, 'active', ?)",
                (instance_id, now, now, dump_json(meta)),
            )

    async def heartbeat_instance(self, instance_id: str, *, now: float) -> bool:
        """Stamp the heartbeat of an active replica; StoreError when the database file was
        deleted or replaced since the store opened it (checked here, every heartbeat, not
        on every write)."""
        if self._identity is not None:
            self._identity.check()
        changed, _ = await self._writes.write_one(
            "UPDATE instances SET heartbeat_at = ? WHERE id = ? AND state = 'active'",
            (now, instance_id),
        )
        return changed == 1

    async def expire_instances(
        self, *, before: float, now: float, keep: str | None = None
    ) -> list[str]:
        """Expire active replicas with a heartbeat older than `before`, except `keep`."""
        stale = (
            "SELECT id FROM instances WHERE state = 'active' AND heartbeat_at < ? "
            "AND id IS NOT ? ORDER BY started_at, id"
        )
        if not self._writes.read(stale + " LIMIT 1", (before, keep)):
            return []  # the usual case: no write transaction at all
        async with self._writes.tx() as db:
            ids = [r[0] for r in db.execute(stale, (before, keep))]
            db.executemany(
                "UPDATE instances SET state = 'expired' WHERE id = ? AND state = 'active'",
                [(i,) for i in ids],
            )
            return ids

    async def stop_instance(self, instance_id: str, *, now: float) -> None:
        """Mark a replica stopped."""
        async with self._writes.tx() as db:
            db.execute(
                "UPDATE instances SET state = 'stopped', heartbeat_at = ? WHERE id = ?",
                (now, instance_id),
            )

    async def list_instances(self) -> list[Instance]:
        """All replicas (every pass reads them all: a row's JSON is decoded once)."""
        rows = self._writes.read(
            "SELECT id, started_at, heartbeat_at, state, meta FROM instances "
            "ORDER BY started_at, id"
        )
        return self._decoded.instances(rows)

    async def acquire_lease(
        self, name: str, *, holder: str, now: float, duration_s: float
    ) -> LeaseRecord | None:
        """Take or renew the lease by CAS."""
        async with self._writes.tx() as db:
            row = db.execute(_LEASE, (name,)).fetchone()
            if row is None:
                lease = LeaseRecord(name, holder, 1, now, duration_s)
                db.execute(
                    "INSERT INTO leases (name, holder, epoch, renewed_at, duration_s) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (name, holder, 1, now, duration_s),
                )
                return lease
            current = lease_from_row(row)
            if current.holder == holder and not current.expired(now):
                lease = LeaseRecord(name, holder, current.epoch, now, duration_s)
            elif current.holder == "" or current.expired(now):
                lease = LeaseRecord(name, holder, current.epoch + 1, now, duration_s)
            else:
                return None
            cur = db.execute(
                "UPDATE leases SET holder = ?, epoch = ?, renewed_at = ?, duration_s = ? "
                "WHERE name = ? AND holder = ? AND epoch = ?",
                (holder, lease.epoch, now, duration_s, name, current.holder, current.epoch),
            )
            return lease if cur.rowcount == 1 else None

    async def release_lease(self, name: str, *, holder: str, now: float) -> bool:
        """Give the lease up if we hold it."""
        async with self._writes.tx() as db:
            cur = db.execute(
                "UPDATE leases SET holder = '', renewed_at = ? WHERE name = ? AND holder = ?",
                (now, name, holder),
            )
            return cur.rowcount == 1

    async def get_lease(self, name: str) -> LeaseRecord | None:
        """The lease row."""
        rows = self._writes.read(_LEASE, (name,))
        return lease_from_row(rows[0]) if rows else None

    async def record_demand(
        self, instance_id: str, demand: Mapping[str, DemandCounts], *, now: float
    ) -> None:
        """Upsert this replica's demand rows."""
        sql = (
            "INSERT INTO demand (pool, instance, misses, waiting, claims, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (pool, instance) DO UPDATE SET "
            "misses = excluded.misses, waiting = excluded.waiting, "
            "claims = excluded.claims, updated_at = excluded.updated_at"
        )
        rows = [(pool, instance_id, *demand_row(c), now) for pool, c in sorted(demand.items())]
        if len(rows) == 1:
            await self._writes.write_one(sql, rows[0])
            return
        async with self._writes.tx() as db:
            db.executemany(sql, rows)

    async def read_demand(self) -> list[DemandRecord]:
        """Every replica's demand rows."""
        rows = self._writes.read(
            "SELECT pool, instance, misses, waiting, updated_at, claims FROM demand "
            "ORDER BY pool, instance"
        )
        return [demand_from_row(row) for row in rows]

    async def record_sizing(self, sizings: Sequence[PoolSizingRecord]) -> None:
        """Insert or replace each pool's published sizing, in one write."""
        if not sizings:
            return
        async with self._writes.tx() as db:
            db.executemany(_upsert(POOL_SIZING), [POOL_SIZING_ROWS.to_row(s) for s in sizings])

    async def read_sizing(self) -> list[PoolSizingRecord]:
        """Every pool's published sizing."""
        rows = self._writes.read(POOL_SIZING_SELECT.format(table="pool_sizing"))
        return [POOL_SIZING_ROWS.from_row(row) for row in rows]

    async def record_forecast(self, buckets: Sequence[ForecastBucket]) -> None:
        """Insert or replace forecast buckets."""
        if not buckets:
            return
        async with self._writes.tx() as db:
            db.executemany(_upsert(FORECAST), [astuple(b) for b in buckets])

    async def read_forecast(self) -> list[ForecastBucket]:
        """Every pool's forecast buckets."""
        rows = self._writes.read(forecast_select("forecast"))
        return [ForecastBucket(*row) for row in rows]

    async def record_org_forecast(
        self, buckets: Sequence[records.OrgForecastBucket], *, drop: Sequence[tuple[str, str]] = ()
    ) -> None:
        """Delete the buckets of the orgs in `drop`, insert or replace `buckets`: one write."""
        if not buckets and not drop:
            return
        async with self._writes.tx() as db:
            db.executemany("DELETE FROM org_forecast WHERE pool = ? AND org = ?", list(drop))
            db.executemany(_upsert(ORG_FORECAST), [astuple(b) for b in buckets])

    async def read_org_forecast(self) -> list[records.OrgForecastBucket]:
        """Every pool's per-org forecast buckets."""
        rows = self._writes.read(org_forecast_select("org_forecast"))
        return [ORG_FORECAST_ROWS.from_row(row) for row in rows]

    async def record_outcomes(
        self, instance_id: str, counts: Mapping[str, Mapping[str, int]], *, now: float
    ) -> None:
        """Upsert this replica's outcome counts, one row per rollout and outcome."""
        rows = [
            (rollout, instance_id, outcome, n, now)
            for rollout, outcomes in sorted(counts.items())
            for outcome, n in sorted(outcomes.items())
        ]
        if not rows:
            return
        async with self._writes.tx() as db:
            db.executemany(_upsert(ROLLOUT_OUTCOMES), rows)

    async def read_outcomes(self, rollout_ids: Sequence[str]) -> dict[str, dict[str, int]]:
        """Every replica's outcome counts of the rollouts, summed."""
        if not rollout_ids:
            return {}
        marks = ", ".join("?" * len(rollout_ids))
        rows = self._writes.read(
            "SELECT rollout, outcome, SUM(count) FROM rollout_outcomes "
            f"WHERE rollout IN ({marks}) GROUP BY rollout, outcome",
            tuple(rollout_ids),
        )
        summed: dict[str, dict[str, int]] = {}
        for rollout, outcome, n in rows:
            summed.setdefault(rollout, {})[outcome] = int(n)
        return summed

    async def claims_by_org(self, *, since: float, before: float) -> list[tuple[str, str, int]]:
        """Claims created in [since, before), by pool and org."""
        rows = self._writes.read(claims_by_org_select("claims", "?"), (since, before))
        return [(pool, org, int(n)) for pool, org, n in rows]

    async def purge(self, *, before: float) -> int:
        """Delete terminal history older than `before`."""
        async with self._writes.tx() as db:
            deleted = db.execute(
                "DELETE FROM workers WHERE state = 'retired' AND updated_at < ?", (before,)
            ).rowcount
            deleted += db.execute(
                "DELETE FROM claims WHERE state <> 'bound' AND updated_at < ?", (before,)
            ).rowcount
            deleted += db.execute(
                "DELETE FROM demand WHERE instance IN (SELECT id FROM instances "
                "WHERE state <> 'active' AND heartbeat_at < ?)",
                (before,),
            ).rowcount
            deleted += db.execute(
                "DELETE FROM instances WHERE state <> 'active' AND heartbeat_at < ?", (before,)
            ).rowcount
            deleted += db.execute(
                "DELETE FROM rollout_outcomes WHERE rollout IN (SELECT id FROM rollouts "
                "WHERE ended_at IS NOT NULL AND ended_at < ?)",
                (before,),
            ).rowcount
            deleted += db.execute("DELETE FROM pool_sizing WHERE sized_at < ?", (before,)).rowcount
            deleted += db.execute("DELETE FROM worker_takes WHERE taken_at < ?", (before,)).rowcount
            return int(deleted)
