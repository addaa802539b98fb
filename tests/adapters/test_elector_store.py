"""The store-lease elector on SQLite (virtual time) and on PostgreSQL (real time).

The shared elector loop is tested in depth in tests/adapters/test_elector.py; here the lease lives
in a real store, and the faults are the store's own: renewals that fail for a while.
"""

# These tests assert a property, act, then assert it changed: mypy narrows the first
# assert onto the second and calls what follows unreachable.
# mypy: disable-error-code="unreachable"

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from stoker.adapters.elector_store import StoreLeaseElector
from stoker.adapters.postgres import PostgresStore
from stoker.adapters.sqlite import SqliteStore
from stoker.domain.errors import StoreError
from stoker.domain.records import LeaseRecord
from stoker.ports.clock import LoopClock
from stoker.ports.store import Store

POSTGRES_URL = os.environ.get(
    "STOKER_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


class Blinking:
    """Wraps a store; while `down`, lease writes fail as a lost connection would."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.down = False

    async def acquire_lease(
        self, name: str, *, holder: str, now: float, duration_s: float
    ) -> LeaseRecord | None:
        if self.down:
            raise StoreError("injected: lease write failed")
        return await self.inner.acquire_lease(name, holder=holder, now=now, duration_s=duration_s)

    async def release_lease(self, name: str, *, holder: str, now: float) -> bool:
        if self.down:
            raise StoreError("injected: lease write failed")
        return await self.inner.release_lease(name, holder=holder, now=now)


def elector(store: Store | Blinking, identity: str, scale: float = 1.0) -> StoreLeaseElector:
    return StoreLeaseElector(
        store,  # type: ignore[arg-type]  # Blinking has only the lease methods the elector uses
        clock=LoopClock(),
        identity=identity,
        lease_duration_s=15 * scale,
        renew_deadline_s=10 * scale,
        retry_period_s=2 * scale,
    )


@pytest.mark.looptime
async def test_two_replicas_one_leader_and_a_takeover_after_a_blip(tmp_path: Path) -> None:
    a_store, b_store = SqliteStore(str(tmp_path / "s.db")), SqliteStore(str(tmp_path / "s.db"))
    await a_store.open()
    await b_store.open()
    a_conn = Blinking(a_store)
    a, b = elector(a_conn, "cp-a"), elector(b_store, "cp-b")
    loop = asyncio.get_running_loop()
    tasks = [asyncio.create_task(a.run()), asyncio.create_task(b.run())]
    try:
        await asyncio.sleep(1)
        assert [a.is_leader, b.is_leader] == [True, False]
        first = await a_store.get_lease("janitor")
        assert first is not None and first.holder == "cp-a"

        # A's renewals fail: it steps down at its renew deadline, B takes over once the
        # lease has expired (its duration after A's last renewal), never before.
        a_conn.down = True
        blip = loop.time()
        while a.is_leader:
            await asyncio.sleep(0.5)
        assert loop.time() - blip <= 10 + 0.5
        assert not b.is_leader
        while not b.is_leader:
            await asyncio.sleep(0.5)
        assert 15 - 2 <= loop.time() - blip <= 15 + 2 + 0.5
        taken = await b_store.get_lease("janitor")
        assert taken is not None and taken.holder == "cp-b" and taken.epoch == first.epoch + 1

        # A's store comes back: A re-contends (its loop never ended) but B holds the lease.
        a_conn.down = False
        await asyncio.sleep(30)
        assert not tasks[0].done()
        assert [a.is_leader, b.is_leader] == [False, True]

        # B resigns on a clean shutdown: A leads again within a retry period.
        await b.resign()
        await asyncio.sleep(2.5)
        assert a.is_leader
        assert a.epoch == taken.epoch + 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await a_store.close()
        await b_store.close()


@pytest.fixture
async def pg_stores() -> AsyncIterator[list[PostgresStore]]:
    schema = "stoker_elect_" + uuid.uuid4().hex[:8]
    stores = [PostgresStore(POSTGRES_URL, schema=schema, max_size=2) for _ in range(3)]
    try:
        for store in stores:
            await store.open()
    except StoreError as exc:
        for store in stores:
            await store.close()
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"PostgreSQL is not reachable: {exc}")
    yield stores
    for store in stores:
        await store.close()
    import psycopg

    async with await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True) as conn:
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.mark.postgres
async def test_three_replicas_on_postgres_elect_exactly_one(pg_stores: list[PostgresStore]) -> None:
    """Real time with short timings (0.3 s lease): PostgreSQL I/O is invisible to looptime."""
    electors = [elector(s, f"cp-{i}", scale=0.02) for i, s in enumerate(pg_stores)]
    tasks = [asyncio.create_task(e.run()) for e in electors]
    try:
        async with asyncio.timeout(10):
            while sum(e.is_leader for e in electors) != 1:
                await asyncio.sleep(0.01)
        for _ in range(20):
            assert sum(e.is_leader for e in electors) <= 1
            await asyncio.sleep(0.02)
        leader = next(e for e in electors if e.is_leader)
        # The leader dies without resigning: another replica leads after the lease runs out.
        tasks[electors.index(leader)].cancel()
        async with asyncio.timeout(10):
            while not any(e.is_leader for e in electors if e is not leader):
                await asyncio.sleep(0.01)
        assert sum(e.is_leader for e in electors) == 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
