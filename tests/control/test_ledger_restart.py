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
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import psycopg
import pytest
from test_ledger import POOL, ManualClock

from fakes import MemoryRuntime
from stoker.adapters.postgres import PostgresStore
from stoker.adapters.sqlite import SqliteStore
from stoker.control.plane import ControlPlane
from stoker.domain.ledger import HOUR_S, LedgerCounts
from stoker.domain.records import ClaimRequest, Worker
from stoker.domain.specs import PlaneSettings, PoolSpec
from stoker.domain.states import WorkerState
from stoker.ports.store import Store

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


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[list[Store]]:
    """Two stores on one database (a SQLite file, or a fresh PostgreSQL schema dropped
    after), both opened before either replica starts."""
    schema = f"stoker_test_{uuid.uuid4().hex[:12]}"
    url = ""
    made: list[Store]
    if request.param == "sqlite":
        made = [SqliteStore(str(tmp_path / "stoker.db")) for _ in range(2)]
    else:
        url = request.getfixturevalue("postgres_url")
        made = [PostgresStore(url, schema=schema) for _ in range(2)]
    try:
        for store in made:
            await store.open()
        yield made
    finally:
        for store in made:
            await store.close()
        if url:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


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
        await p.book.wait_background(1.0)
        # A readiness that met its spawn's own write is retried, as a pass would.
        await p.events.settle_pending()
        workers = await p.store.list_workers()
        if ok(workers):
            return workers
        await asyncio.sleep(0.01)
    raise AssertionError(f"never came true: {workers}")


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
