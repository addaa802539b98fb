"""The live worker rows in memory on their own: `LiveRows` on a bare connection to a
workers table, written by raw SQL (no store around it)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from stoker.adapters._rows import LIVE_SQL, WORKER_COLUMNS, WORKER_SELECT, worker_to_row
from stoker.adapters._schema import SQLITE, WORKERS
from stoker.adapters.sqlite.live_rows import LiveRows
from stoker.domain.errors import StoreError
from stoker.domain.records import Worker
from stoker.domain.states import LIVE, WorkerState
from stoker.ports.store import StateCount

S = WorkerState
LOAD = f"SELECT {WORKER_SELECT} FROM workers WHERE state IN {LIVE_SQL}"


def connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute(SQLITE.create_table(WORKERS).replace("CREATE TABLE", "CREATE TABLE IF NOT EXISTS"))
    return db


def insert(
    db: sqlite3.Connection,
    wid: str,
    state: WorkerState,
    *,
    pool: str = "p",
    revision: str = "r1",
    owner: str = "cp-a",
    org: str | None = None,
) -> None:
    """A row written by raw SQL; ids of growing length are created in that order."""
    worker = Worker(wid, pool, revision, state, 0, owner, float(len(wid)), 0.0, org=org)
    values = ", ".join("?" for _ in WORKER_COLUMNS)
    db.execute(f"INSERT INTO workers ({WORKER_SELECT}) VALUES ({values})", worker_to_row(worker))


@pytest.fixture
def db(tmp_path: Path) -> sqlite3.Connection:
    return connect(tmp_path / "w.db")


def truth(db: sqlite3.Connection) -> list[tuple[object, ...]]:
    return [tuple(r) for r in db.execute(f"{LOAD} ORDER BY created_at, id")]


def test_rows_follow_the_connections_writes_without_reading_again(
    db: sqlite3.Connection,
) -> None:
    live = LiveRows()
    live.watch(db)
    insert(db, "w1", S.WARM)
    assert list(live.rows()) == ["w1"]
    statements: list[str] = []
    db.set_trace_callback(statements.append)
    insert(db, "w22", S.SPAWNING, org="acme")
    db.execute("UPDATE workers SET state = 'reserved', org = 'acme' WHERE id = 'w1'")
    insert(db, "w333", S.RETIRED)
    insert(db, "w4444", S.HOT, pool="q", org="zeta")
    db.execute("DELETE FROM workers WHERE id = 'w4444'")
    assert live.select(LIVE) == truth(db)
    assert [r[0] for r in live.select(LIVE)] == ["w1", "w22"]  # retired and deleted: gone
    assert LOAD not in statements


def test_another_connections_commit_is_read_again(db: sqlite3.Connection, tmp_path: Path) -> None:
    live = LiveRows()
    live.watch(db)
    insert(db, "w1", S.WARM)
    assert live.select([S.WARM]) == truth(db)
    other = connect(tmp_path / "w.db")
    other.execute("UPDATE workers SET state = 'draining' WHERE id = 'w1'")
    other.close()
    assert live.select([S.WARM]) == []
    assert [r[0] for r in live.select([S.DRAINING])] == ["w1"]


def test_forget_reads_every_row_again(db: sqlite3.Connection) -> None:
    live = LiveRows()
    live.watch(db)
    insert(db, "w1", S.WARM)
    live.rows()
    live.put(*truth(db)[0][:3], "hot", *truth(db)[0][4:])  # a write SQLite then undid
    assert [r[0] for r in live.select([S.HOT])] == ["w1"]
    live.forget()
    assert live.select([S.HOT]) == []
    assert live.select(LIVE) == truth(db)


def test_counts_and_filters(db: sqlite3.Connection) -> None:
    live = LiveRows()
    live.watch(db)
    insert(db, "a", S.WARM)
    insert(db, "bb", S.WARM, org=None, revision="r2")
    insert(db, "ccc", S.SPAWNING)
    insert(db, "dddd", S.SPAWNING, org="acme")
    insert(db, "eeeee", S.HOT_IDLE, org="acme", owner="cp-b")
    insert(db, "ffffff", S.HOT, org="zeta", pool="q")
    insert(db, "ggggggg", S.RETIRED, org="acme")
    assert live.count_live("p") == 5
    assert live.count_live("p", "acme") == 2
    assert live.count_live("q", "acme") == 0
    assert live.count_neutral("p", "r1") == 2  # a warm and a neutral spawning one
    assert live.may_hold("p", "r1", S.WARM, "anyone")
    assert not live.may_hold("p", "r1", S.HOT_IDLE, "zeta")
    assert live.may_hold("p", "r1", S.HOT_IDLE, "acme")
    assert not live.may_hold("q", "r1", S.WARM, "acme")
    assert live.state_counts() == [
        StateCount("p", "r1", S.HOT_IDLE, True, 1),
        StateCount("p", "r1", S.SPAWNING, False, 1),
        StateCount("p", "r1", S.SPAWNING, True, 1),
        StateCount("p", "r1", S.WARM, False, 1),
        StateCount("p", "r2", S.WARM, False, 1),
        StateCount("q", "r1", S.HOT, True, 1),
    ]
    ids = [r[0] for r in live.select(LIVE, pool="p", not_owners=["cp-b"], limit=3)]
    assert ids == ["a", "bb", "ccc"]
    assert [r[0] for r in live.select(LIVE, org="acme")] == ["dddd", "eeeee"]
    assert [r[0] for r in live.select([S.HOT_IDLE], owner="cp-b")] == ["eeeee"]


def test_a_closed_copy_is_a_store_error(db: sqlite3.Connection) -> None:
    live = LiveRows()
    with pytest.raises(StoreError, match="not open"):
        live.rows()
    live.watch(db)
    live.close()
    with pytest.raises(StoreError, match="not open"):
        live.count_live("p")


def test_answers_kept_between_writes_follow_the_next_write(db: sqlite3.Connection) -> None:
    """The counts and the owner filter answer from what they kept until a row changes."""
    live = LiveRows()
    live.watch(db)
    insert(db, "a", S.HOT, org="acme", owner="cp-a")
    assert live.select([S.HOT], not_owners=["cp-a"]) == []
    before = live.state_counts()
    assert live.state_counts() == before
    insert(db, "bb", S.HOT, org="zeta", owner="cp-b")
    assert [r[0] for r in live.select([S.HOT], not_owners=["cp-a"])] == ["bb"]
    assert live.state_counts() == [StateCount("p", "r1", S.HOT, True, 2)]
    db.execute("DELETE FROM workers WHERE id = 'bb'")
    assert live.select([S.HOT], not_owners=["cp-a"]) == []
    assert live.state_counts() == before


def test_listings_stay_oldest_first_whatever_order_rows_arrive_in(
    db: sqlite3.Connection,
) -> None:
    """Rows put out of creation order (an older row after a newer one; a row whose
    `created_at` a raw write moved), listed whole (walked in order) or by a few states
    (gathered and sorted): oldest first either way, as the table orders them."""
    live = LiveRows()
    live.watch(db)
    insert(db, "w333", S.WARM)
    assert live.select(LIVE) == truth(db)
    insert(db, "w1", S.HOT, org="acme")  # older than the row already last
    insert(db, "w4444", S.WARM)
    insert(db, "w22", S.SPAWNING)
    assert live.select(LIVE) == truth(db)
    db.execute("UPDATE workers SET created_at = 9.0 WHERE id = 'w1'")
    db.execute("UPDATE workers SET state = 'hot_idle' WHERE id = 'w22'")
    assert live.select(LIVE) == truth(db)
    assert [r[0] for r in live.select([S.WARM, S.HOT_IDLE])] == ["w22", "w333", "w4444"]
    assert [r[0] for r in live.select([S.HOT])] == ["w1"]
    assert [r[0] for r in live.select(LIVE, after=(4.0, "w333"))] == ["w4444", "w1"]
