"""The leader's sizing as every replica shows it: two replicas on one store (SQLite, and
PostgreSQL), one leading, their `GET /v1/pools` over HTTP (the app in process).

Loops off: the test runs the leader's janitor passes itself and moves the replicas' one
virtual clock with `advance` (no sleeping; PostgreSQL's I/O is real).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import prometheus_client
import pytest
from test_plane_claims import pool

from fakes import MemoryRuntime
from stoker.adapters.sqlite import SqliteStore
from stoker.api import create_app
from stoker.config import ApiConfig
from stoker.control.plane import ControlPlane
from stoker.control.published_sizing import (
    STALE_PASSES,
    TROUBLE_KEY,
    PublishedTrouble,
    ShownSizing,
    shown,
    status_of,
)
from stoker.control.sizing import SizingStatus
from stoker.control.spawning import SpawnsFailing
from stoker.control.status import shown_trouble
from stoker.domain.pools import StoredPool
from stoker.domain.records import PoolSizingRecord
from stoker.domain.specs import PlaneSettings
from stoker.ports.clock import VirtualClock
from stoker.ports.elector import SoleLeader
from stoker.ports.store import Store

SETTINGS = PlaneSettings()
#: Claims queued on a third replica: the leader sizes the pool above its static target.
QUEUED = 3


class Standby:
    """The elector of a replica that does not lead (another one holds the lease) until a
    test makes it lead."""

    def __init__(self) -> None:
        self.is_leader = False
        self.epoch = 0

    async def run(self) -> None:
        """Nothing to contend for here."""

    async def resign(self) -> None:
        """Nothing to give up."""


#: What a pool's listing says of its sizing (its age aside, which grows between reads; the
#: counts move as the pass's spawns land).
SIZED = ("desired_warm", "demand", "sizing", "rollout_waits", "sized_by", "sized_at")


def sized(body: dict[str, Any]) -> dict[str, Any]:
    """The sizing fields of a pool's body, and whether stale."""
    return {key: body[key] for key in (*SIZED, "sizing_stale")}


class Replica:
    """One plane and an HTTP client for its API."""

    def __init__(self, plane: ControlPlane, http: httpx.AsyncClient) -> None:
        self.plane, self.http = plane, http

    async def pool(self) -> dict[str, Any]:
        """`GET /v1/pools/p`, and the same pool in `GET /v1/pools`: one body."""
        one = await self.http.get("/v1/pools/p")
        assert one.status_code == 200, one.text
        listed = await self.http.get("/v1/pools")
        assert listed.status_code == 200, listed.text
        (item,) = [p for p in listed.json()["pools"] if p["name"] == "p"]
        body: dict[str, Any] = one.json()
        assert sized(item) == sized(body)
        return body


@asynccontextmanager
async def replica(
    store: Store,
    clock: VirtualClock,
    *,
    leads: bool,
    views: bool = True,
    runtime: MemoryRuntime | None = None,
) -> AsyncIterator[Replica]:
    """A started replica on `store` (loops off), the leader or a standby; `runtime`: a
    fleet it shares with another replica (else one of its own)."""
    runtime = runtime or MemoryRuntime()
    plane = ControlPlane(
        store=store,
        runtime=runtime,
        activator=runtime,
        pools=[pool(warm_target=1)],
        settings=SETTINGS,
        clock=clock,
        elector=SoleLeader() if leads else Standby(),
        views=views,
    )
    app = create_app(plane, ApiConfig(), manage_plane=False)
    await plane.start(loops=False)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://stoker") as http:
            yield Replica(plane, http)
    finally:
        await plane.stop()


async def test_a_replica_that_does_not_lead_shows_the_leaders_sizing(
    stores: list[Store],
) -> None:
    clock = VirtualClock()
    async with (
        replica(stores[0], clock, leads=True) as leader,
        replica(stores[1], clock, leads=False) as standby,
    ):
        store = leader.plane.store
        await store.record_demand("cp-elsewhere", {"p": (0, QUEUED, 0)}, now=clock.now())
        await leader.plane.run_janitor_pass()
        janitor = leader.plane.janitor
        assert janitor.desired["p"] == 1 + QUEUED and janitor.demand["p"] == QUEUED

        shown = await standby.pool()
        assert (shown["desired_warm"], shown["demand"]) == (1 + QUEUED, QUEUED)
        assert shown["sizing"] is not None and shown["sizing"]["policy"] == "static"
        assert shown["sized_by"] == leader.plane.instance_id
        assert shown["sizing_stale"] is False and shown["sizing_age_s"] < 1
        # Both replicas answer alike (behind a load balancer, request after request).
        mine = await leader.pool()
        assert sized(mine) == sized(shown)
        assert mine["sizing"] == shown["sizing"]

        # The dashboard's samples on the standby carry the same figures.
        await standby.plane.sample_pools()
        sample = standby.plane.history.samples()["p"][-1]
        assert (sample.desired_warm, sample.demand) == (1 + QUEUED, QUEUED)


async def test_a_sizing_nobody_renews_shows_as_stale_until_a_new_leader_sizes(
    stores: list[Store],
) -> None:
    clock = VirtualClock()
    async with (
        replica(stores[0], clock, leads=True) as leader,
        replica(stores[1], clock, leads=False) as standby,
    ):
        await leader.plane.store.record_demand(
            "cp-elsewhere", {"p": (0, QUEUED, 0)}, now=clock.now()
        )
        await leader.plane.run_janitor_pass()
        interval = SETTINGS.janitor_interval_s
        clock.advance(STALE_PASSES * interval - 0.5)
        assert (await standby.pool())["sizing_stale"] is False
        # The leader is gone: no pass for longer than the stale horizon.
        clock.advance(1.0)
        stale = await standby.pool()
        assert stale["sizing_stale"] is True
        assert stale["sizing_age_s"] >= STALE_PASSES * interval
        assert stale["sized_by"] == leader.plane.instance_id
        # The figures are the last ones published, marked as such, not the static target.
        assert (stale["desired_warm"], stale["demand"]) == (1 + QUEUED, QUEUED)
        # So is the dashboard's sample of that instant.
        await standby.plane.sample_pools()
        sample = standby.plane.history.samples()["p"][-1]
        assert (sample.desired_warm, sample.sizing_stale) == (1 + QUEUED, True)
        # The standby takes the lease over: its pass publishes, and both show it, fresh.
        standby.plane.elector.is_leader = True  # type: ignore[misc]
        await standby.plane.run_janitor_pass()
        for r in (standby, leader):
            now = await r.pool()
            assert now["sized_by"] == standby.plane.instance_id
            assert now["sizing_stale"] is False and now["sizing"] is not None
        await standby.plane.sample_pools()
        assert standby.plane.history.samples()["p"][-1].sizing_stale is False


async def test_a_pool_nobody_has_sized_shows_its_static_target(
    stores: list[Store],
) -> None:
    async with replica(stores[1], VirtualClock(), leads=False) as standby:
        shown = await standby.pool()
        assert (shown["desired_warm"], shown["demand"], shown["sizing"]) == (1, 0, None)
        assert shown["sized_by"] is None and shown["sizing_age_s"] is None
        assert shown["sizing_stale"] is False


async def test_a_pool_deleted_through_one_replica_leaves_the_leader_at_its_next_pass(
    stores: list[Store],
) -> None:
    """A pool neither replica's config declares is deleted through the standby: the leader
    serves it until its next pass, which forgets it: no sizing published for it, no series
    of it in its metrics, and a claim of it is the unknown pool's 404."""
    clock = VirtualClock()
    async with (
        replica(stores[0], clock, leads=True) as leader,
        replica(stores[1], clock, leads=False) as standby,
    ):
        old = pool(name="old", warm_target=0)
        await leader.plane.store.create_pool(StoredPool(old, 0), now=clock.now())
        await leader.plane.run_janitor_pass()
        await standby.plane.pools.refresh()  # what a standby's pass does
        listed = (await standby.http.get("/v1/pools")).json()["pools"]
        assert {p["name"]: p["sized_by"] for p in listed}["old"] == leader.plane.instance_id
        assert 'pool="old"' in metrics_of(leader.plane)

        drained = await standby.http.post("/v1/pools/old/drain")
        assert drained.status_code == 200, drained.text
        clock.advance(2 * SETTINGS.janitor_interval_s)  # every replica has read the drain
        deleted = await standby.http.delete("/v1/pools/old")

        assert deleted.status_code == 200, deleted.text
        assert deleted.json()["removed"]["pool_sizing"] == 1
        assert (await standby.http.get("/v1/pools/old")).status_code == 404
        assert "old" in leader.plane.catalog.pools  # until its next pass
        clock.advance(SETTINGS.janitor_interval_s)
        await leader.plane.run_janitor_pass()
        assert "old" not in leader.plane.catalog.pools
        assert [s.pool for s in await leader.plane.store.read_sizing()] == ["p"]
        assert 'pool="old"' not in metrics_of(leader.plane)
        assert (await leader.http.get("/v1/pools/old")).status_code == 404
        claim = await leader.http.post("/v1/claims", json={"pool": "old", "org": "acme"})
        assert claim.status_code == 404 and "unknown pool 'old'" in claim.json()["detail"]


def metrics_of(plane: ControlPlane) -> str:
    """The plane's metrics as a scrape reads them."""
    return prometheus_client.generate_latest(plane.metrics.registry).decode()


def test_a_sizing_turns_stale_after_three_janitor_intervals() -> None:
    record = PoolSizingRecord("p", "cp-a", 100.0, 4, 3, {}, "waits")
    fresh = shown(record, now=106.0, janitor_interval_s=2.0, rollout_active=True, revision="r")
    assert (fresh.age_s, fresh.stale, fresh.rollout_waits) == (6.0, False, "waits")
    late = shown(record, now=106.5, janitor_interval_s=2.0, rollout_active=False, revision="r")
    assert (late.age_s, late.stale, late.rollout_waits) == (6.5, True, None)
    assert (late.desired_warm, late.demand, late.sized_by) == (4, 3, "cp-a")
    # A clock behind the leader's shows no negative age.
    behind = shown(record, now=99.0, janitor_interval_s=2.0, rollout_active=False, revision="r")
    assert behind.age_s == 0


def test_terms_of_another_version_show_what_this_one_reads() -> None:
    terms = dataclasses.asdict(
        SizingStatus(0.5, 0.4, 0.5, True, 3.0, 5.0, 4, None, None, None, False, "reactive", None)
    )
    assert status_of({**terms, "a_later_field": 1}) == SizingStatus(**terms)
    assert status_of({}) is None
    assert status_of({"policy": "static"}) is None  # written by a version that lacks fields


async def test_a_replica_that_stops_leading_drops_the_leaders_gauges(
    stores: list[Store],
) -> None:
    """The janitor's gauges (workers by state, each pool's desired warm, demand, sizing and
    cap) are set by the leader's passes only: a replica that lost the lease kept its last
    values for good, and a rule's max over the replicas read an earlier leader's figures.
    It drops them at its first pass without the lease, and sets them again once it leads."""
    clock = VirtualClock()
    async with replica(stores[0], clock, leads=False) as one:
        await one.plane.store.record_demand("cp-elsewhere", {"p": (0, QUEUED, 0)}, now=clock.now())
        leader_series = ("stoker_warm_desired{", "stoker_demand{", "stoker_workers{")

        async def scraped() -> str:
            answer = await one.http.get("/metrics")
            assert answer.status_code == 200
            return answer.text

        one.plane.elector.is_leader = True  # type: ignore[misc]
        await one.plane._janitor_pass()
        text = await scraped()
        assert 'stoker_warm_desired{pool="p"} 4.0' in text
        assert all(series in text for series in leader_series)
        one.plane.elector.is_leader = False  # type: ignore[misc]
        await one.plane._janitor_pass()
        text = await scraped()
        assert not [line for line in text.splitlines() if line.startswith(leader_series)]
        assert "stoker_janitor_is_leader 0.0" in text
        one.plane.elector.is_leader = True  # type: ignore[misc]
        await one.plane._janitor_pass()
        assert 'stoker_warm_desired{pool="p"} 4.0' in await scraped()


async def test_a_leader_without_views_publishes_no_sizing(stores: list[Store]) -> None:
    """The simulator's replicas keep no views (nobody reads them): the leader sizes the
    pools as before but writes no sizing, so another replica shows the static target."""
    clock = VirtualClock()
    async with (
        replica(stores[0], clock, leads=True, views=False) as leader,
        replica(stores[1], clock, leads=False) as standby,
    ):
        await leader.plane.store.record_demand(
            "cp-elsewhere", {"p": (0, QUEUED, 0)}, now=clock.now()
        )
        await leader.plane.run_janitor_pass()
        assert leader.plane.janitor.desired["p"] == 1 + QUEUED
        shown = await standby.pool()
        assert (shown["desired_warm"], shown["sized_by"]) == (1, None)


@pytest.mark.parametrize("views", [True, False])
async def test_a_replica_without_views_keeps_no_dashboard_samples(views: bool) -> None:
    """A started replica samples its pools for the dashboard at once, then every
    `pool_sample_s`; without views it runs no sampler."""
    runtime = MemoryRuntime()
    plane = ControlPlane(
        store=SqliteStore(":memory:"),
        runtime=runtime,
        activator=runtime,
        pools=[pool(warm_target=0)],
        settings=SETTINGS,
        clock=VirtualClock(),
        elector=Standby(),
        views=views,
    )
    await plane.start(loops=True)
    try:
        assert bool(plane.history.samples()) is views
    finally:
        await plane.stop()


async def until_true(ok: Callable[[], bool]) -> None:
    """Once `ok()` holds: the replicas' background work (a spawn's create, a readiness)
    goes on at this instant of the test's clock; a bounded poll."""
    for _ in range(500):
        if ok():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never came true")


def trouble_of(body: dict[str, Any]) -> tuple[bool, int, str | None]:
    """What a pool's body says of its spawn trouble."""
    return body["spawn_failing"], body["spawn_failures"], body["last_spawn_error"]


async def test_every_replica_shows_the_leaders_warm_spawns_failing(
    stores: list[Store],
) -> None:
    """Spawn trouble is each replica's own, and the warm spawns are the leader's: a replica
    that does not lead, asked behind a load balancer, said all was well of a pool whose
    warm spawns fail. The leader publishes its trouble with its sizing; every replica shows
    it, until the leader's next publication after the trouble is over."""
    clock, failing_fleet = VirtualClock(), MemoryRuntime()
    failing_fleet.fail_spawns = 1000  # a quota, a command that cannot start
    async with (
        replica(stores[0], clock, leads=True, runtime=failing_fleet) as leader,
        replica(stores[1], clock, leads=False) as standby,
    ):
        spec = leader.plane.catalog.pool("p")
        spawner = leader.plane.spawner
        await leader.plane.run_janitor_pass()  # spawns the warm worker: it fails
        await until_true(lambda: spawner.failing(spec) is not None)
        clock.advance(spec.spawn_backoff.initial_s)
        await leader.plane.run_janitor_pass()  # probes: fails again; publishes the first
        await until_true(lambda: getattr(spawner.failing(spec), "failures", 0) == 2)
        await leader.plane.run_janitor_pass()  # backing off: publishes both failures
        assert standby.plane.spawner.failing(spec) is None  # none of the standby's own
        failing = (True, 2, "injected spawn failure")
        assert trouble_of(await leader.pool()) == failing
        assert trouble_of(await standby.pool()) == failing
        [status] = [s for s in await standby.plane.pool_status() if s.name == "p"]
        assert (status.spawn_failing, status.spawn_failures) == (True, 2)
        # What stays each replica's own: the standby's metric and readiness.
        assert metric_of(standby.plane, "stoker_spawn_failing", pool="p") == 0
        assert standby.plane.degraded() == []

        # The trouble is over: the next probe gets ready on the leader, which shows so at
        # once; the standby shows what the leader last published until its next pass.
        failing_fleet.fail_spawns = 0
        clock.advance(spec.spawn_backoff.max_s)
        await leader.plane.run_janitor_pass()
        await until_true(lambda: spawner.failing(spec) is None)
        assert trouble_of(await leader.pool()) == (False, 0, None)
        assert trouble_of(await standby.pool()) == failing
        clock.advance(SETTINGS.janitor_interval_s)
        await leader.plane.run_janitor_pass()
        assert trouble_of(await standby.pool()) == (False, 0, None)


async def test_a_stale_sizing_vouches_for_no_spawn_trouble(stores: list[Store]) -> None:
    """The leader's published trouble shows only while its sizing is fresh: a leader gone
    for three janitor intervals says nothing of spawns now."""
    clock, failing_fleet = VirtualClock(), MemoryRuntime()
    failing_fleet.fail_spawns = 1000
    async with (
        replica(stores[0], clock, leads=True, runtime=failing_fleet) as leader,
        replica(stores[1], clock, leads=False) as standby,
    ):
        spec = leader.plane.catalog.pool("p")
        await leader.plane.run_janitor_pass()
        await until_true(lambda: leader.plane.spawner.failing(spec) is not None)
        await leader.plane.run_janitor_pass()
        assert trouble_of(await standby.pool())[0] is True
        clock.advance(STALE_PASSES * SETTINGS.janitor_interval_s + 1)
        body = await standby.pool()
        assert body["sizing_stale"] is True and trouble_of(body) == (False, 0, None)


def metric_of(plane: ControlPlane, name: str, **labels: str) -> float:
    """One sample of the plane's metrics (0 when absent)."""
    return plane.metrics.registry.get_sample_value(name, labels) or 0.0


def own_failing(failures: int, error: str = "own") -> SpawnsFailing:
    return SpawnsFailing(failures=failures, last_error=error, asked_before=0)


def test_a_status_shows_the_spawn_trouble_that_counts_more_failures() -> None:
    """The replica's own trouble or the leader's published one, whichever counts more
    failures (its own on a tie); what it published itself is never read back; a published
    trouble of another revision, or in a stale row, is not shown."""
    terms = {TROUBLE_KEY: PublishedTrouble("r1", 3, "quota").terms()}
    record = PoolSizingRecord("p", "cp-leader", 100.0, 2, 0, terms, None)

    def sized(now: float = 101.0, revision: str = "r1") -> ShownSizing:
        return shown(
            record, now=now, janitor_interval_s=2.0, rollout_active=False, revision=revision
        )

    leaders = PublishedTrouble("r1", 3, "quota")
    assert sized().trouble == leaders
    assert shown_trouble(None, sized(), instance="cp-other") == leaders
    assert shown_trouble(own_failing(1), sized(), instance="cp-other") == leaders
    assert shown_trouble(own_failing(3), sized(), instance="cp-other") == own_failing(3)
    assert shown_trouble(own_failing(5), sized(), instance="cp-other") == own_failing(5)
    assert shown_trouble(None, sized(), instance="cp-leader") is None
    assert shown_trouble(None, sized(revision="r2"), instance="cp-other") is None
    assert shown_trouble(None, sized(now=107.0), instance="cp-other") is None
    # Terms of a shape this version cannot read show no trouble, and no sizing either.
    assert PublishedTrouble.of_terms({TROUBLE_KEY: {"revision": "r1"}}) is None
    assert PublishedTrouble.of_terms({TROUBLE_KEY: "failing"}) is None
    assert status_of(terms) is None
