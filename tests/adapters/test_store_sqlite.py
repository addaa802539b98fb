"""The Store contract on SQLite (one temporary file per test), plus SQLite's own concerns.

Within one event loop the adapter never awaits inside a write, so asyncio tasks cannot
interleave its statements (the writes of one loop iteration share one COMMIT, each in its
own savepoint); the contract's concurrency tests then check that several instances on one
file agree. The tests below add true parallelism: threads, each with its
own loop and connection, so that `BEGIN IMMEDIATE` and the busy timeout really serialise
writers, as they must for several processes on one file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from stoker.adapters._rows import LIVE_SQL, WORKER_SELECT, worker_from_row
from stoker.adapters.sqlite import SqliteStore
from stoker.domain.errors import IllegalTransition, StoreError
from stoker.domain.records import Worker
from stoker.domain.states import LIVE, TRANSITIONS, WorkerState
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
            "w-1",
            expect=WorkerState.SPAWNING,
            epoch=0,
            version=0,
            to=WorkerState.RETIRED,
            now=T0 + 2,
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
        warm = await a.transition(
            "w1",
            expect=WorkerState.SPAWNING,
            epoch=w.epoch,
            version=w.version,
            to=WorkerState.WARM,
            now=T0,
        )
        assert warm is not None
        assert [x.state for x in await a.list_workers()] == [WorkerState.WARM]
        a.db.execute("UPDATE workers SET owner = 'cp-z' WHERE id = 'w1'")
        assert [x.owner for x in await a.list_workers()] == ["cp-z"]
        await b.transition(
            "w1",
            expect=WorkerState.WARM,
            epoch=w.epoch,
            version=warm.version,
            to=WorkerState.RETIRED,
            now=T0 + 1,
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


def sql_count(store: SqliteStore, where: str) -> int:
    sql = f"SELECT COUNT(*) FROM workers WHERE state IN {LIVE_SQL} AND {where}"
    return int(store.db.execute(sql).fetchone()[0])


async def test_live_rows_in_memory_agree_with_the_table(tmp_path: Path) -> None:
    """`list_workers` and `count_workers` of live states, and the counts by pool and org
    that spawn slots and reservations check, answer from rows kept in memory: after every
    kind of write (the store's, raw SQL, another connection's, one rolled back) they must
    equal what SQL reads from the table."""
    path = str(tmp_path / "stoker.db")
    a, b = SqliteStore(path), SqliteStore(path)
    await a.open()
    await b.open()
    rng = random.Random(7)
    live_sql = f"state IN {LIVE_SQL}"
    try:
        for step in range(300):
            rows = a.db.execute(
                f"SELECT id, state, epoch, version FROM workers WHERE {live_sql}"
            ).fetchall()
            op = rng.choice(["spawn", "spawn", "move", "move", "other", "rollback", "raw"])
            if op == "spawn" or not rows:
                owner = rng.choice(["cp-a", "cp-b"])
                where = {"pool": rng.choice(["p", "q"]), "org": rng.choice([None, "acme", "zeta"])}
                await a.reserve_spawn_slots(
                    spawn_req(owner=owner, count=2, **where), [f"w{step}a", f"w{step}b"], T0 + step
                )
            else:
                wid, state, epoch, version = rng.choice(rows)
                nxt = rng.choice(sorted(TRANSITIONS[WorkerState(state)] - {WorkerState.ACTIVATING}))
                changes = {"org": None} if nxt is WorkerState.WARM else {}
                store = b if op == "other" else a
                if op == "rollback":
                    with contextlib.suppress(RuntimeError):
                        async with a._writes.tx() as db:
                            db.execute("UPDATE workers SET state = 'retired' WHERE id = ?", (wid,))
                            raise RuntimeError("undone")
                elif op == "raw":
                    a.db.execute("UPDATE workers SET owner = 'cp-z' WHERE id = ?", (wid,))
                else:
                    with contextlib.suppress(IllegalTransition):
                        await store.transition(
                            wid,
                            expect=WorkerState(state),
                            epoch=epoch,
                            version=version,
                            to=nxt,
                            now=T0 + step,
                            changes=changes,
                        )
            truth = [
                worker_from_row(r)
                for r in a.db.execute(
                    f"SELECT {WORKER_SELECT} FROM workers WHERE {live_sql} ORDER BY created_at, id"
                )
            ]
            assert await a.list_workers(states=LIVE) == truth, (step, op)
            hot_or_warm = [w for w in truth if w.state in (WorkerState.WARM, WorkerState.HOT)]
            assert await a.list_workers(states=[WorkerState.WARM, WorkerState.HOT]) == hot_or_warm
            assert await a.list_workers(states=LIVE, not_owners=["cp-a"]) == [
                w for w in truth if w.owner != "cp-a"
            ]
            counted = a.db.execute(
                "SELECT pool, revision, state, org IS NOT NULL, COUNT(*) FROM workers "
                f"WHERE {live_sql} GROUP BY pool, revision, state, org IS NOT NULL"
            ).fetchall()
            assert [
                (c.pool, c.revision, c.state.value, int(c.bound), c.count)
                for c in await a.count_workers()
            ] == [tuple(r) for r in counted]
            # The counts that decide caps and targets inside write transactions.
            for pool in ("p", "q", "none"):
                assert a._live.count_live(pool) == sql_count(a, f"pool = '{pool}'"), (step, op)
                assert a._live.count_neutral(pool, "r1") == sql_count(
                    a, f"pool = '{pool}' AND (state = 'warm' OR state = 'spawning' AND org IS NULL)"
                )
                for org in ("acme", "zeta"):
                    assert a._live.count_live(pool, org) == sql_count(
                        a, f"pool = '{pool}' AND org = '{org}'"
                    )
    finally:
        await a.close()
        await b.close()


# -- group commit ---------------------------------------------------------------------------


async def _spawning(store: SqliteStore, n: int) -> list[str]:
    ids = [f"w-{i}" for i in range(n)]
    await store.reserve_spawn_slots(spawn_req(count=n), ids, T0)
    return ids


def _moved(
    store: SqliteStore, wid: str, to: WorkerState, now: float = T0 + 1
) -> Awaitable[Worker | None]:
    """A worker of `_spawning` moved on to `to`."""
    return store.transition(wid, expect=WorkerState.SPAWNING, epoch=0, version=0, to=to, now=now)


def _on_disk(path: str) -> dict[str, str]:
    """Each worker's state as another connection reads it from the file."""
    other = sqlite3.connect(path)
    try:
        return dict(other.execute("SELECT id, state FROM workers").fetchall())
    finally:
        other.close()


async def test_the_writes_of_one_loop_iteration_share_one_commit(tmp_path: Path) -> None:
    """Concurrent writers are committed together, and each resumes only once its write is
    on disk: another connection sees every change as soon as the writers are back."""
    path = str(tmp_path / "stoker.db")
    store = SqliteStore(path)
    await store.open()
    try:
        ids = await _spawning(store, 10)
        statements: list[str] = []
        store.db.set_trace_callback(statements.append)
        moved = await asyncio.gather(*(_moved(store, wid, WorkerState.DRAINING) for wid in ids))
        store.db.set_trace_callback(None)
        assert all(w is not None and w.state is WorkerState.DRAINING for w in moved)
        assert statements.count("COMMIT") == 1
        assert statements.count("BEGIN IMMEDIATE") == 1
        assert set(_on_disk(path).values()) == {"draining"}
    finally:
        await store.close()


async def test_a_failed_write_undoes_only_itself_in_its_batch(tmp_path: Path) -> None:
    """One writer's error rolls back its own savepoint; the others of the batch commit."""
    path = str(tmp_path / "stoker.db")
    store = SqliteStore(path)
    await store.open()
    try:
        first, bad, last = await _spawning(store, 3)

        async def fail_after_writing(wid: str) -> None:
            async with store._writes.tx() as db:
                db.execute("UPDATE workers SET state = 'retired' WHERE id = ?", (wid,))
                raise RuntimeError("undone")

        results = await asyncio.gather(
            _moved(store, first, WorkerState.DRAINING),
            fail_after_writing(bad),
            _moved(store, bad, WorkerState.HOT),  # spawning -> hot is not a transition
            _moved(store, last, WorkerState.DRAINING),
            return_exceptions=True,
        )
        assert isinstance(results[1], RuntimeError)
        assert isinstance(results[2], IllegalTransition)
        assert _on_disk(path) == {first: "draining", bad: "spawning", last: "draining"}
        assert [w.id for w in await store.list_workers(states=[WorkerState.DRAINING])] == [
            first,
            last,
        ]
    finally:
        await store.close()


async def test_two_stores_on_one_file_in_one_loop_take_turns(tmp_path: Path) -> None:
    """A store whose batch is open would wait for this loop's next iteration to commit;
    another store of the same loop commits it before taking the write lock, instead of
    waiting out the busy timeout for a commit that cannot come."""
    path = str(tmp_path / "stoker.db")
    a, b = SqliteStore(path, busy_timeout_s=2), SqliteStore(path, busy_timeout_s=2)
    await a.open()
    await b.open()
    try:
        ids = await _spawning(a, 6)
        moved = await asyncio.gather(
            *(_moved(a if i % 2 else b, wid, WorkerState.DRAINING) for i, wid in enumerate(ids)),
            b.heartbeat_instance("nobody", now=T0),
        )
        # Waiting for the lock instead would end in "database is locked" (a StoreError).
        assert all(w is not None for w in moved[:-1])
        assert len(await a.list_workers(states=[WorkerState.DRAINING])) == 6
    finally:
        await a.close()
        await b.close()


async def test_a_reservation_moves_on_to_activating_in_its_own_write(tmp_path: Path) -> None:
    """SQLite takes up `activate`: a claim's reservation and its move to activating are one
    write (one savepoint), not two."""
    store = SqliteStore(str(tmp_path / "stoker.db"))
    await store.open()
    try:
        (wid,) = await _spawning(store, 1)
        ready = await _moved(store, wid, WorkerState.WARM)
        assert ready is not None
        statements: list[str] = []
        store.db.set_trace_callback(statements.append)
        result = await store.reserve(
            wid,
            expect=WorkerState.WARM,
            epoch=ready.epoch,
            version=ready.version,
            org="acme",
            org_cap=0,
            owner="cp-a",
            now=T0 + 2,
            activate=True,
        )
        store.db.set_trace_callback(None)
        assert result.worker is not None and result.worker.state is WorkerState.ACTIVATING
        assert result.worker.activated and result.worker.epoch == ready.epoch + 1
        assert statements.count("SAVEPOINT write") == 1
        assert await store.get_worker(wid) == result.worker
    finally:
        await store.close()


async def test_a_full_disk_in_a_batch_tells_every_writer_the_truth(tmp_path: Path) -> None:
    """A write that fills the disk makes SQLite undo the whole transaction, with the other
    writes of its batch: each writer's answer must match what the file holds afterwards
    (success: its change is there; StoreError: it is not)."""
    path = str(tmp_path / "stoker.db")
    store = SqliteStore(path)
    await store.open()
    try:
        first, last = await _spawning(store, 2)
        pages = store.db.execute("PRAGMA page_count").fetchone()[0]
        store.db.execute(f"PRAGMA max_page_count = {pages}")

        async def too_big() -> None:
            # A table without triggers: SQLite keeps no statement journal for a plain
            # INSERT, so a full disk rolls back the whole transaction, not the statement.
            async with store._writes.tx() as db:
                db.execute(
                    "INSERT INTO demand (pool, instance, misses, waiting, updated_at) "
                    "VALUES (?, 'i', 0, 0, 0)",
                    ("x" * 200_000,),
                )

        results = await asyncio.gather(
            _moved(store, first, WorkerState.DRAINING),
            too_big(),
            _moved(store, last, WorkerState.DRAINING),
            return_exceptions=True,
        )
        assert isinstance(results[1], StoreError)
        # The first write went with the transaction; the last one opened a batch of its own.
        assert isinstance(results[0], StoreError)
        states = _on_disk(path)
        assert set(states) == {first, last}
        for wid, result in ((first, results[0]), (last, results[2])):
            if isinstance(result, StoreError):
                assert states[wid] == "spawning"
            else:
                assert result is not None and states[wid] == "draining"
        # The store goes on: a later write opens a batch of its own.
        store.db.execute("PRAGMA max_page_count = 1000000")
        row = await store.get_worker(first)
        assert row is not None
        later = await store.transition(
            first,
            expect=WorkerState(states[first]),
            epoch=0,
            version=row.version,
            to=WorkerState.RETIRED,
            now=T0 + 2,
        )
        assert later is not None and later.state is WorkerState.RETIRED
    finally:
        await store.close()


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


async def test_the_database_and_its_wal_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "stoker.db"
    old = os.umask(0o022)  # the usual umask: files would be created 0644
    try:
        store = SqliteStore(str(path))
        await store.open()
        try:
            await store.reserve_spawn_slots(spawn_req(), ["w1"], T0)
            await store.get_worker("w1")
            files = [path, tmp_path / "stoker.db-wal", tmp_path / "stoker.db-shm"]
            assert all(p.exists() for p in files)
            assert [_mode(p) for p in files] == [0o600, 0o600, 0o600]
        finally:
            await store.close()
    finally:
        os.umask(old)


async def test_opening_takes_other_users_access_away_from_an_existing_database(
    tmp_path: Path,
) -> None:
    path = tmp_path / "stoker.db"
    store = SqliteStore(str(path))
    await store.open()
    await store.close()
    path.chmod(0o644)  # as an older version created it
    store = SqliteStore(str(path))
    await store.open()
    try:
        assert _mode(path) == 0o600
    finally:
        await store.close()
