"""Per-org forecasts on the leader (`stoker.control.org_forecasts`) on a real SQLite store
and virtual time: learned hourly from the store's claims, kept by a new leader, and used at
a full pool to free the parked worker of an org unlikely to come back before its TTL."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from pathlib import Path

import pytest
from test_sizing import claim_and_release, plane, pool

from stoker.adapters.sqlite import SqliteStore
from stoker.domain.records import ClaimRequest, OrgForecastBucket
from stoker.domain.states import WorkerState
from stoker.ports.clock import VirtualClock

pytestmark = pytest.mark.looptime


async def seed(path: Path, now: float, rates: dict[str, float]) -> None:
    """A day learned of each org (claims per second, every hour of every day)."""
    store = SqliteStore(str(path / "stoker.db"))
    await store.open()
    await store.record_org_forecast(
        [
            OrgForecastBucket("p", org, bucket, rate, 0.0, 1, now - 60)
            for org, rate in rates.items()
            for bucket in range(48)
        ]
    )
    await store.close()


async def park_two(cp: object, clock: VirtualClock) -> dict[str, str]:
    """At a pool of two with one warm: busy and quiet claim and release; both park."""
    workers = {}
    for org in ("busy", "quiet"):
        await cp.run_janitor_pass()  # type: ignore[attr-defined]
        await asyncio.sleep(1.0)
        claim = await cp.claim(ClaimRequest(pool="p", org=org, timeout_s=30))  # type: ignore[attr-defined]
        await cp.release(claim.id)  # type: ignore[attr-defined]
        workers[org] = claim.worker_id
    return workers


async def parked_of(cp: object) -> set[str]:
    rows = await cp.store.list_workers(states=[WorkerState.HOT_IDLE])  # type: ignore[attr-defined]
    return {w.org or "" for w in rows}


async def test_a_full_pool_frees_the_parked_worker_of_an_org_unlikely_to_return(
    tmp_path: Path,
) -> None:
    clock = VirtualClock()
    await seed(tmp_path, clock.now(), {"busy": 0.01, "quiet": 0.0})
    spec = replace(pool(), warm_target=1, max_workers=2, hot_idle_ttl=600)
    async with plane(tmp_path, spec, clock=clock) as cp:
        await park_two(cp, clock)
        assert await parked_of(cp) == {"busy", "quiet"}
        report = await cp.run_janitor_pass()
        # quiet's forecast gives no claim within the 600 s left: its worker makes room.
        assert report.retired == {"reclaimed": 1}
        await asyncio.sleep(1.0)
        assert await parked_of(cp) == {"busy"}
        report = await cp.run_janitor_pass()
        assert report.spawned == {"p": 1}
        sizing = cp.janitor.sizing("p")
        assert sizing is not None and (sizing.org_forecasts, sizing.orgs_tracked) == (2, 2)
        assert cp.metrics.registry.get_sample_value("stoker_pool_org_forecasts", {"pool": "p"}) == 2


async def test_without_org_forecasts_the_parked_workers_wait_for_their_ttl(
    tmp_path: Path,
) -> None:
    for n, (rates, switch) in enumerate([({"busy": 0.01, "quiet": 0.0}, False), ({}, True)]):
        clock = VirtualClock()
        path = tmp_path / str(n)
        path.mkdir()
        await seed(path, clock.now(), rates)
        spec = replace(pool(org_forecast=switch), warm_target=1, max_workers=2, hot_idle_ttl=600)
        async with plane(path, spec, clock=clock) as cp:
            await park_two(cp, clock)
            report = await cp.run_janitor_pass()
            assert report.retired == {} and report.capped == {"p"}
            assert await parked_of(cp) == {"busy", "quiet"}


async def test_orgs_are_learned_from_the_stores_claims_and_kept_by_a_new_leader(
    tmp_path: Path,
) -> None:
    clock = VirtualClock()
    spec = pool()
    async with plane(tmp_path, spec, clock=clock) as cp:
        now = clock.now()
        clock.advance(math.ceil(now / 3600) * 3600 + 1 - now)
        await cp.run_janitor_pass()
        for i in range(6):
            await claim_and_release(cp, "acme" if i % 3 else "globex")
        clock.advance(3600)
        await cp.run_janitor_pass()
        rows = await cp.store.read_org_forecast()
        assert {(b.org, round(b.mean * 3600)) for b in rows} == {("acme", 4), ("globex", 2)}
        sizing = cp.janitor.sizing("p")
        # One hour is not enough history: tracked, not yet forecast.
        assert sizing is not None and (sizing.org_forecasts, sizing.orgs_tracked) == (0, 2)
    async with plane(tmp_path, spec, clock=clock) as again:
        await again.run_janitor_pass()
        sizing = again.janitor.sizing("p")
        assert sizing is not None and sizing.orgs_tracked == 2
        # The same hour is not learned twice by the new leader.
        assert await again.store.read_org_forecast() == rows
