"""SQLite group commit on its own: `GroupCommit` on a bare connection and a one-table file,
without a store around it."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import pytest

from stoker.adapters.sqlite.batching import LOOP_BUSY_MS, GroupCommit, OpenBatches
from stoker.domain.errors import StoreError

T = TypeVar("T")


def connect(path: Path, *, busy_timeout_s: float = 5.0) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("CREATE TABLE IF NOT EXISTS t (k TEXT PRIMARY KEY, v INTEGER NOT NULL)")
    return db


@asynccontextmanager
async def commits(
    path: Path, *, batches: OpenBatches, busy_timeout_s: float = 5.0
) -> AsyncIterator[tuple[GroupCommit, list[str]]]:
    """A GroupCommit on `path`, the statements it ran, and how often it reported an undo."""
    undone: list[str] = []
    writes = GroupCommit(str(path), on_undo=lambda: undone.append("undo"), batches=batches)
    writes.db = connect(path, busy_timeout_s=busy_timeout_s)
    try:
        yield writes, undone
    finally:
        writes.commit()
        writes.db.close()


async def put(writes: GroupCommit, key: str, value: int = 1) -> None:
    async with writes.tx() as db:
        db.execute("INSERT INTO t (k, v) VALUES (?, ?)", (key, value))


def on_disk(path: Path) -> dict[str, int]:
    """The rows as another connection reads them from the file."""
    other = sqlite3.connect(path)
    try:
        return dict(other.execute("SELECT k, v FROM t").fetchall())
    finally:
        other.close()


def traced(writes: GroupCommit) -> list[str]:
    statements: list[str] = []
    assert writes.db is not None
    writes.db.set_trace_callback(statements.append)
    return statements


async def test_writes_of_one_iteration_share_one_commit(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    batches = OpenBatches()
    async with commits(path, batches=batches) as (writes, undone):
        statements = traced(writes)
        seen: list[dict[str, int]] = []

        async def write(i: int) -> None:
            await put(writes, f"k{i}", i)
            seen.append(on_disk(path))  # resumed only once the write is on disk

        await asyncio.gather(*(write(i) for i in range(10)))
        assert statements.count("BEGIN IMMEDIATE") == 1
        assert statements.count("COMMIT") == 1
        assert statements.count("SAVEPOINT write") == 10
        assert all(len(rows) == 10 for rows in seen)
        assert (len(batches), undone) == (0, [])
        await put(writes, "later")  # the next iteration opens a batch of its own
        assert statements.count("COMMIT") == 2


async def test_a_failed_write_undoes_only_itself(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    async with commits(path, batches=OpenBatches()) as (writes, undone):

        async def fail() -> None:
            async with writes.tx() as db:
                db.execute("INSERT INTO t (k, v) VALUES ('bad', 0)")
                raise RuntimeError("undone")

        results = await asyncio.gather(
            put(writes, "a"), fail(), put(writes, "a"), put(writes, "b"), return_exceptions=True
        )
        assert isinstance(results[1], RuntimeError)
        assert isinstance(results[2], StoreError)  # the duplicate key: a SQLite error
        assert on_disk(path) == {"a": 1, "b": 1}
        assert undone == ["undo", "undo"]


async def test_write_one_goes_with_the_open_batch(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    async with commits(path, batches=OpenBatches()) as (writes, _):
        await put(writes, "a")
        statements = traced(writes)
        (changed, _rows), _ = await asyncio.gather(
            writes.write_one("UPDATE t SET v = v + 1 WHERE k = 'a'"), put(writes, "b")
        )
        assert changed == 1
        assert statements.count("COMMIT") == 1
        assert on_disk(path) == {"a": 2, "b": 1}
        alone, _ = await writes.write_one("UPDATE t SET v = 9 WHERE k = 'b'")
        assert alone == 1 and on_disk(path)["b"] == 9  # no batch open: committed by itself


async def test_two_writers_on_one_file_in_one_loop_take_turns(tmp_path: Path) -> None:
    """The registry lets the second commit the first's open batch before taking the lock."""
    path = tmp_path / "t.db"
    batches = OpenBatches()
    async with (
        commits(path, batches=batches, busy_timeout_s=2) as (a, _),
        commits(path, batches=batches, busy_timeout_s=2) as (b, _),
    ):
        await asyncio.gather(*(put(a if i % 2 else b, f"k{i}") for i in range(6)))
        assert len(on_disk(path)) == 6
        assert len(batches) == 0


async def test_without_a_shared_registry_the_second_writer_waits_on_the_loop(
    tmp_path: Path,
) -> None:
    """Two writers that do not know of each other's batch: the second waits for the lock
    on the loop (not in SQLite's busy handler), so the first's batch commits meanwhile."""
    path = tmp_path / "t.db"
    async with (
        commits(path, batches=OpenBatches(), busy_timeout_s=LOOP_BUSY_MS / 1000) as (a, _),
        commits(path, batches=OpenBatches(), busy_timeout_s=LOOP_BUSY_MS / 1000) as (b, _),
    ):
        await asyncio.gather(put(a, "a"), put(b, "b"))
        assert on_disk(path) == {"a": 1, "b": 1}


async def ticks_while(work: Awaitable[T]) -> tuple[int, T | BaseException]:
    """How many loop iterations ran while `work` ran, and its result or error."""
    task = asyncio.ensure_future(work)
    ticks = 0
    while not task.done():
        await asyncio.sleep(0)
        ticks += 1
    exc = task.exception()
    return ticks, exc if exc is not None else task.result()


@pytest.mark.parametrize("write", ["batch", "one statement"])
async def test_a_write_lock_held_by_another_process_never_holds_up_the_loop(
    tmp_path: Path, write: str
) -> None:
    """The lock holder (another connection, as another process would be) keeps it past
    the writer's wait: the loop runs on meanwhile, and the write fails naming the lock."""
    path = tmp_path / "t.db"
    async with commits(path, batches=OpenBatches(), busy_timeout_s=LOOP_BUSY_MS / 1000) as (
        writes,
        _,
    ):
        writes.lock_wait_s = 0.5
        holder = connect(path)
        holder.execute("BEGIN IMMEDIATE")
        try:
            attempt = (
                put(writes, "a")
                if write == "batch"
                else writes.write_one("INSERT INTO t (k, v) VALUES ('a', 1)")
            )
            ticks, outcome = await ticks_while(attempt)
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert isinstance(outcome, StoreError), outcome
        assert "another process held the write lock for 0.5s" in str(outcome)
        # The loop kept turning while the writer waited (blocked, it would not have).
        assert ticks >= 10
        # Once the lock is free, the next write goes through.
        await put(writes, "b")
        assert on_disk(path) == {"b": 1}


async def test_a_private_memory_database_commits_each_write_at_once() -> None:
    writes = GroupCommit(None, on_undo=lambda: None, batches=OpenBatches())
    writes.db = sqlite3.connect(":memory:", isolation_level=None)
    writes.db.execute("CREATE TABLE t (k TEXT PRIMARY KEY, v INTEGER NOT NULL)")
    statements = traced(writes)
    await asyncio.gather(put(writes, "a"), put(writes, "b"))
    assert statements.count("COMMIT") == 2
    assert "SAVEPOINT write" not in statements
    assert not writes.db.in_transaction
    writes.db.close()


async def test_a_single_write_to_a_private_database_runs_without_begin_and_commit() -> None:
    """One statement is atomic on its own: no BEGIN or COMMIT. A failed one is a
    StoreError and reported undone (its triggers may have run), as in a transaction."""
    undone: list[str] = []
    writes = GroupCommit(None, on_undo=lambda: undone.append("undo"), batches=OpenBatches())
    writes.db = sqlite3.connect(":memory:", isolation_level=None)
    writes.db.execute("CREATE TABLE t (k TEXT PRIMARY KEY, v INTEGER NOT NULL)")
    statements = traced(writes)
    async with writes.single_write() as db:
        db.execute("INSERT INTO t (k, v) VALUES ('a', 1)")
    assert statements == ["INSERT INTO t (k, v) VALUES ('a', 1)"]
    with pytest.raises(StoreError, match="UNIQUE"):
        async with writes.single_write() as db:
            db.execute("INSERT INTO t (k, v) VALUES ('a', 2)")
    assert undone == ["undo"]
    assert writes.db.execute("SELECT k, v FROM t").fetchall() == [("a", 1)]
    assert not writes.db.in_transaction
    writes.db.close()


async def test_a_single_write_to_a_file_goes_with_the_open_batch(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    async with commits(path, batches=OpenBatches()) as (writes, _):
        statements = traced(writes)

        async def single(key: str) -> None:
            async with writes.single_write() as db:
                db.execute("INSERT INTO t (k, v) VALUES (?, 1)", (key,))

        await asyncio.gather(single("a"), put(writes, "b"))
        assert statements.count("BEGIN IMMEDIATE") == statements.count("COMMIT") == 1
        assert on_disk(path) == {"a": 1, "b": 1}


@pytest.mark.parametrize(
    "use",
    [lambda w: w.conn, lambda w: w.read("SELECT 1"), lambda w: w.tx_now().__enter__()],
)
def test_a_closed_connection_is_a_store_error(use: Callable[[GroupCommit], object]) -> None:
    writes = GroupCommit("/nowhere", on_undo=lambda: None, batches=OpenBatches())
    with pytest.raises(StoreError, match="not open"):
        use(writes)
