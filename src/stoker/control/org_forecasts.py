"""The leader's per-org forecasts: each pool's busiest orgs' new-session rates, learned once
an hour from the claims in the store, and what they free at a full pool (docs/scaling.md).

The buckets are loaded from the store when this replica starts leading and written (with
the orgs evicted) when an hour is learned, so a new leader goes on from the last one's.
An hour is learned from the store's claims of that hour, whoever led then; a leader that
starts with nothing stored learns only the hours it saw at least half of (as the pool's
forecast), so that a new deployment does not read its first minutes as a quiet hour.
"""

from __future__ import annotations

from stoker.control import logs
from stoker.domain.errors import StoreError
from stoker.domain.records import OrgForecastBucket, Worker
from stoker.domain.specs import PoolSpec
from stoker.policy.forecast import HOUR_S
from stoker.policy.org_forecast import OrgForecasts
from stoker.policy.reaping import idle_expires_at
from stoker.ports.store import ReplicaStore


class OrgOutlook:
    """Per pool: the orgs' forecasts, learned hourly and kept in the store."""

    def __init__(self, store: ReplicaStore) -> None:
        self._store = store
        self._pools: dict[str, OrgForecasts] | None = None
        #: The buckets read when this replica started leading (a pool added later starts
        #: from its own).
        self._stored: list[OrgForecastBucket] = []
        #: When this replica first read (the hours it saw, while nothing is stored).
        self._since: float | None = None

    def of(self, pool: str) -> OrgForecasts | None:
        """The pool's org forecasts (None before they were loaded, or turned off)."""
        return (self._pools or {}).get(pool)

    async def read(self, pools: list[PoolSpec], now: float) -> None:
        """Once per pass: load the forecasts the first time, learn the hour that closed."""
        if self._since is None:
            self._since = now
        wanted = [p for p in pools if p.demand.forecast and p.demand.org_forecast]
        if not wanted or not await self._load(wanted):
            return
        assert self._pools is not None
        hour = int(now // HOUR_S) - 1
        due = [
            p.name
            for p in wanted
            if self._pools[p.name].due(now) == hour and self._seen(self._pools[p.name], hour)
        ]
        if not due:
            return
        try:
            counted = await self._store.claims_by_org(
                since=hour * HOUR_S, before=(hour + 1) * HOUR_S
            )
        except StoreError as exc:
            logs.event("org_forecast_read_failed", error=str(exc), level=logs.WARNING)
            return
        buckets, dropped = [], []
        for name in due:
            claims = {org: n for pool, org, n in counted if pool == name}
            learned = self._pools[name].learn(hour, claims, now)
            buckets += learned.buckets
            dropped += [(name, org) for org in learned.dropped]
        try:
            await self._store.record_org_forecast(buckets, drop=dropped)
        except StoreError as exc:
            # Kept in memory; the next hour's write carries the buckets it changes again.
            logs.event("org_forecast_write_failed", error=str(exc), level=logs.WARNING)

    def _seen(self, forecasts: OrgForecasts, hour: int) -> bool:
        """Whether `hour` may be learned: something was learned before (the store has the
        claims of any hour), or this replica saw at least half of it."""
        if forecasts.last_hour is not None:
            return True
        assert self._since is not None
        return self._since <= hour * HOUR_S + HOUR_S / 2

    async def _load(self, pools: list[PoolSpec]) -> bool:
        """Load the stored buckets once, for every pool; False while the store fails."""
        if self._pools is None:
            try:
                self._stored = await self._store.read_org_forecast()
            except StoreError as exc:
                logs.event("org_forecast_read_failed", error=str(exc), level=logs.WARNING)
                return False
            self._pools = {}
        for pool in pools:
            if pool.name not in self._pools:
                self._pools[pool.name] = OrgForecasts(
                    pool.name, pool.demand.org_forecast_orgs, self._stored
                )
        return True

    def chance(self, pool: PoolSpec, worker: Worker, now: float) -> float | None:
        """The chance that a parked worker's org claims again before its TTL runs out;
        None without that org's forecast."""
        forecasts = self.of(pool.name)
        if forecasts is None or worker.org is None or not pool.demand.org_forecast:
            return None
        return forecasts.chance(worker.org, now, idle_expires_at(worker), pool.demand.quantile)
