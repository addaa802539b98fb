"""The ledger across a restart and a takeover, with two replicas on one store (SQLite, and
PostgreSQL): the workers a stopped or dead replica left starting or draining, which the
next leader retires, and the workers of a replica whose registration expired while it
still runs, which another replica adopts. Every second is counted once.

Loops off, on a clock that moves only when the test says (the store's I/O takes none of
it): every transition happens at a time the test chose, and the expected seconds of each
state are computed by hand.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from test_ledger import ME, POOL, ManualClock, wire

from fakes import MemoryRuntime
from stoker.control.lifecycle import Lifecycle
from stoker.control.plane import ControlPlane
from stoker.domain.ledger import HOUR_S, LedgerCounts
from stoker.domain.records import ClaimRequest, Worker
from stoker.domain.specs import PlaneSettings, PoolSpec
from stoker.domain.states import ClaimState, WorkerState
from stoker.ports.store import SpawnRequest, Store

S = WorkerState
SETTINGS = PlaneSettings()
EXPIRY = SETTINGS.instance_expiry_s


class Lead:
    """An elector the test turns on and off (`is_leader`)."""

    def __init__(self, leads: bool) -> None:
        self.is_leader = leads
        self.epoch = 1

    async def run(self) -> None:
        """Nothing to contend for here."""

    async def resign(self) -> None:
        """Nothing to give up."""


def plane(
    store: Store, clock: ManualClock, runtime: MemoryRuntime, pool: PoolSpec, *, lead: Lead
) -> ControlPlane:
    return ControlPlane(
        store=store,
        runtime=runtime,
        activator=runtime,
        pools=[pool],
        settings=SETTINGS,
        clock=clock,
        elector=lead,
    )


async def until(p: ControlPlane, ok: Callable[[list[Worker]], bool]) -> list[Worker]:
    """The plane's workers once `ok` holds of them: its background work (runtime events,
    stops) goes on at this instant of the test's clock; a bounded poll of the store."""
    for _ in range(500):
        # A readiness that met its spawn's own write is retried, as a pass would.
        await p.events.settle_pending()
        workers = await p.store.list_workers()
        if ok(workers):
            return workers
        await asyncio.sleep(0.01)
    raise AssertionError(f"never came true: {workers}")


class HeldStops(MemoryRuntime):
    """Stops that finish only when the test lets them (`stops.set()`): a worker drains
    for as long as the test says."""

    def __init__(self) -> None:
        super().__init__(auto_ready=False)
        self.stops = asyncio.Event()

    async def stop(self, worker: Worker, grace_s: float) -> None:
        await self.stops.wait()
        await super().stop(worker, grace_s)


async def totals(store: Store, since: float, until: float) -> LedgerCounts:
    total = LedgerCounts()
    for _, counts in await store.read_ledger("p", since=since - HOUR_S, until=until + 1):
        total.merge(counts)
    return total


async def test_a_worker_adopted_from_a_replica_that_still_runs_is_counted_once(
    stores: list[Store],
) -> None:
    """Replica A holds a session, writes its ledger, then stalls past its expiry; B adopts
    the worker and counts it from A's last write; A comes back and flushes. Hand-computed:
    warm 0-10, hot 10-80 (the session, held throughout): A counts to 20, B from 20."""
    clock = ManualClock()
    runtime = MemoryRuntime()
    pool = PoolSpec(name="p", template=POOL.template, warm_target=1)
    a_leads, b_leads = Lead(True), Lead(False)
    a = plane(stores[0], clock, runtime, pool, lead=a_leads)
    b = plane(stores[1], clock, runtime, pool, lead=b_leads)
    await a.start(loops=False)
    t0 = clock.now()
    (warm,) = await until(a, lambda ws: [w.state for w in ws] == [S.WARM])
    clock.advance(10)
    claim = await a.claim(ClaimRequest(pool="p", org="acme", timeout_s=5.0, lease_s=HOUR_S))
    assert claim.worker_id == warm.id
    clock.advance(10)
    await a.check_store()  # A's last heartbeat
    await a.run_reaper_pass()  # and its last ledger write, at t0 + 20
    a_leads.is_leader = False
    await b.start(loops=False)
    try:
        # A stalls (no heartbeat, no pass) past its expiry; B leads and adopts.
        clock.advance(EXPIRY + 20)  # t0 + 20 + EXPIRY + 20
        b_leads.is_leader = True
        await b.run_janitor_pass()
        hot: Worker | None = await b.store.get_worker(warm.id)
        assert hot is not None and hot.owner == b.instance_id and hot.state is S.HOT
        adopted_at = hot.updated_at
        # B's pass also spawned a warm worker in the adopted one's place (ready at once).
        await until(b, lambda ws: S.SPAWNING not in [w.state for w in ws])
        assert adopted_at == pytest.approx(t0 + 40 + EXPIRY)
        clock.advance(10)
        await b.run_reaper_pass()  # B counts from A's last write (t0 + 20) on
        # A comes back: its pass finds the worker gone to B.
        clock.advance(5)
        await a.run_reaper_pass()
        clock.advance(5)
        await b.run_reaper_pass()
        end = clock.now()
        total = await totals(b.store, t0, end)
        (spare,) = await b.store.list_workers(states=[S.WARM])
        assert spare.created_at == pytest.approx(adopted_at)
        assert total.hot_s == pytest.approx(end - (t0 + 10))
        assert total.warm_s == pytest.approx(10 + end - adopted_at)
        assert total.starting_s + total.hot_idle_s + total.draining_s == pytest.approx(0)
    finally:
        await b.stop()
        await a.stop()


@pytest.mark.parametrize("clean", [True, False], ids=["stopped", "killed"])
async def test_workers_left_starting_or_draining_count_until_their_retirement(
    stores: list[Store], clean: bool
) -> None:
    """Replica A spawns X and Y; Y gets ready at 5 and A drains it at `drained`; A writes
    its ledger at `written` and stops (or is killed). B starts at `b_at` and retires both:
    X's drain at `b_at`, both retired at `b_at` + 10. Hand-computed, each state counted to
    the retirement; the seconds after A's last write by B, from the later of that write and
    the row's own last write:

    stopped (written 30, drained 20, B at 45): X starting 0-45, draining 45-55;
        Y starting 0-5, warm 5-20, draining 20-55.
    killed (written 25, drained 30, B at 50): X starting 0-50, draining 50-60;
        Y starting 0-5, warm 5-25 (25-30 was A's, unwritten: lost), draining 30-60.
    B's own spawns (its pass keeps the target) are starting from `b_at` to the end.
    """
    clock = ManualClock()
    runtime = HeldStops()
    pool = PoolSpec(name="p", template=POOL.template, warm_target=2)
    a_leads, b_leads = Lead(True), Lead(True)
    a = plane(stores[0], clock, runtime, pool, lead=a_leads)
    b = plane(stores[1], clock, runtime, pool, lead=b_leads)
    written, drained, b_at = (30.0, 20.0, 45.0) if clean else (25.0, 30.0, 50.0)
    await a.start(loops=False)
    t0 = clock.now()
    x, y = await until(a, lambda ws: len(ws) == 2 and all(w.runtime_ref for w in ws))
    clock.advance(5)
    runtime.make_ready(y.id)
    (y,) = [w for w in await until(a, lambda ws: S.WARM in {w.state for w in ws}) if w.id == y.id]
    for at, step in sorted([(drained, "drain"), (written, "write")]):
        clock.advance(t0 + at - clock.now())
        if step == "drain":
            assert await a.lifecycle.move(y, S.DRAINING, reason="excess") is not None
        else:
            await a.check_store()
            await a.run_reaper_pass()
    if clean:
        await a.stop()
    a_leads.is_leader = False  # killed: A does nothing more
    clock.advance(t0 + b_at - clock.now())
    await b.start(loops=False)  # its first pass retires what A left
    try:
        rows = {w.id: w for w in await b.store.list_workers()}
        assert (rows[x.id].state, rows[y.id].state) == (S.DRAINING, S.DRAINING)
        assert rows[x.id].updated_at == pytest.approx(t0 + b_at)
        clock.advance(5)
        await b.run_reaper_pass()  # the stops are under way
        clock.advance(5)
        runtime.stops.set()
        await until(b, lambda ws: {w.state for w in ws if w.id in (x.id, y.id)} == {S.RETIRED})
        await b.run_reaper_pass()
        end = clock.now()
        total = await totals(b.store, t0, end)
        # B's own spawns (its pass keeps the pool's target) are starting since `b_at`.
        spawned = [w for w in await b.store.list_workers() if w.id not in (x.id, y.id)]
        assert spawned and {w.created_at for w in spawned} == {t0 + b_at}
        spares = len(spawned) * (end - (t0 + b_at))
        if clean:
            assert total.starting_s == pytest.approx(45 + 5 + spares)
            assert total.warm_s == pytest.approx(15)
            assert total.draining_s == pytest.approx(10 + 35)
        else:
            assert total.starting_s == pytest.approx(50 + 5 + spares)
            assert total.warm_s == pytest.approx(20)
            assert total.draining_s == pytest.approx(10 + 30)
        assert total.hot_s == total.hot_idle_s == 0
    finally:
        runtime.stops.set()
        await b.stop()


async def test_an_orphan_adopted_before_its_retirement_counts_as_adopted_once(
    stores: list[Store],
) -> None:
    """The leader means to retire a dead replica's spawning worker, but the worker got
    ready meanwhile (the drain misses) and the next pass adopts it: from then on it is this
    replica's like any other. Hand-computed: warm 10-30 (the adoption's gap 10-20, then
    its own), draining 30-40; the dead replica's start (0-10) was its own to count."""
    store = stores[0]
    clock = ManualClock()
    ledger, life, _ = wire(store, clock)
    life.on_adopted = ledger.adopted
    gone = Lifecycle(store, clock, life.metrics)  # the dead replica's writes, unhooked
    t0 = clock.now()
    (spawning,) = (
        await gone.reserve_slots(
            SpawnRequest(pool="p", revision=POOL.revision, count=1, owner="cp-gone"), ["w-o"]
        )
    ).workers
    clock.advance(10)
    ready = await gone.move(spawning, S.WARM, endpoint="http://w")
    assert ready is not None
    ledger.orphaned(spawning)
    assert await life.move(spawning, S.DRAINING, reason="orphaned") is None  # fenced out
    clock.advance(10)
    adopted = await life.adopt(ready, ME)
    assert adopted is not None
    clock.advance(10)
    draining = await life.move(adopted, S.DRAINING, reason="excess")
    assert draining is not None
    clock.advance(10)
    assert await life.move(draining, S.RETIRED) is not None
    clock.advance(10)
    await ledger.flush(store)
    total = await totals(store, t0, clock.now())
    assert total.warm_s == pytest.approx(20)
    assert total.draining_s == pytest.approx(10)
    assert total.starting_s == 0


async def test_a_gone_replicas_parked_worker_reaped_by_a_fallback_reaper_counts_to_its_end(
    stores: list[Store],
) -> None:
    """Replica A parks a worker (released at 20), writes its ledger at 30 and dies. No
    replica leads: B's fallback reaper retires the parked worker once A is gone and the
    worker's TTL has passed, at `reaped`. Hand-computed: warm 0-10, hot 10-20, parked
    20-`reaped` (A's to 30, B's from 30), draining from `reaped` to its end (at once)."""
    clock = ManualClock()
    runtime = MemoryRuntime()
    pool = PoolSpec(name="p", template=POOL.template, warm_target=1, hot_idle_ttl=60)
    a_leads, b_leads = Lead(True), Lead(False)
    a = plane(stores[0], clock, runtime, pool, lead=a_leads)
    b = plane(stores[1], clock, runtime, pool, lead=b_leads)
    await a.start(loops=False)
    t0 = clock.now()
    (warm,) = await until(a, lambda ws: [w.state for w in ws] == [S.WARM])
    clock.advance(10)
    claim = await a.claim(ClaimRequest(pool="p", org="acme", timeout_s=5.0, lease_s=HOUR_S))
    clock.advance(10)
    await a.release(claim.id)
    a_leads.is_leader = False  # no replica leads from here on: no spawn, no adoption
    clock.advance(10)
    await a.check_store()  # A's last heartbeat
    await a.run_reaper_pass()  # and its last ledger write, at t0 + 30
    await b.start(loops=False)
    try:
        clock.advance(EXPIRY + 60)  # A is gone, the worker past its TTL
        reaped = clock.now()
        await b.run_reaper_pass()
        await until(b, lambda ws: [w.state for w in ws if w.id == warm.id] == [S.RETIRED])
        clock.advance(5)
        await b.run_reaper_pass()
        total = await totals(b.store, t0, clock.now())
        assert total.warm_s == pytest.approx(10)
        assert total.hot_s == pytest.approx(10)
        assert total.hot_idle_s == pytest.approx(reaped - (t0 + 20))
        assert total.starting_s == pytest.approx(0)
    finally:
        await b.stop()
        await a.stop()


async def test_a_gone_replicas_session_ended_by_a_fallback_reaper_counts_to_its_end(
    stores: list[Store],
) -> None:
    """Replica A serves a session of a 30 s lease from 10, writes its ledger at 20 and
    dies. No replica leads: B's fallback reaper ends the session once A is gone, at
    `ended`. Hand-computed: warm 0-10, hot 10-`ended` (A's to 20, B's from 20)."""
    clock = ManualClock()
    runtime = MemoryRuntime()
    pool = PoolSpec(name="p", template=POOL.template, warm_target=1)
    a_leads, b_leads = Lead(True), Lead(False)
    a = plane(stores[0], clock, runtime, pool, lead=a_leads)
    b = plane(stores[1], clock, runtime, pool, lead=b_leads)
    await a.start(loops=False)
    t0 = clock.now()
    (warm,) = await until(a, lambda ws: [w.state for w in ws] == [S.WARM])
    clock.advance(10)
    claim = await a.claim(ClaimRequest(pool="p", org="acme", timeout_s=5.0, lease_s=30))
    a_leads.is_leader = False
    clock.advance(10)
    await a.check_store()
    await a.run_reaper_pass()  # A's last ledger write, at t0 + 20
    await b.start(loops=False)
    try:
        clock.advance(EXPIRY + 30)  # A is gone, the lease long expired
        ended = clock.now()
        await b.run_reaper_pass()
        await until(b, lambda ws: [w.state for w in ws if w.id == warm.id] == [S.RETIRED])
        ended_claim = await b.store.get_claim(claim.id)
        assert ended_claim is not None and ended_claim.state is ClaimState.EXPIRED
        clock.advance(5)
        await b.run_reaper_pass()
        total = await totals(b.store, t0, clock.now())
        assert total.warm_s == pytest.approx(10)
        assert total.hot_s == pytest.approx(ended - (t0 + 10))
        assert total.hot_idle_s + total.starting_s == pytest.approx(0)
    finally:
        await b.stop()
        await a.stop()
