"""The Store contract on SQLite (one temporary file per test), plus SQLite's own concerns.

Within one event loop the adapter never awaits inside a transaction, so asyncio tasks
cannot interleave its writes; the contract's concurrency tests then check that several
instances on one file agree. The tests below add true parallelism: threads, each with its
own loop and connection, so that `BEGIN IMMEDIATE` and the busy timeout really serialise
writers, as they must for several processes on one file.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from stoker.adapters.store_sqlite import SqliteStore
from stoker.domain.errors import StoreError
from stoker.domain.states import WorkerState
from store_contract import T0, MakeStore, StoreContract, spawn_req, store_factory

T = TypeVar("T")


class TestSqliteStore(StoreContract):
    @pytest.fixture
    async def make_store(self, tmp_path: Path) -> AsyncIterator[MakeStore]:
        path = str(tmp_path / "stoker.db")
        async with store_factory(lambda: SqliteStore(path)) as make:
            yield make


def in_threads(n: int, work: Callable[[int], Awaitable[T]]) -> list[T]:
    """Run `work(i)` for i < n at once, each in its own thread and event loop."""
    results: list[T | BaseException | None] = [None] * n
    start = threading.Barrier(n)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = asyncio.run(work(i))  # type: ignore[arg-type]
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


async def test_first_opens_from_parallel_processes_all_migrate(tmp_path: Path) -> None:
    path = str(tmp_path / "stoker.db")

    async def open_one(i: int) -> int:
        store = SqliteStore(path)
        await store.open()
        try:
            return await store.schema_version()
        finally:
            await store.close()

    versions = await asyncio.to_thread(in_threads, 8, open_one)
    assert len(set(versions)) == 1
    assert versions[0] > 0


async def test_parallel_writers_never_exceed_a_cap(tmp_path: Path) -> None:
    path = str(tmp_path / "stoker.db")
    seed = SqliteStore(path)
    await seed.open()
    await seed.close()

    async def spawn(i: int) -> int:
        store = SqliteStore(path)
        await store.open()
        try:
            total = 0
            for k in range(5):
                req = spawn_req(count=2, pool_cap=17, owner=f"cp-{i}")
                result = await store.reserve_spawn_slots(req, [f"s-{i}-{k}-0", f"s-{i}-{k}-1"], T0)
                total += len(result.workers)
            return total
        finally:
            await store.close()

    assert sum(await asyncio.to_thread(in_threads, 6, spawn)) == 17
    check = SqliteStore(path)
    await check.open()
    try:
        assert len(await check.list_workers(states=[WorkerState.SPAWNING])) == 17
    finally:
        await check.close()


async def test_a_full_disk_is_a_store_error_and_changes_nothing(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "stoker.db"))
    await store.open()
    try:
        (w,) = (await store.reserve_spawn_slots(spawn_req(), ["w-1"], T0)).workers
        # No page may be added: a big write fails as on a full disk, and SQLite rolls the
        # transaction back by itself before the adapter gets to.
        pages = store.db.execute("PRAGMA page_count").fetchone()[0]
        store.db.execute(f"PRAGMA max_page_count = {pages}")
        ids = [f"big-{i}-" + "x" * 400 for i in range(200)]
        with pytest.raises(StoreError, match="full"):
            await store.reserve_spawn_slots(spawn_req(count=200, owner="o" * 1000), ids, T0 + 1)
        assert await store.list_workers() == [w]
        moved = await store.transition(
            "w-1", expect=WorkerState.SPAWNING, epoch=0, to=WorkerState.RETIRED, now=T0 + 2
        )
        assert moved is not None and moved.state is WorkerState.RETIRED
    finally:
        await store.close()


async def test_listings_follow_every_change_to_the_workers(tmp_path: Path) -> None:
    """`list_workers` and `count_workers` reuse their answer only while no row changed:
    a write through the store, raw SQL on its own connection, or another connection."""
    path = str(tmp_path / "stoker.db")
    a, b = SqliteStore(path), SqliteStore(path)
    await a.open()
    await b.open()
    try:
        (w,) = (await a.reserve_spawn_slots(spawn_req(), ["w1"], T0)).workers
        assert [x.state for x in await a.list_workers()] == [WorkerState.SPAWNING]
        await a.transition(
            "w1", expect=WorkerState.SPAWNING, epoch=w.epoch, to=WorkerState.WARM, now=T0
        )
        assert [x.state for x in await a.list_workers()] == [WorkerState.WARM]
        a.db.execute("UPDATE workers SET owner = 'cp-z' WHERE id = 'w1'")
        assert [x.owner for x in await a.list_workers()] == ["cp-z"]
        await b.transition(
            "w1", expect=WorkerState.WARM, epoch=w.epoch, to=WorkerState.RETIRED, now=T0 + 1
        )
        assert [x.state for x in await a.list_workers()] == [WorkerState.RETIRED]
        assert await a.count_workers() == []
        listed = await a.list_workers()
        listed.clear()  # a caller's list is its own
        assert len(await a.list_workers()) == 1
    finally:
        await a.close()
        await b.close()


async def test_an_sqlite_without_returning_is_refused_with_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 31, 1))
    monkeypatch.setattr(sqlite3, "sqlite_version", "3.31.1")
    store = SqliteStore(str(tmp_path / "stoker.db"))
    with pytest.raises(StoreError, match=r"needs SQLite 3\.35\.0 or newer .* has 3\.31\.1"):
        await store.open()
