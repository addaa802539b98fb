"""The workers' change feed of the PostgreSQL store (LISTEN/NOTIFY), and replicas that
follow it: a worker one replica spawns wakes a claim waiting on another at once.

Each test runs in a fresh schema of the database in STOKER_TEST_POSTGRES_URL, dropped
afterwards (see tests/adapters/test_store_postgres.py). Workers are `MemoryRuntime`
entries (see tests/fakes.py); PostgreSQL I/O is real, so waits are bounded polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from fakes import MemoryRuntime
from stoker.adapters.postgres import PostgresStore
from stoker.control.plane import ControlPlane
from stoker.domain.records import ClaimRequest, Worker
from stoker.domain.specs import PlaneSettings, PoolSpec, ProcessTemplate
from stoker.domain.states import ClaimMode, ClaimSource, WorkerState
from stoker.ports.clock import LoopClock
from stoker.ports.store import SpawnRequest, WorkerFeed

pytestmark = pytest.mark.postgres

S = WorkerState
POOL = PoolSpec(name="p", template=ProcessTemplate(argv=("worker", "{port}")), warm_target=1)


@pytest.fixture
async def schema(postgres_url: str) -> AsyncIterator[str]:
    name = f"stoker_test_{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


async def until(check: Callable[[], Any], timeout: float = 10.0) -> None:
    """Poll `check` (sync or async) until it is true; fail after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = check()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


class Heard:
    """What a follower of the feed was told."""

    def __init__(self) -> None:
        self.rows: list[Worker] = []
        self.listening = 0
        self.lost = 0

    def on_worker(self, worker: Worker) -> None:
        self.rows.append(worker)

    async def on_listening(self) -> None:
        self.listening += 1

    def on_lost(self) -> None:
        self.lost += 1

    async def follow(self, store: WorkerFeed) -> None:
        await store.follow_workers(self.on_worker, self.on_listening, self.on_lost)


async def test_the_feed_announces_workers_as_they_become_warm(
    postgres_url: str, schema: str
) -> None:
    store = PostgresStore(postgres_url, schema=schema)
    await store.open()
    heard = Heard()
    assert isinstance(store, WorkerFeed)
    task = asyncio.create_task(
        store.follow_workers(heard.on_worker, heard.on_listening, heard.on_lost)
    )
    try:
        await until(lambda: heard.listening == 1)
        req = SpawnRequest(pool="p", revision="r1", count=1, owner="cp-a", pool_cap=0, target=1)
        (slot,) = (await store.reserve_spawn_slots(req, ["w1"], 1.0)).workers
        # Spawning is not claimable: nothing announced.
        warm = await store.transition(
            "w1",
            expect=S.SPAWNING,
            epoch=slot.epoch,
            version=slot.version,
            to=S.WARM,
            now=2.0,
            changes={"endpoint": "http://w1"},
        )
        assert warm is not None
        await until(lambda: len(heard.rows) == 1)
        assert heard.rows[0] == warm
        # Leaving warm is not announced (it would serialize the claim path's commits).
        taken = await store.reserve(
            "w1",
            expect=S.WARM,
            epoch=warm.epoch,
            version=warm.version,
            org="acme",
            org_cap=0,
            owner="cp-b",
            now=3.0,
        )
        assert taken.worker is not None
        released = await store.transition(
            "w1",
            expect=S.RESERVED,
            epoch=taken.worker.epoch,
            version=taken.worker.version,
            to=S.WARM,
            now=4.0,
            changes={"org": None},
        )
        assert released is not None
        await until(lambda: len(heard.rows) == 2)
        assert heard.rows[1] == released
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.close()


async def test_the_feed_reconnects_and_resyncs_after_its_connection_dies(
    postgres_url: str, schema: str
) -> None:
    store = PostgresStore(postgres_url, schema=schema)
    await store.open()
    heard = Heard()
    task = asyncio.create_task(
        store.follow_workers(heard.on_worker, heard.on_listening, heard.on_lost)
    )
    try:
        await until(lambda: heard.listening == 1)
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE query LIKE %s AND pid <> pg_backend_pid()",
                (f'LISTEN "stoker_workers_{schema}"%',),
            )
        await until(lambda: heard.lost >= 1 and heard.listening == 2)
        req = SpawnRequest(pool="p", revision="r1", count=1, owner="cp-a", pool_cap=0, target=1)
        (slot,) = (await store.reserve_spawn_slots(req, ["w1"], 1.0)).workers
        await store.transition(
            "w1", expect=S.SPAWNING, epoch=slot.epoch, version=slot.version, to=S.WARM, now=2.0
        )
        await until(lambda: [w.id for w in heard.rows] == ["w1"])
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.close()


def plane(store: PostgresStore, runtime: MemoryRuntime, pool: PoolSpec) -> ControlPlane:
    return ControlPlane(
        store=store,
        runtime=runtime,
        activator=runtime,
        pools=[pool],
        settings=PlaneSettings(janitor_interval_s=3600, reaper_interval_s=3600),
        clock=LoopClock(),
    )


async def test_a_warm_worker_spawned_by_one_replica_wakes_a_claim_waiting_on_another(
    postgres_url: str, schema: str
) -> None:
    """Replica B has no worker and a require_warm claim waits on it; replica A spawns one.
    Without the feed nothing would wake B's claim before its deadline (30 s)."""
    procs = MemoryRuntime().procs
    a_runtime, b_runtime = MemoryRuntime(ready_delay=0.05), MemoryRuntime(ready_delay=0.05)
    b_runtime.procs = a_runtime.procs = procs
    a_store = PostgresStore(postgres_url, schema=schema)
    b_store = PostgresStore(postgres_url, schema=schema)
    a = plane(a_store, a_runtime, POOL)
    b = plane(b_store, b_runtime, POOL)
    # A starts first and fills the pool (its first janitor pass); B then finds it full.
    await a.start(loops=False)

    async def warm() -> bool:
        return len(await a_store.list_workers(states=[S.WARM])) == 1

    await until(warm)
    await b.start()
    try:
        first = ClaimRequest(pool="p", org="acme", mode=ClaimMode.REQUIRE_WARM, timeout_s=30)
        await b.claim(first)  # A's warm worker, from the store
        request = replace(first, org="globex")
        waiting = asyncio.create_task(b.claim(request))
        await until(lambda: b.book.waiting_for_warm("p") == 1)
        await a.run_janitor_pass()  # A spawns the replacement
        claim = await waiting
        # It waited for A's replacement to start: cold.
        assert claim.source is ClaimSource.COLD
        worker = await b_store.get_worker(claim.worker_id)
        assert worker is not None and worker.owner == b.instance_id
        assert worker.id in procs and procs[worker.id].org == "globex"
    finally:
        await b.stop()
        await a.stop()
