"""Waiting claims take the first worker that gets ready, in order; a pool at its cap gives
another org's idle capacity to the claim that waits (#17), on virtual time (looptime).

Workers are `MemoryRuntime` entries (see tests/fakes.py for why); the store is the real
SQLite adapter, as in tests/control/test_plane_claims.py whose harness this file uses.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from test_plane_claims import Harness, pool, running

from fakes import MemoryRuntime
from stoker.adapters.sqlite import SqliteStore
from stoker.control.following import OFFER_INTERVAL_S
from stoker.control.plane import ControlPlane
from stoker.domain.errors import CapacityError
from stoker.domain.records import ClaimRequest
from stoker.domain.specs import OrgSpec, PlaneSettings
from stoker.domain.states import ClaimMode, ClaimSource, WorkerState
from stoker.ports.clock import VirtualClock

pytestmark = pytest.mark.looptime

S = WorkerState


def slow_first_spawn(delays: list[float]) -> MemoryRuntime:
    """A runtime whose n-th spawn gets ready after `delays[n]` seconds (then 0.2 s)."""
    runtime = MemoryRuntime(auto_ready=False)
    plain_spawn = runtime.spawn

    async def spawn(worker, spec):  # type: ignore[no-untyped-def]
        ref = await plain_spawn(worker, spec)
        delay = delays.pop(0) if delays else 0.2
        asyncio.get_running_loop().call_later(delay, runtime.make_ready, worker.id)
        return ref

    runtime.spawn = spawn  # type: ignore[method-assign]
    return runtime


async def _waiting(h: Harness, org: str, **kw: float) -> asyncio.Task:  # type: ignore[type-arg]
    task = asyncio.create_task(h.claim(org, **kw))
    await asyncio.sleep(0.1)
    assert not task.done()
    return task


# -- the first worker that gets ready goes to the claim that waits longest -------------


async def test_the_first_waiter_gets_the_spawn_that_gets_ready_first(tmp_path: Path) -> None:
    runtime = slow_first_spawn([20.0, 2.0])
    async with running(tmp_path, [pool(warm_target=0)], runtime=runtime) as h:
        first = await _waiting(h, "a", timeout_s=60)
        second = await _waiting(h, "b", timeout_s=60)
        loop = asyncio.get_running_loop()
        started = loop.time()
        # b's spawn is ready after 2 s: a waited longer, so a gets it.
        claim_a = await first
        assert loop.time() - started < 5
        assert claim_a.org == "a"
        assert not second.done()
        # a's own (slow) spawn is ready at 20 s and serves b, the next in line.
        claim_b = await second
        assert claim_b.org == "b" and claim_b.worker_id != claim_a.worker_id
        assert loop.time() - started >= 15
        assert runtime.spawn_calls == 2
        assert not runtime.fencing_violations


async def test_a_spawn_ready_before_its_claim_waits_serves_the_claim(tmp_path: Path) -> None:
    """A worker that answers its readiness probe while it is still being created (before
    its claim begins to wait) serves the claim at once, not at its deadline."""
    runtime = MemoryRuntime(auto_ready=False)
    plain_spawn = runtime.spawn

    async def spawn(worker, spec):  # type: ignore[no-untyped-def]
        ref = await plain_spawn(worker, spec)
        runtime.make_ready(worker.id)  # the readiness event arrives inside the spawn
        return ref

    runtime.spawn = spawn  # type: ignore[method-assign]
    async with running(tmp_path, [pool(warm_target=0)], runtime=runtime) as h:
        loop = asyncio.get_running_loop()
        started = loop.time()
        claim = await h.claim("a", timeout_s=30)
        assert claim.org == "a"
        assert loop.time() - started < 1
        assert runtime.spawn_calls == 1


async def test_a_warm_worker_serves_a_claim_waiting_for_a_slow_spawn(tmp_path: Path) -> None:
    runtime = slow_first_spawn([30.0])
    async with running(tmp_path, [pool(warm_target=0)], runtime=runtime) as h:
        loop = asyncio.get_running_loop()
        waiting = await _waiting(h, "a", timeout_s=60)
        started = loop.time()
        # The janitor spawns a warm worker (ready in 0.2 s) while a's spawn takes 30 s.
        h.plane.catalog.update_pool(pool(warm_target=1))
        await h.plane.run_janitor_pass()
        claim = await waiting
        assert loop.time() - started < 5
        # It found no worker ready and waited for one to start: served cold, whichever
        # start ended its wait (`cold_share` and the ledger's cold starts avoided count it).
        assert claim.source is ClaimSource.COLD
        # The slow spawn, its claim served, joins the pool as a normal warm worker.
        await asyncio.sleep(35)
        spare = [w for w in await h.workers(S.WARM) if w.id != claim.worker_id]
        assert len(spare) >= 1 and all(w.org is None for w in spare)
        again = await h.claim("b", mode=ClaimMode.REQUIRE_WARM, timeout_s=1)
        assert again.source is ClaimSource.WARM


async def test_an_org_capped_waiter_takes_a_warm_worker_its_spawn_held(tmp_path: Path) -> None:
    """With an org cap of 1, the claim's own spawn must not keep it from the warm one."""
    runtime = slow_first_spawn([30.0])
    orgs = [OrgSpec(name="a", max_workers=1)]
    async with running(tmp_path, [pool(warm_target=0)], runtime=runtime, orgs=orgs) as h:
        waiting = await _waiting(h, "a", timeout_s=60)
        h.plane.catalog.update_pool(pool(warm_target=1))
        await h.plane.run_janitor_pass()
        claim = await asyncio.wait_for(waiting, 5)
        assert claim.org == "a" and claim.source is ClaimSource.COLD
        live = [w for w in await h.workers() if w.org == "a" and w.state is not S.RETIRED]
        assert len(live) == 1


# -- capacity goes to demand -------------------------------------------------------------


async def _park(h: Harness, orgs: list[str]) -> None:
    for org in orgs:
        claim = await h.claim(org)
        await h.plane.release(claim.id)


async def test_a_pool_at_its_cap_reclaims_another_orgs_idle_worker(tmp_path: Path) -> None:
    spec = pool(warm_target=0, max_workers=4, hot_idle_ttl=300)
    async with running(tmp_path, [spec]) as h:
        await _park(h, ["o1", "o2", "o3", "o4"])
        assert len(await h.workers(S.HOT_IDLE)) == 4
        claim = await h.claim("o5", timeout_s=10)
        assert claim.org == "o5"
        gone = [w for w in await h.workers(S.RETIRED) if w.reason == "reclaimed"]
        # The least recently used parked worker made room, and only one.
        assert [w.org for w in gone] == ["o1"]
        assert len(await h.workers(S.HOT_IDLE)) == 3


async def test_a_reclaim_keeps_each_orgs_floor(tmp_path: Path) -> None:
    spec = pool(warm_target=0, max_workers=2, hot_idle_ttl=300, min_hot_idle=1)
    async with running(tmp_path, [spec]) as h:
        await _park(h, ["o1", "o2"])
        with pytest.raises(CapacityError) as err:
            await h.claim("o3", timeout_s=5)
        assert err.value.reason == "pool_cap"
        assert len(await h.workers(S.HOT_IDLE)) == 2


async def test_a_hundred_orgs_share_a_pool_of_four(tmp_path: Path) -> None:
    spec = pool(warm_target=0, max_workers=4, hot_idle_ttl=300)
    async with running(tmp_path, [spec]) as h:
        refused = 0
        for n in range(100):
            try:
                claim = await h.claim(f"org{n}", timeout_s=10)
            except CapacityError:
                refused += 1
                continue
            await h.plane.release(claim.id)
        assert refused == 0
        live = [w for w in await h.workers() if w.state is not S.RETIRED]
        assert len(live) <= 4


async def test_a_reclaim_leaves_a_worker_its_org_reuses(tmp_path: Path) -> None:
    """The org that parked a worker and the org waiting at the cap both claim at once:
    the parked worker is reused or reclaimed, never both."""
    spec = pool(warm_target=0, max_workers=1, hot_idle_ttl=300)
    async with running(tmp_path, [spec]) as h:
        await _park(h, ["o1"])
        outcomes = await asyncio.gather(
            h.claim("o1", timeout_s=10), h.claim("o2", timeout_s=10), return_exceptions=True
        )
        served = [c for c in outcomes if not isinstance(c, BaseException)]
        assert served
        assert not h.runtime.fencing_violations
        live = [w for w in await h.workers() if w.state is not S.RETIRED]
        assert len(live) <= 1


async def test_a_reclaim_misses_a_worker_reserved_since_it_was_read(tmp_path: Path) -> None:
    """Another replica reserves the parked worker between the reclaim's read and its write:
    the write is a CAS on the row as read, so the worker keeps its new claim."""
    spec = pool(warm_target=0, max_workers=1, hot_idle_ttl=300)
    async with running(tmp_path, [spec]) as h:
        await _park(h, ["o1"])
        (parked,) = await h.workers(S.HOT_IDLE)
        read = h.store.inner.list_workers

        async def read_then_reserved_elsewhere(**kw):  # type: ignore[no-untyped-def]
            rows = await read(**kw)
            await h.store.inner.reserve(
                parked.id,
                expect=S.HOT_IDLE,
                epoch=parked.epoch,
                version=parked.version,
                org="o1",
                org_cap=0,
                owner="cp-other",
                now=h.clock.now(),
            )
            return rows

        h.store.list_workers = read_then_reserved_elsewhere  # type: ignore[method-assign]
        assert await h.plane.retirer.reclaim(spec, "o2") is None
        again = await h.store.get_worker(parked.id)
        assert again is not None and again.state is S.RESERVED and again.org == "o1"


# -- a claim waiting on one replica takes the worker another replica made ready ------------


@asynccontextmanager
async def two_replicas(path: Path) -> AsyncIterator[tuple[ControlPlane, ControlPlane]]:
    """Replicas A and B on one SQLite file, both with their loops running (janitor and
    reaper too rare to act): A's spawns get ready in 0.2 s, B's never do, and B may adopt
    A's workers (one set of processes)."""
    quiet = PlaneSettings(janitor_interval_s=3600, reaper_interval_s=3600)
    runtime_a = MemoryRuntime(ready_delay=0.2)
    runtime_b = MemoryRuntime(auto_ready=False)
    runtime_b.procs = runtime_a.procs
    planes = [
        ControlPlane(
            store=SqliteStore(str(path / "stoker.db")),
            runtime=runtime,
            activator=runtime,
            pools=[pool(warm_target=0)],
            settings=quiet,
            clock=VirtualClock(),
        )
        for runtime in (runtime_a, runtime_b)
    ]
    for plane in planes:
        await plane.start()
    try:
        yield planes[0], planes[1]
    finally:
        for plane in planes:
            await plane.stop()


async def test_a_claim_waiting_on_one_replica_takes_another_replicas_warm_worker(
    tmp_path: Path,
) -> None:
    """The store has no feed: an offer pass hands B's waiting claims the worker A made
    ready, to the one that waits longest, within a pass rather than at its deadline."""
    async with two_replicas(tmp_path) as (a, b):
        loop = asyncio.get_running_loop()
        first = asyncio.create_task(b.claim(ClaimRequest(pool="p", org="x", timeout_s=60)))
        await asyncio.sleep(0.5)
        second = asyncio.create_task(b.claim(ClaimRequest(pool="p", org="y", timeout_s=60)))
        await asyncio.sleep(2)
        assert not first.done() and not second.done()
        # A cold claim on A whose requester leaves: its spawn, ready 0.2 s later, is warm.
        spawned = loop.time()
        with pytest.raises(CapacityError):
            await a.claim(ClaimRequest(pool="p", org="z", mode=ClaimMode.COLD, timeout_s=0.1))
        claim = await asyncio.wait_for(first, timeout=5)
        # Ready 0.2 s after the spawn, then at most one offer pass and the reservation.
        assert loop.time() - spawned < 0.2 + OFFER_INTERVAL_S + 0.3
        # It waited two seconds for a start: cold, though another replica made the worker.
        assert claim.source is ClaimSource.COLD and claim.org == "x"
        taken = await b.store.get_worker(claim.worker_id)
        assert taken is not None and taken.owner == b.instance_id  # adopted from A
        assert claim.worker_id in a.runtime.procs  # type: ignore[attr-defined]
        # Nothing else got ready: the second claim waits for its own spawn, in vain.
        with pytest.raises(CapacityError):
            await second
