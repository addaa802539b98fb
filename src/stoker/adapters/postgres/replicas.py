"""The PostgreSQL store's rows about replicas: registrations, leases, demand, and the purge
of old history."""

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
    instance_from_row,
    lease_from_row,
    org_forecast_select,
)
from stoker.adapters.postgres.connections import Connections
from stoker.adapters.postgres.schema import Names
from stoker.domain.records import (
    DemandRecord,
    ForecastBucket,
    Instance,
    LeaseRecord,
    OrgForecastBucket,
    PoolSizingRecord,
)
from stoker.ports.store import DemandCounts


class ReplicaRows:
    """Replicas, leases, demand and the purge."""

    _db: Connections
    _names: Names

    async def register_instance(
        self, instance_id: str, *, now: float, meta: Mapping[str, Any]
    ) -> None:
        """Insert an active replica."""
        async with self._db.connection() as conn:
            await conn.execute(
                f"INSERT INTO {self._names.instances} (id, started_at, heartbeat_at, state, meta) "
                "VALUES (%s, %s, %s, 'active', %s::jsonb)",
                (instance_id, now, now, dump_json(meta)),
            )

    async def heartbeat_instance(self, instance_id: str, *, now: float) -> bool:
        """Stamp the heartbeat of an active replica."""
        async with self._db.connection() as conn:
            cur = await conn.execute(
                f"UPDATE {self._names.instances} SET heartbeat_at = %s "
                "WHERE id = %s AND state = 'active'",
                (now, instance_id),
            )
            return cur.rowcount == 1

    async def expire_instances(
        self, *, before: float, now: float, keep: str | None = None
    ) -> list[str]:
        """Expire active replicas with a heartbeat older than `before`, except `keep`."""
        rows = await self._db.all(
            f"WITH expired AS (UPDATE {self._names.instances} SET state = 'expired' "
            "WHERE state = 'active' AND heartbeat_at < %s AND id IS DISTINCT FROM %s "
            "RETURNING id, started_at) "
            "SELECT id FROM expired ORDER BY started_at, id",
            (before, keep),
        )
        return [r[0] for r in rows]

    async def stop_instance(self, instance_id: str, *, now: float) -> None:
        """Mark a replica stopped."""
        async with self._db.connection() as conn:
            await conn.execute(
                f"UPDATE {self._names.instances} SET state = 'stopped', heartbeat_at = %s "
                "WHERE id = %s",
                (now, instance_id),
            )

    async def list_instances(self) -> list[Instance]:
        """All replicas."""
        rows = await self._db.all(
            f"SELECT id, started_at, heartbeat_at, state, meta FROM {self._names.instances} "
            "ORDER BY started_at, id"
        )
        return [instance_from_row(r) for r in rows]

    async def acquire_lease(
        self, name: str, *, holder: str, now: float, duration_s: float
    ) -> LeaseRecord | None:
        """Take or renew the lease in one statement: insert, or update if ours, free or expired.

        Renewing an unexpired lease keeps its epoch; anything else starts a new term.
        """
        row = await self._db.one(
            f"INSERT INTO {self._names.leases} AS l "
            "(name, holder, epoch, renewed_at, duration_s) "
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
        async with self._db.connection() as conn:
            cur = await conn.execute(
                f"UPDATE {self._names.leases} SET holder = '', renewed_at = %s "
                "WHERE name = %s AND holder = %s",
                (now, name, holder),
            )
            return cur.rowcount == 1

    async def get_lease(self, name: str) -> LeaseRecord | None:
        """The lease row."""
        row = await self._db.one(
            f"SELECT name, holder, epoch, renewed_at, duration_s FROM {self._names.leases} "
            "WHERE name = %s",
            (name,),
        )
        return lease_from_row(row) if row else None

    async def record_demand(
        self, instance_id: str, demand: Mapping[str, DemandCounts], *, now: float
    ) -> None:
        """Upsert this replica's demand rows in one statement."""
        if not demand:
            return
        pools = sorted(demand)
        counts = [demand_row(demand[p]) for p in pools]
        async with self._db.connection() as conn:
            await conn.execute(
                f"INSERT INTO {self._names.demand} "
                "(pool, instance, misses, waiting, claims, updated_at) "
                "SELECT p, %s, m, w, c, %s "
                "FROM unnest(%s::text[], %s::bigint[], %s::int[], %s::bigint[]) "
                "AS t(p, m, w, c) ON CONFLICT (pool, instance) DO UPDATE SET "
                "misses = EXCLUDED.misses, waiting = EXCLUDED.waiting, "
                "claims = EXCLUDED.claims, updated_at = EXCLUDED.updated_at",
                (
                    instance_id,
                    now,
                    pools,
                    [c[0] for c in counts],
                    [c[1] for c in counts],
                    [c[2] for c in counts],
                ),
            )

    async def read_demand(self) -> list[DemandRecord]:
        """Every replica's demand rows."""
        rows = await self._db.all(
            "SELECT pool, instance, misses, waiting, updated_at, claims FROM "
            f"{self._names.demand} ORDER BY pool, instance"
        )
        return [demand_from_row(row) for row in rows]

    async def record_sizing(self, sizings: Sequence[PoolSizingRecord]) -> None:
        """Insert or replace each pool's published sizing in one statement."""
        if not sizings:
            return
        rows = [POOL_SIZING_ROWS.to_row(s) for s in sorted(sizings, key=lambda s: s.pool)]
        async with self._db.connection() as conn:
            await conn.execute(
                f"INSERT INTO {self._names.pool_sizing} "
                "(pool, instance, sized_at, desired_warm, demand, sizing, rollout_waits) "
                "SELECT * FROM unnest(%s::text[], %s::text[], %s::double precision[], "
                "%s::int[], %s::int[], %s::jsonb[], %s::text[]) "
                "ON CONFLICT (pool) DO UPDATE SET instance = EXCLUDED.instance, "
                "sized_at = EXCLUDED.sized_at, desired_warm = EXCLUDED.desired_warm, "
                "demand = EXCLUDED.demand, sizing = EXCLUDED.sizing, "
                "rollout_waits = EXCLUDED.rollout_waits",
                tuple(list(column) for column in zip(*rows, strict=True)),
            )

    async def read_sizing(self) -> list[PoolSizingRecord]:
        """Every pool's published sizing."""
        rows = await self._db.all(POOL_SIZING_SELECT.format(table=self._names.pool_sizing))
        return [POOL_SIZING_ROWS.from_row(row) for row in rows]

    async def record_forecast(self, buckets: Sequence[ForecastBucket]) -> None:
        """Insert or replace forecast buckets in one statement."""
        if not buckets:
            return
        rows = [astuple(b) for b in buckets]
        async with self._db.connection() as conn:
            await conn.execute(
                f"INSERT INTO {self._names.forecast} "
                "(pool, level, bucket, mean, var, seen, updated_at) "
                "SELECT * FROM unnest(%s::text[], %s::text[], %s::int[], "
                "%s::double precision[], %s::double precision[], %s::bigint[], "
                "%s::double precision[]) "
                "ON CONFLICT (pool, level, bucket) DO UPDATE SET mean = EXCLUDED.mean, "
                "var = EXCLUDED.var, seen = EXCLUDED.seen, updated_at = EXCLUDED.updated_at",
                tuple(list(column) for column in zip(*rows, strict=True)),
            )

    async def read_forecast(self) -> list[ForecastBucket]:
        """Every pool's forecast buckets."""
        rows = await self._db.all(forecast_select(self._names.forecast))
        return [ForecastBucket(*row) for row in rows]

    async def record_org_forecast(
        self, buckets: Sequence[OrgForecastBucket], *, drop: Sequence[tuple[str, str]] = ()
    ) -> None:
        """Delete the buckets of the orgs in `drop`, insert or replace `buckets`, in one
        transaction of two statements."""
        if not buckets and not drop:
            return
        table = self._names.org_forecast
        async with self._db.tx() as conn:
            if drop:
                pools, orgs = (list(c) for c in zip(*drop, strict=True))
                await conn.execute(
                    f"DELETE FROM {table} WHERE (pool, org) IN "
                    "(SELECT * FROM unnest(%s::text[], %s::text[]))",
                    (pools, orgs),
                )
            if buckets:
                await conn.execute(
                    f"INSERT INTO {table} (pool, org, bucket, mean, var, seen, updated_at) "
                    "SELECT * FROM unnest(%s::text[], %s::text[], %s::int[], "
                    "%s::double precision[], %s::double precision[], %s::bigint[], "
                    "%s::double precision[]) "
                    "ON CONFLICT (pool, org, bucket) DO UPDATE SET mean = EXCLUDED.mean, "
                    "var = EXCLUDED.var, seen = EXCLUDED.seen, updated_at = EXCLUDED.updated_at",
                    tuple(list(c) for c in zip(*(astuple(b) for b in buckets), strict=True)),
                )

    async def read_org_forecast(self) -> list[OrgForecastBucket]:
        """Every pool's per-org forecast buckets."""
        rows = await self._db.all(org_forecast_select(self._names.org_forecast))
        return [ORG_FORECAST_ROWS.from_row(row) for row in rows]

    async def record_outcomes(
        self, instance_id: str, counts: Mapping[str, Mapping[str, int]], *, now: float
    ) -> None:
        """Upsert this replica's outcome counts in one statement."""
        rows = [
            (rollout, outcome, n)
            for rollout, outcomes in sorted(counts.items())
            for outcome, n in sorted(outcomes.items())
        ]
        if not rows:
            return
        rollouts, outcomes, ns = (list(c) for c in zip(*rows, strict=True))
        async with self._db.connection() as conn:
            await conn.execute(
                f"INSERT INTO {self._names.rollout_outcomes} "
                "(rollout, instance, outcome, count, updated_at) "
                "SELECT r, %s, o, n, %s FROM unnest(%s::text[], %s::text[], %s::bigint[]) "
                "AS t(r, o, n) ON CONFLICT (rollout, instance, outcome) DO UPDATE SET "
                "count = EXCLUDED.count, updated_at = EXCLUDED.updated_at",
                (instance_id, now, rollouts, outcomes, ns),
            )

    async def read_outcomes(self, rollout_ids: Sequence[str]) -> dict[str, dict[str, int]]:
        """Every replica's outcome counts of the rollouts, summed."""
        if not rollout_ids:
            return {}
        rows = await self._db.all(
            f"SELECT rollout, outcome, SUM(count) FROM {self._names.rollout_outcomes} "
            "WHERE rollout = ANY(%s::text[]) GROUP BY rollout, outcome",
            (list(rollout_ids),),
        )
        summed: dict[str, dict[str, int]] = {}
        for rollout, outcome, n in rows:
            summed.setdefault(rollout, {})[outcome] = int(n)
        return summed

    async def claims_by_org(self, *, since: float, before: float) -> list[tuple[str, str, int]]:
        """Claims created in [since, before), by pool and org (the `claims_created` index)."""
        rows = await self._db.all(claims_by_org_select(self._names.claims, "%s"), (since, before))
        return [(pool, org, int(n)) for pool, org, n in rows]

    async def purge(self, *, before: float) -> int:
        """Delete terminal history older than `before`, in one transaction."""
        n = self._names
        async with self._db.tx() as conn:
            deleted = 0
            for sql in (
                f"DELETE FROM {n.workers} WHERE state = 'retired' AND updated_at < %s",
                f"DELETE FROM {n.claims} WHERE state <> 'bound' AND updated_at < %s",
                f"DELETE FROM {n.demand} WHERE instance IN (SELECT id FROM "
                f"{n.instances} WHERE state <> 'active' AND heartbeat_at < %s)",
                f"DELETE FROM {n.instances} WHERE state <> 'active' AND heartbeat_at < %s",
                f"DELETE FROM {n.rollout_outcomes} WHERE rollout IN (SELECT id FROM "
                f"{n.rollouts} WHERE ended_at IS NOT NULL AND ended_at < %s)",
                f"DELETE FROM {n.pool_sizing} WHERE sized_at < %s",
                f"DELETE FROM {n.worker_takes} WHERE taken_at < %s",
            ):
                cur = await conn.execute(sql, (before,))
                deleted += cur.rowcount
            return deleted
