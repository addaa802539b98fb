"""Demand this replica publishes: cumulative misses, claims queued, and cumulative claims
that wanted a neutral worker, per pool.

The leader's janitor reads every replica's rows (docs/operations.md: `stoker_demand`), so
the claims of every replica make the pool's demand rate. Publishing is coalesced per burst
of misses; the claim counter rides along, and every pass publishes it too.
"""

from __future__ import annotations

import asyncio

from stoker.control import logs
from stoker.control.shared import Shared
from stoker.domain.errors import StoreError
from stoker.ports.store import ReplicaStore


class DemandPublisher:
    """Counts misses and writes this replica's demand rows."""

    def __init__(self, shared: Shared, *, store: ReplicaStore) -> None:
        self._book, self._catalog = shared.book, shared.catalog
        self._clock, self._settings = shared.clock, shared.settings
        self._store = store
        #: Cumulative misses per pool (the demand signal this replica publishes).
        self._misses: dict[str, int] = dict.fromkeys(shared.catalog.pools, 0)
        #: Cumulative claims per pool that wanted a neutral worker (the demand rate).
        self._claims: dict[str, int] = dict.fromkeys(shared.catalog.pools, 0)
        self._flush: asyncio.Task[None] | None = None
        #: The demand rows last written, and when (see `publish`).
        self._published: tuple[dict[str, tuple[int, int, int]], float] | None = None

    def record_miss(self, pool: str) -> None:
        """Count one claim that found no worker (not held by its org cap) and publish soon."""
        self._misses[pool] = self._misses.get(pool, 0) + 1
        self.publish_soon()

    def record_claim(self, pool: str) -> None:
        """Count one claim that wants a neutral worker (warm or cold); published with the
        next miss or pass, not at once: the claim path writes nothing more for it."""
        self._claims[pool] = self._claims.get(pool, 0) + 1

    def claims(self, pool: str) -> int:
        """Claims of `pool` that wanted a neutral worker since this replica started."""
        return self._claims.get(pool, 0)

    def misses(self, pool: str) -> int:
        """Misses of `pool` counted since this replica started."""
        return self._misses.get(pool, 0)

    def waiting(self, pool: str) -> int:
        """Claims of `pool` queued for a warm worker (part of demand)."""
        return self._book.waiting_for_warm(pool)

    def snapshot(self) -> dict[str, tuple[int, int, int]]:
        """(cumulative misses, claims waiting now, cumulative claims) per pool."""
        return {
            name: (self.misses(name), self.waiting(name), self.claims(name))
            for name in self._catalog.pools
        }

    def publish_soon(self) -> None:
        """Publish demand once the current burst of claims has been seen (coalesced)."""
        if self._flush is None or self._flush.done():
            self._flush = self._book.spawn_task(self.publish(), "demand")

    async def publish(self) -> None:
        """Write this replica's demand rows so the leader's janitor sees them."""
        await asyncio.sleep(0)  # let the claims of the same burst record their misses first
        snapshot, now = self.snapshot(), self._clock.now()
        if (
            self._published is not None
            and self._published[0] == snapshot
            and now - self._published[1] < self._settings.instance_expiry_s / 2
        ):
            # Nothing new, and the rows stay fresh (younger than the expiry) until the
            # next pass rewrites them: no write.
            return
        try:
            await self._store.record_demand(self._book.instance_id, snapshot, now=now)
            self._published = (snapshot, now)
        except StoreError as exc:
            # The next miss or pass publishes again: counters are cumulative, nothing is lost.
            logs.event("demand_publish_failed", error=str(exc), level=logs.WARNING)
