"""The shared table description and the SQLite store's migrations.

(PostgreSQL's upgrade is checked in `test_store_postgres.py`.)
"""

from __future__ import annotations

import sqlite3
from dataclasses import fields
from pathlib import Path

import pytest

from stoker.adapters._rows import CLAIM_COLUMNS, WORKER_COLUMNS
from stoker.adapters._schema import (
    CLAIM_IDEMPOTENCY_COLUMNS,
    CLAIMS,
    POOL_TABLES,
    POSTGRES,
    SQLITE,
    TABLES,
    WORKER_TAKEN_COLUMNS,
    WORKERS,
    Table,
    before_rate,
    pending,
)
from stoker.adapters.sqlite import SqliteStore
from stoker.adapters.sqlite.schema import UPGRADES
from stoker.domain.ledger import LedgerCounts, LedgerKey
from stoker.domain.records import (
    Claim,
    ForecastBucket,
    OrgForecastBucket,
    PoolSizingRecord,
    Worker,
    token_digest,
)
from stoker.domain.states import WorkerState
from store_contract import T0, spawn_req

#: The newest schema version.
LATEST = UPGRADES[-1][0]


def test_rows_are_read_in_the_order_of_the_records_fields() -> None:
    assert tuple(f.name for f in fields(Worker)) == WORKER_COLUMNS
    assert tuple(f.name for f in fields(Claim)) == CLAIM_COLUMNS


def test_both_dialects_render_every_column() -> None:
    for table in TABLES:
        for dialect in (SQLITE, POSTGRES):
            sql = dialect.create_table(table, f"s.{table.name}")
            assert sql.startswith(f"CREATE TABLE s.{table.name} (")
            for column in table.columns:
                assert f"\n    {dialect.column_sql(column)}," in sql
            assert sql.endswith(f"PRIMARY KEY ({', '.join(table.key)})\n)")
    assert POSTGRES.add_column(WORKERS, "version", "s.workers") == (
        "ALTER TABLE s.workers ADD COLUMN version bigint NOT NULL DEFAULT 0"
    )
    assert SQLITE.column_sql(WORKERS.column("activated")) == "activated INTEGER NOT NULL DEFAULT 0"
    assert POSTGRES.column_sql(WORKERS.column("org")) == "org text"


def test_pending_versions() -> None:
    upgrades = [(2, ["b"]), (3, ["c"]), (4, ["d"])]
    assert pending(set(), ["now"], upgrades) == [(1, ["now"]), (2, []), (3, []), (4, [])]
    assert pending({1, 2}, ["now"], upgrades) == [(3, ["c"]), (4, ["d"])]
    assert pending({1, 2, 3, 4}, ["now"], upgrades) == []


def _shape(path: Path) -> tuple[set[tuple[object, ...]], set[str]]:
    """Every table's columns (name, type, not null, default, key) and the indexes."""
    db = sqlite3.connect(path)
    try:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        columns = {
            (table, *row[1:])
            for table in tables
            for row in db.execute(f"PRAGMA table_info({table})")
        }
        indexes = {
            r[0]
            for r in db.execute("SELECT sql FROM sqlite_master WHERE type = 'index' AND sql > ''")
        }
        return columns, indexes
    finally:
        db.close()


async def test_a_database_of_version_4_gains_the_row_version_and_idempotency_keys(
    tmp_path: Path,
) -> None:
    old = tmp_path / "old.db"
    db = sqlite3.connect(old, isolation_level=None)
    later = {"version", *WORKER_TAKEN_COLUMNS}
    before = Table(WORKERS.name, tuple(c for c in WORKERS.columns if c.name not in later))
    claims = Table(
        CLAIMS.name, tuple(c for c in CLAIMS.columns if c.name not in CLAIM_IDEMPOTENCY_COLUMNS)
    )
    for table in (
        before,
        claims,
        *(t for t in map(before_rate, TABLES[2:]) if t and t not in POOL_TABLES),
    ):
        db.execute(SQLITE.create_table(table))
    db.execute("CREATE INDEX workers_live ON workers (state, pool, revision)")
    db.execute("CREATE INDEX claims_state_expires ON claims (state, expires_at)")
    db.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY)")
    db.executemany("INSERT INTO schema_migrations VALUES (?)", [(v,) for v in range(1, 5)])
    db.execute(
        "INSERT INTO workers (id, pool, revision, state, owner, created_at, updated_at, "
        "heartbeat_at) VALUES ('w1', 'p', 'r1', 'warm', 'cp-a', 1, 1, 1)"
    )
    db.close()
    upgraded = SqliteStore(str(old))
    await upgraded.open()
    fresh = SqliteStore(str(tmp_path / "new.db"))
    await fresh.open()
    try:
        assert await upgraded.schema_version() == await fresh.schema_version() == LATEST
        w = await upgraded.get_worker("w1")
        assert w is not None and (w.state, w.version) == (WorkerState.WARM, 0)
        moved = await upgraded.transition(
            "w1", expect=w.state, epoch=0, version=0, to=WorkerState.DRAINING, now=T0
        )
        assert moved is not None and moved.version == 1
        await fresh.reserve_spawn_slots(spawn_req(), ["w2"], T0)
    finally:
        await upgraded.close()
        await fresh.close()
    assert _shape(old) == _shape(tmp_path / "new.db")


async def test_a_database_of_version_5_keeps_its_session_tokens_as_digests(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.db"
    store = SqliteStore(str(path))
    await store.open()
    await store.close()
    # What version 5 left behind: a token in plain text, and version 6 not applied.
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DELETE FROM schema_migrations WHERE version IN (6, 7)")
    db.execute("DROP INDEX claims_idempotency")
    for name in CLAIM_IDEMPOTENCY_COLUMNS:
        db.execute(f"ALTER TABLE claims DROP COLUMN {name}")
    db.execute(
        "INSERT INTO claims (id, pool, org, worker_id, worker_epoch, source, mode, state, "
        "token, endpoint, lease_s, expires_at, created_at, updated_at, owner) VALUES "
        "('c1', 'p', 'acme', 'w1', 1, 'warm', 'prefer_warm', 'bound', 'secret-token', "
        "'http://w', 30, 31, 1, 1, 'cp-a'), "
        "('c2', 'p', 'acme', 'w2', 1, 'warm', 'prefer_warm', 'bound', '', 'http://w', "
        "30, 31, 1, 1, 'cp-a')"
    )
    db.close()
    upgraded = SqliteStore(str(path))
    await upgraded.open()
    try:
        assert await upgraded.schema_version() == LATEST
        c1, c2 = (await upgraded.get_claim("c1")), (await upgraded.get_claim("c2"))
        assert c1 is not None and c1.token == token_digest("secret-token")
        assert c2 is not None and c2.token == ""
    finally:
        await upgraded.close()
    files = b"".join(p.read_bytes() for p in tmp_path.iterdir())  # noqa: ASYNC240
    assert b"secret-token" not in files


async def test_a_database_of_version_10_gains_the_org_forecast_and_keeps_its_forecast(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.db"
    store = SqliteStore(str(path))
    await store.open()
    await store.record_forecast([ForecastBucket("p", "day", 9, 0.01, 0.0, 3, T0)])
    await store.close()
    # What version 10 left behind: no org_forecast table, version 11 not applied.
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DELETE FROM schema_migrations WHERE version = 11")
    db.execute("DROP TABLE org_forecast")
    db.close()
    upgraded = SqliteStore(str(path))
    await upgraded.open()
    try:
        assert await upgraded.schema_version() == LATEST == 18
        assert await upgraded.read_forecast() == [ForecastBucket("p", "day", 9, 0.01, 0.0, 3, T0)]
        bucket = OrgForecastBucket("p", "acme", 9, 0.002, 0.0, 1, T0)
        await upgraded.record_org_forecast([bucket])
        assert await upgraded.read_org_forecast() == [bucket]
    finally:
        await upgraded.close()


async def test_a_database_of_version_11_gains_the_rollout_outcome_counts(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    store = SqliteStore(str(path))
    await store.open()
    await store.close()
    # What version 11 left behind: no rollout_outcomes table, version 12 not applied.
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DELETE FROM schema_migrations WHERE version = 12")
    db.execute("DROP TABLE rollout_outcomes")
    db.close()
    upgraded = SqliteStore(str(path))
    await upgraded.open()
    try:
        assert await upgraded.schema_version() == LATEST == 18
        await upgraded.record_outcomes("cp-a", {"ro-1": {"spawn": 2}}, now=T0)
        assert await upgraded.read_outcomes(["ro-1"]) == {"ro-1": {"spawn": 2}}
    finally:
        await upgraded.close()


async def test_a_database_of_version_13_gains_the_published_sizing(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    store = SqliteStore(str(path))
    await store.open()
    await store.close()
    # What version 13 left behind: no pool_sizing table, version 14 not applied.
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DELETE FROM schema_migrations WHERE version = 14")
    db.execute("DROP TABLE pool_sizing")
    db.close()
    upgraded = SqliteStore(str(path))
    await upgraded.open()
    try:
        assert await upgraded.schema_version() == LATEST == 18
        sized = PoolSizingRecord("p", "cp-a", T0, 4, 2, {"policy": "reactive"})
        await upgraded.record_sizing([sized])
        assert await upgraded.read_sizing() == [sized]
    finally:
        await upgraded.close()


async def test_a_database_of_version_14_finds_a_replicas_last_ledger_write_by_index(
    tmp_path: Path,
) -> None:
    """An adopter reads the last ledger write of each replica whose workers it adopts:
    without an index on the replica, a scan of every cell the retention keeps (35 days
    of every pool, revision and org)."""
    path = tmp_path / "old.db"
    store = SqliteStore(str(path))
    await store.open()
    await store.close()
    # What version 14 left behind: no index of the ledger by replica, version 15 not applied.
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DELETE FROM schema_migrations WHERE version = 15")
    db.execute("DROP INDEX ledger_written")
    db.close()
    upgraded = SqliteStore(str(path))
    await upgraded.open()
    try:
        assert await upgraded.schema_version() == LATEST == 18
    finally:
        await upgraded.close()
    db = sqlite3.connect(path, isolation_level=None)
    query = "EXPLAIN QUERY PLAN SELECT max(updated_at) FROM ledger WHERE instance = 'cp-a'"
    plan = str(db.execute(query).fetchall())
    db.close()
    assert "USING COVERING INDEX ledger_written" in plan, plan


async def test_a_database_of_version_15_keeps_the_placeholders_requests(tmp_path: Path) -> None:
    """The ledger's headroom is priced by the placeholders' own requests, which it keeps
    from version 16 on; a cell written before reads 0 of them."""
    path = tmp_path / "old.db"
    store = SqliteStore(str(path))
    await store.open()
    await store.close()
    # What version 15 left behind: a cell without the columns, version 16 not applied.
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DELETE FROM schema_migrations WHERE version = 16")
    for name in ("placeholder_cpu_s", "placeholder_gib_s"):
        db.execute(f"ALTER TABLE ledger DROP COLUMN {name}")
    db.execute(
        "INSERT INTO ledger (pool, revision, org, hour, instance, warm_s, hot_s, hot_idle_s, "
        "starting_s, draining_s, placeholder_s, cpu_s, gib_s, spawns, ready, ready_sum_s, "
        "claims_reuse, claims_warm, claims_cold, wait_reuse_s, wait_warm_s, wait_cold_s, "
        "failed, failed_wait_s, updated_at) "
        "VALUES ('p', 'r1', '', 0, 'cp-a', 0, 0, 0, 0, 0, 40, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "
        "0, 0, 1)"
    )
    db.close()
    upgraded = SqliteStore(str(path))
    await upgraded.open()
    try:
        assert await upgraded.schema_version() == LATEST == 18
        [(_, old)] = await upgraded.read_ledger("p", since=0, until=3600)
        assert (old.placeholder_s, old.placeholder_cpu_s, old.placeholder_gib_s) == (40, 0, 0)
        new = LedgerCounts(placeholder_s=40.0, placeholder_cpu_s=11.0, placeholder_gib_s=2.5)
        assert await upgraded.record_ledger("cp-b", {LedgerKey("p", "r1", "", 0): new}, now=2)
        rows = await upgraded.read_ledger("p", since=0, until=3600)
        assert sorted(c.placeholder_cpu_s for _, c in rows) == [0.0, 11.0]
    finally:
        await upgraded.close()


async def test_a_database_of_version_16_keeps_its_workers_and_stamps_the_next_take(
    tmp_path: Path,
) -> None:
    """From version 17 a worker row says when its owner last changed (`taken_at`): a row
    written before reads None, and the next reservation by another replica stamps it."""
    path = tmp_path / "old.db"
    store = SqliteStore(str(path))
    await store.open()
    await store.close()
    # What version 16 left behind: a warm worker without the columns, 17 not applied.
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DELETE FROM schema_migrations WHERE version = 17")
    for name in ("taken_at", "prior_taken_at"):
        db.execute(f"ALTER TABLE workers DROP COLUMN {name}")
    db.execute(
        "INSERT INTO workers (id, pool, revision, state, owner, created_at, updated_at, "
        "heartbeat_at, endpoint) VALUES ('w1', 'p', 'r1', 'warm', 'cp-a', 1, 1, 1, 'http://w')"
    )
    db.close()
    upgraded = SqliteStore(str(path))
    await upgraded.open()
    try:
        assert await upgraded.schema_version() == LATEST == 18
        old = await upgraded.get_worker("w1") or pytest.fail("w1 lost")
        assert (old.owner, old.taken_at, old.prior_taken_at) == ("cp-a", None, None)
        result = await upgraded.reserve(
            "w1",
            expect=WorkerState.WARM,
            epoch=old.epoch,
            version=old.version,
            org="acme",
            org_cap=0,
            owner="cp-b",
            now=T0,
        )
        taken = result.worker or pytest.fail("not reserved")
        assert (taken.owner, taken.taken_at, taken.prior_taken_at) == ("cp-b", T0, None)
    finally:
        await upgraded.close()


async def test_a_database_of_version_17_keeps_the_changes_of_owner_from_its_upgrade_on(
    tmp_path: Path,
) -> None:
    """From version 18 every change of a worker's owner is kept (`first_takes`): a
    database without the table gets it, and the next take is kept."""
    path = tmp_path / "old.db"
    store = SqliteStore(str(path))
    await store.open()
    await store.close()
    # What version 17 left behind: no table of changes, 18 not applied.
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DELETE FROM schema_migrations WHERE version = 18")
    db.execute("DROP TABLE worker_takes")
    db.execute(
        "INSERT INTO workers (id, pool, revision, state, owner, created_at, updated_at, "
        "heartbeat_at, endpoint, taken_at) "
        "VALUES ('w1', 'p', 'r1', 'warm', 'cp-a', 1, 1, 1, 'http://w', 1)"
    )
    db.close()
    upgraded = SqliteStore(str(path))
    await upgraded.open()
    try:
        assert await upgraded.schema_version() == LATEST == 18
        old = await upgraded.get_worker("w1") or pytest.fail("w1 lost")
        # The take before the upgrade is the row's own stamp only.
        assert await upgraded.first_takes([("w1", 0)]) == [None]
        result = await upgraded.reserve(
            "w1",
            expect=WorkerState.WARM,
            epoch=old.epoch,
            version=old.version,
            org="acme",
            org_cap=0,
            owner="cp-b",
            now=T0,
        )
        taken = result.worker or pytest.fail("not reserved")
        assert (taken.taken_at, taken.prior_taken_at) == (T0, 1)
        assert await upgraded.first_takes([("w1", 0)]) == [T0]
    finally:
        await upgraded.close()
