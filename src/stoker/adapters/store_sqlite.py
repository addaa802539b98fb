"""SQLite store: the embedded default (`sqlite:///./stoker.db`).

One connection, used from the event loop without threads: the statements of one method
run with no `await` between them, so the writes of one process never interleave and the
loop's (possibly virtual) clock sees no hidden I/O. The writes made in one iteration of
the loop share one transaction and one COMMIT (group commit, see `_tx`); each caller
resumes once its write is committed. Writers from other processes are serialised by
`BEGIN IMMEDIATE`; WAL lets readers proceed meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
from collections import Counter
from collections.abc import AsyncIterator, Collection, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from stoker.adapters._rows import (
    CLAIM_SELECT,
    LIVE_SQL,
    WORKER_COLUMNS,
    WORKER_SELECT,
    check_claim_for,
    check_move,
    check_reservable,
    checked_changes,
    claim_from_row,
    claim_to_row,
    column_value,
    dump_json,
    instance_from_row,
    lease_from_row,
    matches,
    spawn_room,
    spawning_workers,
    worker_from_row,
    worker_to_row,
)
from stoker.domain.errors import StoreError
from stoker.domain.records import Claim, DemandRecord, Instance, LeaseRecord, Worker
from stoker.domain.states import LIVE, ClaimState, WorkerState
from stoker.ports.store import ReserveResult, SpawnRequest, SpawnResult, StateCount

#: Versioned migrations; version N is applied once, in order, inside one transaction.
MIGRATIONS: list[tuple[int, list[str]]] = [
    (
        1,
        [
            """CREATE TABLE workers (
                id TEXT PRIMARY KEY,
                pool TEXT NOT NULL,
                revision TEXT NOT NULL,
                state TEXT NOT NULL,
                epoch INTEGER NOT NULL DEFAULT 0,
                owner TEXT NOT NULL,
                created_at REAL NOT NULL,
                updated_at REAL NOT NULL,
                org TEXT,
                claim_id TEXT,
                endpoint TEXT,
                runtime_ref TEXT NOT NULL DEFAULT '{}',
                activated INTEGER NOT NULL DEFAULT 0,
                heartbeat_at REAL NOT NULL,
                idle_since REAL,
                ttl_s REAL,
                reason TEXT
            )""",
            "CREATE INDEX workers_pool_state ON workers (pool, state, revision)",
            "CREATE INDEX workers_pool_org ON workers (pool, org, state)",
            "CREATE INDEX workers_owner ON workers (owner, state)",
            "CREATE INDEX workers_state ON workers (state)",
            """CREATE TABLE claims (
                id TEXT PRIMARY KEY,
                pool TEXT NOT NULL,
                org TEXT NOT NULL,
                worker_id TEXT NOT NULL,
                worker_epoch INTEGER NOT NULL,
                source TEXT NOT NULL,
                mode TEXT NOT NULL,
                state TEXT NOT NULL,
                token TEXT NOT NULL,
                endpoint TEXT NOT NULL,
                lease_s REAL NOT NULL,
                expires_at REAL NOT NULL,
                created_at REAL NOT NULL,
                updated_at REAL NOT NULL,
                owner TEXT NOT NULL,
                ttl_s REAL,
                ended_at REAL,
                reason TEXT
            )""",
            "CREATE INDEX claims_state_expires ON claims (state, expires_at)",
            "CREATE INDEX claims_worker ON claims (worker_id)",
            """CREATE TABLE instances (
                id TEXT PRIMARY KEY,
                started_at REAL NOT NULL,
                heartbeat_at REAL NOT NULL,
                state TEXT NOT NULL,
                meta TEXT NOT NULL DEFAULT '{}'
            )""",
            """CREATE TABLE leases (
                name TEXT PRIMARY KEY,
                holder TEXT NOT NULL,
                epoch INTEGER NOT NULL,
                renewed_at REAL NOT NULL,
                duration_s REAL NOT NULL
            )""",
        ],
    ),
    (
        2,
        [
            """CREATE TABLE demand (
                pool TEXT NOT NULL,
                instance TEXT NOT NULL,
                misses INTEGER NOT NULL,
                waiting INTEGER NOT NULL,
                updated_at REAL NOT NULL,
                PRIMARY KEY (pool, instance)
            )""",
            "CREATE INDEX workers_purge ON workers (state, updated_at)",
            "CREATE INDEX claims_purge ON claims (state, updated_at)",
        ],
    ),
    (
        3,
        [
            # Every index is rewritten by the writes that touch its columns, and a claim
            # is several writes: keep only the indexes a query needs. `state` serves the
            # purge too (it scans only retired rows); nothing looks workers up by owner
            # alone, nor claims by worker.
            "DROP INDEX workers_purge",
            "DROP INDEX workers_owner",
            "DROP INDEX claims_purge",
            "DROP INDEX claims_worker",
        ],
    ),
    (
        4,
        [
            # Counts by pool and org come from the live rows in memory; the one index left
            # finds rows by state (the live ones, a pool's warm or hot_idle ones to pick,
            # the retired ones to list or purge). Each index dropped is one page less
            # written by every state change: a claim + release cycle makes four.
            "DROP INDEX workers_pool_state",
            "DROP INDEX workers_pool_org",
            "DROP INDEX workers_state",
            "CREATE INDEX workers_live ON workers (state, pool, revision)",
        ],
    ),
    (
        5,
        [
            # Every worker write compares and bumps the row version (a CAS on the row).
            "ALTER TABLE workers ADD COLUMN version INTEGER NOT NULL DEFAULT 0",
        ],
    ),
]

#: Positions in a worker row (`WORKER_COLUMNS` order) that the live-row filters read.
_POOL, _REVISION, _STATE, _OWNER, _CREATED, _ORG = (
    WORKER_COLUMNS.index(c) for c in ("pool", "revision", "state", "owner", "created_at", "org")
)
_RETIRED = WorkerState.RETIRED.value


def _oldest_first(row: tuple[Any, ...]) -> tuple[Any, Any]:
    return row[_CREATED], row[0]


def _count_key(row: tuple[Any, ...]) -> tuple[str, str, str, bool]:
    return row[_POOL], row[_REVISION], row[_STATE], row[_ORG] is not None


def _bump(counter: Counter[Any], key: Any, n: int) -> None:
    """Add `n` to `counter[key]`, dropping the key when it reaches zero."""
    counter[key] += n
    if not counter[key]:
        del counter[key]


#: The oldest SQLite with `UPDATE ... RETURNING` (March 2021).
MIN_SQLITE = (3, 35, 0)
#: Decoded worker rows kept by one store (see `SqliteStore._worker`).
_DECODED_MAX = 20_000


class SqliteStore:
    """The Store port on one SQLite file (or `:memory:`)."""

    def __init__(self, path: str, *, busy_timeout_s: float = 5.0) -> None:
        self.path = path
        self._busy_timeout_s = busy_timeout_s
        self._db: sqlite3.Connection | None = None
        #: Workers decoded from rows, keyed by the whole row: a row that has not changed
        #: since the last read (most of them, pass after pass) is not decoded again.
        #: `Worker` is immutable, so sharing one between readers is safe.
        self._decoded: dict[tuple[Any, ...], Worker] = {}
        self._decoded_instances: dict[tuple[Any, ...], Instance] = {}
        #: The live worker rows by id, kept current by triggers on this connection's
        #: writes (see `_live_rows`); None until read, and after a write failed.
        self._live: dict[str, tuple[Any, ...]] | None = None
        #: The open transaction of this loop iteration's writes (see `_tx`), and the file
        #: it locks (None for a private in-memory database).
        self._batch: _Batch | None = None
        self._file = None if path in ("", ":memory:") else os.path.realpath(path)
        self._live_version = -1
        #: The same rows by state; how many per (pool, revision, state, bound), and per
        #: (pool, org) of the bound ones.
        self._by_state: dict[str, dict[str, tuple[Any, ...]]] = {}
        self._counts: Counter[tuple[str, str, str, bool]] = Counter()
        self._org_counts: Counter[tuple[str, str]] = Counter()

    # -- plumbing -------------------------------------------------------------------------

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError("store is not open")
        return self._db

    @contextmanager
    def _tx_now(self) -> Iterator[sqlite3.Connection]:
        """One write transaction committed at once: BEGIN IMMEDIATE ... COMMIT."""
        db = self.db
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise StoreError(f"sqlite: {exc}") from exc
        try:
            yield db
        except sqlite3.Error as exc:
            self._rollback(db)
            raise StoreError(f"sqlite: {exc}") from exc
        except BaseException:
            self._rollback(db)
            raise
        else:
            try:
                db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback(db)
                raise StoreError(f"sqlite: {exc}") from exc

    @asynccontextmanager
    async def _tx(self) -> AsyncIterator[sqlite3.Connection]:
        """One write, committed with the other writes of this loop iteration.

        The writes that callers make in one iteration of the event loop share one
        transaction, committed by a callback at the next iteration (group commit: a COMMIT
        of the WAL was a third of the store's time with one per write). Each write runs in a
        savepoint, so an error undoes only it, and its caller resumes only once the batch
        has committed: a write is durable before anybody acts on it, as before.
        """
        if self._file is None:
            # A private in-memory database (the simulator's): a COMMIT costs no I/O, and
            # each write committed on its own keeps callers free of the extra loop step.
            with self._tx_now() as db:
                yield db
            return
        db = self.db
        batch = self._batch or self._open_batch(db)
        committed = batch.join()
        try:
            db.execute("SAVEPOINT write")
            yield db
        except BaseException as exc:
            self._live = None
            committed.cancel()
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK TO write")
                db.execute("RELEASE write")
            self._check_batch(exc)
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"sqlite: {exc}") from exc
            raise
        db.execute("RELEASE write")
        await committed

    def _open_batch(self, db: sqlite3.Connection) -> _Batch:
        self._yield_write_lock()
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise StoreError(f"sqlite: {exc}") from exc
        loop = asyncio.get_running_loop()
        batch = self._batch = _Batch(loop)
        loop.call_soon(self._commit_batch)
        if self._file is not None:
            _BATCHES[(loop, self._file)] = self
        return batch

    def _yield_write_lock(self) -> None:
        """Commit the open batch of another store of this loop on the same file.

        Its commit waits for this loop's next iteration, and this thread waiting for the
        write lock would keep that iteration from coming: commit it first.
        """
        if self._file is None:
            return
        holder = _BATCHES.get((asyncio.get_running_loop(), self._file))
        if holder is not None and holder is not self:
            holder._commit_batch()

    async def _committed(self) -> None:
        """Wait for the open batch (if any) to commit."""
        if self._batch is not None:
            await self._batch.join()

    def _check_batch(self, exc: BaseException) -> None:
        """After a failed write: if SQLite undid the whole transaction (a full disk, an I/O
        error), the batch's other writes went with it; fail their callers now, so that no
        later write runs outside a transaction believing it is in the batch."""
        if self._batch is not None and self._db is not None and not self._db.in_transaction:
            batch = self._take_batch()
            if batch is not None:
                batch.settle(StoreError(f"sqlite: the transaction was undone: {exc}"))

    def _take_batch(self) -> _Batch | None:
        """The open batch, no longer open (None if there was none)."""
        batch, self._batch = self._batch, None
        if batch is not None and self._file is not None:
            key = (batch.loop, self._file)
            if _BATCHES.get(key) is self:
                del _BATCHES[key]
        return batch

    def _commit_batch(self) -> None:
        batch = self._take_batch()
        if batch is None or self._db is None:
            return
        try:
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback(self._db)
            batch.settle(StoreError(f"sqlite: {exc}"))
        else:
            batch.settle(None)

    def _rollback(self, db: sqlite3.Connection) -> None:
        # The triggers already applied the undone writes to the live rows: read them again.
        self._live = None
        _rollback(db)

    async def _write_one(self, sql: str, params: Sequence[Any] = ()) -> tuple[int, list[Any]]:
        """One statement, atomic on its own: inside the open batch if there is one (SQLite
        undoes a failed statement without the transaction around it), else without BEGIN
        and COMMIT. Returns how many rows it changed, and the rows it returned."""
        self._yield_write_lock()
        try:
            cursor = self.db.execute(sql, params)
            rows = cursor.fetchall()
        except sqlite3.Error as exc:
            self._live = None  # a failed statement is undone after its triggers ran
            self._check_batch(exc)
            raise StoreError(f"sqlite: {exc}") from exc
        await self._committed()
        return cursor.rowcount, rows

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        try:
            return self.db.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"sqlite: {exc}") from exc

    async def open(self) -> None:
        """Open the file, switch to WAL and apply migrations; a no-op when already open."""
        if self._db is not None:
            return
        if sqlite3.sqlite_version_info < MIN_SQLITE:
            raise StoreError(
                f"the sqlite store needs SQLite {'.'.join(map(str, MIN_SQLITE))} or newer "
                f"(UPDATE ... RETURNING); this Python has {sqlite3.sqlite_version}"
            )
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open sqlite store {self.path!r}: {exc}") from exc
        self._db = db
        try:
            db.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
            await self._switch_to_wal(db)
            db.execute("PRAGMA synchronous = NORMAL")
            with self._tx_now() as tx:
                tx.execute(
                    "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY)"
                )
                applied = {r[0] for r in tx.execute("SELECT version FROM schema_migrations")}
                for version, statements in MIGRATIONS:
                    if version in applied:
                        continue
                    for sql in statements:
                        tx.execute(sql)
                    tx.execute("INSERT INTO schema_migrations (version) VALUES (?)", (version,))
            self._watch_workers(db)
        except BaseException as exc:
            # A store that failed to open holds no connection: a retry starts afresh.
            self._db = None
            db.close()
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"cannot open sqlite store {self.path!r}: {exc}") from exc
            raise

    async def _switch_to_wal(self, db: sqlite3.Connection) -> None:
        """`PRAGMA journal_mode = WAL`, retried while another process opening the same new
        file holds it: SQLite answers "database is locked" at once there, without waiting
        out the busy timeout."""
        step = 0.01
        for _ in range(max(1, round(self._busy_timeout_s / step))):
            try:
                db.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc):
                    raise
            await asyncio.sleep(step)
        db.execute("PRAGMA journal_mode = WAL")  # the last try: its error is the answer

    async def close(self) -> None:
        """Close the connection (committing the open batch first)."""
        if self._db is not None:
            self._commit_batch()
            self._db.close()
            self._db = None
        self._live = None

    # -- live rows in memory ---------------------------------------------------------------

    def _watch_workers(self, db: sqlite3.Connection) -> None:
        """Temporary triggers hand every row this connection writes to `_live`."""
        db.create_function("stoker_worker_put", len(WORKER_COLUMNS), self._put_live)
        db.create_function("stoker_worker_drop", 1, self._drop_live)
        new = ", ".join(f"NEW.{c}" for c in WORKER_COLUMNS)
        for event in ("INSERT", "UPDATE"):
            db.execute(
                f"CREATE TEMP TRIGGER IF NOT EXISTS stoker_workers_{event.lower()} "
                f"AFTER {event} ON main.workers BEGIN SELECT stoker_worker_put({new}); END"
            )
        db.execute(
            "CREATE TEMP TRIGGER IF NOT EXISTS stoker_workers_delete AFTER DELETE ON "
            "main.workers BEGIN SELECT stoker_worker_drop(OLD.id); END"
        )

    def _put_live(self, *row: Any) -> None:
        if self._live is None:
            return
        self._drop_live(row[0])
        if row[_STATE] != _RETIRED:
            self._live[row[0]] = row
            self._by_state.setdefault(row[_STATE], {})[row[0]] = row
            self._count(row, 1)

    def _drop_live(self, worker_id: str) -> None:
        if self._live is None:
            return
        old = self._live.pop(worker_id, None)
        if old is not None:
            self._by_state.get(old[_STATE], {}).pop(worker_id, None)
            self._count(old, -1)

    def _count(self, row: tuple[Any, ...], n: int) -> None:
        """Add `n` to the counts `row` falls in."""
        _bump(self._counts, _count_key(row), n)
        if row[_ORG] is not None:
            _bump(self._org_counts, (row[_POOL], row[_ORG]), n)

    def _live_rows(self) -> dict[str, tuple[Any, ...]]:
        """Every live worker row, as `SELECT {WORKER_SELECT}` returns it.

        The janitor lists and counts the live fleet every pass; these come from memory.
        This connection's writes reach it through triggers (a failed write makes it read
        again); another connection's commit changes SQLite's data_version, which makes it
        read again too.
        """
        version = self._read("PRAGMA data_version")[0][0]
        if self._live is None or version != self._live_version:
            rows = self._read(f"SELECT {WORKER_SELECT} FROM workers WHERE state IN {LIVE_SQL}")
            self._live = {row[0]: tuple(row) for row in rows}
            self._by_state = {}
            self._counts, self._org_counts = Counter(), Counter()
            for row in self._live.values():
                self._by_state.setdefault(row[_STATE], {})[row[0]] = row
                self._count(row, 1)
            self._live_version = version
        return self._live

    async def schema_version(self) -> int:
        """The highest applied migration."""
        rows = self._read("SELECT COALESCE(MAX(version), 0) FROM schema_migrations")
        return int(rows[0][0])

    # -- workers --------------------------------------------------------------------------

    def _worker(self, row: tuple[Any, ...]) -> Worker:
        """`worker_from_row`, remembered for identical rows (bounded)."""
        worker = self._decoded.get(row)
        if worker is None:
            if len(self._decoded) >= _DECODED_MAX:
                self._decoded.clear()
            worker = self._decoded[row] = worker_from_row(row)
        return worker

    def _get(self, db: sqlite3.Connection, worker_id: str) -> Worker | None:
        row = db.execute(
            f"SELECT {WORKER_SELECT} FROM workers WHERE id = ?", (worker_id,)
        ).fetchone()
        return self._worker(row) if row else None

    def _count_live(self, pool: str, org: str | None = None) -> int:
        """Live workers of `pool` (bound to `org`), from the live rows.

        Called inside write transactions: holding the write lock, nobody else can commit
        between this count and the write it decides.
        """
        self._live_rows()
        if org is not None:
            return self._org_counts[(pool, org)]
        return sum(n for (of_pool, *_), n in self._counts.items() if of_pool == pool)

    async def reserve_spawn_slots(
        self, req: SpawnRequest, ids: Sequence[str], now: float
    ) -> SpawnResult:
        """Insert spawning rows within the caps and the target, in one transaction."""
        async with self._tx() as db:
            room, limited_by = spawn_room(
                req,
                len(ids),
                pool_live=self._count_live(req.pool) if req.pool_cap > 0 else 0,
                org_live=(
                    self._count_live(req.pool, req.org)
                    if req.org is not None and req.org_cap > 0
                    else 0
                ),
                neutral=(
                    self._count_neutral(req.pool, req.revision) if req.target is not None else 0
                ),
            )
            rows = spawning_workers(req, ids[:room], now)
            placeholders = ", ".join("?" for _ in WORKER_COLUMNS)
            db.executemany(
                f"INSERT INTO workers ({WORKER_SELECT}) VALUES ({placeholders})",
                [worker_to_row(w) for w in rows],
            )
            return SpawnResult(rows, limited_by)

    def _count_neutral(self, pool: str, revision: str) -> int:
        """Warm plus neutral (not yet bound) spawning workers of one pool revision."""
        self._live_rows()
        warm, spawning = WorkerState.WARM.value, WorkerState.SPAWNING.value
        counts = self._counts
        return (
            counts[(pool, revision, warm, False)]
            + counts[(pool, revision, warm, True)]
            + counts[(pool, revision, spawning, False)]
        )

    def _cas(
        self,
        db: sqlite3.Connection,
        current: Worker,
        *,
        to: WorkerState,
        now: float,
        bump_epoch: bool,
        changes: Mapping[str, Any],
    ) -> Worker | None:
        """Apply a checked transition to `current` (already read in this transaction),
        bumping its version."""
        changes = checked_changes(current, to, changes)
        new = current.evolve(
            state=to,
            epoch=current.epoch + 1 if bump_epoch else current.epoch,
            version=current.version + 1,
            updated_at=now,
            **changes,
        )
        sets = ["state = ?", "epoch = ?", "version = ?", "updated_at = ?"]
        params: list[Any] = [to.value, new.epoch, new.version, now]
        for name, value in changes.items():
            sets.append(f"{name} = ?")
            params.append(column_value(name, value))
        params += [current.id, current.version]
        cur = db.execute(
            f"UPDATE workers SET {', '.join(sets)} WHERE id = ? AND version = ?", params
        )
        return new if cur.rowcount == 1 else None

    async def transition(
        self,
        worker_id: str,
        *,
        expect: WorkerState,
        epoch: int,
        version: int,
        to: WorkerState,
        now: float,
        bump_epoch: bool = False,
        changes: Mapping[str, Any] | None = None,
    ) -> Worker | None:
        """CAS `(id, expect, epoch, version)` -> `to`; None on a miss."""
        # Illegal moves and unknown fields raise even when the row would not match.
        check_move(expect, to, changes or {})
        async with self._tx() as db:
            current = self._get(db, worker_id)
            if current is None or not matches(current, expect, epoch, version):
                return None
            return self._cas(
                db, current, to=to, now=now, bump_epoch=bump_epoch, changes=changes or {}
            )

    def _reserve_row(
        self,
        db: sqlite3.Connection,
        current: Worker,
        org: str,
        org_cap: int,
        owner: str,
        now: float,
        activate: bool,
    ) -> ReserveResult:
        if current.state is WorkerState.HOT_IDLE and current.org != org:
            return ReserveResult(None)
        if (
            current.state is WorkerState.WARM
            and org_cap > 0
            and self._count_live(current.pool, org) >= org_cap
        ):
            return ReserveResult(None, at_org_cap=True)
        worker = self._cas(
            db,
            current,
            to=WorkerState.RESERVED,
            now=now,
            bump_epoch=True,
            changes={"org": org, "owner": owner, "heartbeat_at": now},
        )
        if worker is not None and activate:
            # On to activating in the same transaction: one write less per claim.
            worker = self._cas(
                db,
                worker,
                to=WorkerState.ACTIVATING,
                now=now,
                bump_epoch=False,
                changes={"activated": True},
            )
        return ReserveResult(worker)

    async def reserve(
        self,
        worker_id: str,
        *,
        expect: WorkerState,
        epoch: int,
        version: int,
        org: str,
        org_cap: int,
        owner: str,
        now: float,
        activate: bool = False,
    ) -> ReserveResult:
        """CAS one warm or hot_idle worker to reserved for `org` (with `activate`, on to
        activating in the same transaction)."""
        check_reservable(expect)
        async with self._tx() as db:
            current = self._get(db, worker_id)
            if current is None or not matches(current, expect, epoch, version):
                return ReserveResult(None)
            return self._reserve_row(db, current, org, org_cap, owner, now, activate)

    async def reserve_any(
        self,
        pool: str,
        revision: str,
        *,
        expect: WorkerState,
        org: str,
        org_cap: int,
        owner: str,
        now: float,
        activate: bool = False,
    ) -> ReserveResult:
        """Reserve the oldest matching worker of the pool revision."""
        check_reservable(expect)
        if expect is WorkerState.HOT_IDLE:
            sql = (
                f"SELECT {WORKER_SELECT} FROM workers WHERE pool = ? AND revision = ? "
                "AND state = ? AND org = ? ORDER BY updated_at, id LIMIT 1"
            )
            params: tuple[str, ...] = (pool, revision, expect.value, org)
        else:
            sql = (
                f"SELECT {WORKER_SELECT} FROM workers WHERE pool = ? AND revision = ? "
                "AND state = ? ORDER BY updated_at, id LIMIT 1"
            )
            params = (pool, revision, expect.value)
        # Most calls find nothing (the queues in memory already had nothing): look in the
        # live rows' counts first, without taking the write lock, then pick inside the
        # write transaction.
        if not self._may_hold(pool, revision, expect, org):
            return ReserveResult(None)
        async with self._tx() as db:
            row = db.execute(sql, params).fetchone()
            if row is None:
                return ReserveResult(None)
            return self._reserve_row(db, self._worker(row), org, org_cap, owner, now, activate)

    def _may_hold(self, pool: str, revision: str, state: WorkerState, org: str) -> bool:
        """False when the live rows hold no worker of the pool revision in `state` (for
        hot_idle: none of the org's at all)."""
        self._live_rows()
        if state is WorkerState.HOT_IDLE and not self._org_counts[(pool, org)]:
            return False
        counts = self._counts
        return bool(
            counts[(pool, revision, state.value, False)]
            or counts[(pool, revision, state.value, True)]
        )

    async def get_worker(self, worker_id: str) -> Worker | None:
        """One worker row."""
        rows = self._read(f"SELECT {WORKER_SELECT} FROM workers WHERE id = ?", (worker_id,))
        return self._worker(rows[0]) if rows else None

    async def list_workers(
        self,
        *,
        pool: str | None = None,
        states: Collection[WorkerState] | None = None,
        org: str | None = None,
        owner: str | None = None,
        not_owners: Collection[str] | None = None,
        limit: int | None = None,
    ) -> list[Worker]:
        """Rows matching every filter, oldest first."""
        if states is not None and LIVE.issuperset(states):
            return self._list_live(states, pool, org, owner, not_owners, limit)
        where, params = _filters(
            pool=pool, org=org, owner=owner, states=states, not_owners=not_owners
        )
        sql = f"SELECT {WORKER_SELECT} FROM workers{where} ORDER BY created_at, id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [self._worker(r) for r in self._read(sql, params)]

    def _list_live(
        self,
        states: Collection[WorkerState],
        pool: str | None,
        org: str | None,
        owner: str | None,
        not_owners: Collection[str] | None,
        limit: int | None,
    ) -> list[Worker]:
        """`list_workers` of live states only, from the live rows in memory."""
        self._live_rows()
        excluded = set(not_owners or ())
        rows = sorted(
            (
                row
                for state in {s.value for s in states}
                for row in self._by_state.get(state, {}).values()
                if (pool is None or row[_POOL] == pool)
                and (org is None or row[_ORG] == org)
                and (owner is None or row[_OWNER] == owner)
                and row[_OWNER] not in excluded
            ),
            key=_oldest_first,
        )
        if limit is not None:
            rows = rows[: max(0, int(limit))]
        return [self._worker(r) for r in rows]

    async def count_workers(self) -> list[StateCount]:
        """Live workers grouped by pool, revision, state and binding (from the live rows)."""
        self._live_rows()
        return [
            StateCount(pool, revision, WorkerState(state), bound, n)
            for (pool, revision, state, bound), n in sorted(self._counts.items())
        ]

    # -- claims ---------------------------------------------------------------------------

    def _get_claim(self, db: sqlite3.Connection, claim_id: str) -> Claim | None:
        row = db.execute(f"SELECT {CLAIM_SELECT} FROM claims WHERE id = ?", (claim_id,)).fetchone()
        return claim_from_row(row) if row else None

    async def bind(
        self, worker_id: str, *, epoch: int, version: int, claim: Claim, now: float
    ) -> Worker | None:
        """activating -> hot and insert the claim, atomically."""
        check_claim_for(worker_id, epoch, claim)
        async with self._tx() as db:
            current = self._get(db, worker_id)
            if current is None or not matches(current, WorkerState.ACTIVATING, epoch, version):
                return None
            if current.org != claim.org:
                return None
            worker = self._cas(
                db,
                current,
                to=WorkerState.HOT,
                now=now,
                bump_epoch=False,
                changes={"claim_id": claim.id, "idle_since": None},
            )
            if worker is None:
                return None
            placeholders = ", ".join("?" for _ in claim_to_row(claim))
            db.execute(
                f"INSERT INTO claims ({CLAIM_SELECT}) VALUES ({placeholders})", claim_to_row(claim)
            )
            return worker

    async def end_claim(
        self,
        claim_id: str,
        *,
        state: ClaimState,
        worker_to: WorkerState,
        now: float,
        reason: str | None = None,
        worker_changes: Mapping[str, Any] | None = None,
    ) -> tuple[Claim, Worker] | None:
        """End a bound claim and move its hot worker, atomically."""
        if state is ClaimState.BOUND:
            raise ValueError("end_claim needs a final claim state")
        check_move(WorkerState.HOT, worker_to, worker_changes or {})
        async with self._tx() as db:
            claim = self._get_claim(db, claim_id)
            if claim is None or claim.state is not ClaimState.BOUND:
                return None
            current = self._get(db, claim.worker_id)
            if (
                current is None
                or current.state is not WorkerState.HOT
                or current.epoch != claim.worker_epoch
                or current.claim_id != claim.id
            ):
                return None
            changes = {"claim_id": None, **(worker_changes or {})}
            worker = self._cas(
                db, current, to=worker_to, now=now, bump_epoch=False, changes=changes
            )
            if worker is None:
                return None
            ended = claim.evolve(state=state, updated_at=now, ended_at=now, reason=reason)
            db.execute(
                "UPDATE claims SET state = ?, updated_at = ?, ended_at = ?, reason = ? "
                "WHERE id = ? AND state = ?",
                (state.value, now, now, reason, claim_id, ClaimState.BOUND.value),
            )
            return ended, worker

    async def renew_claim(self, claim_id: str, *, expires_at: float, now: float) -> Claim | None:
        """Extend a bound claim's lease (one statement: it returns the row it changed)."""
        _, rows = await self._write_one(
            "UPDATE claims SET expires_at = ?, updated_at = ? WHERE id = ? AND state = ? "
            f"RETURNING {CLAIM_SELECT}",
            (expires_at, now, claim_id, ClaimState.BOUND.value),
        )
        return claim_from_row(rows[0]) if rows else None

    async def get_claim(self, claim_id: str) -> Claim | None:
        """One claim."""
        rows = self._read(f"SELECT {CLAIM_SELECT} FROM claims WHERE id = ?", (claim_id,))
        return claim_from_row(rows[0]) if rows else None

    async def list_claims(
        self,
        *,
        states: Collection[ClaimState] | None = None,
        expires_before: float | None = None,
        owner: str | None = None,
        limit: int | None = None,
    ) -> list[Claim]:
        """Claims matching every filter, oldest first."""
        where, params = _filters(owner=owner, states=states)
        if expires_before is not None:
            where += (" AND" if where else " WHERE") + " expires_at <= ?"
            params.append(expires_before)
        sql = f"SELECT {CLAIM_SELECT} FROM claims{where} ORDER BY created_at, id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [claim_from_row(r) for r in self._read(sql, params)]

    # -- replicas and leases ----------------------------------------------------------------

    async def register_instance(
        self, instance_id: str, *, now: float, meta: Mapping[str, Any]
    ) -> None:
        """Insert an active replica."""
        async with self._tx() as db:
            db.execute(
                "INSERT INTO instances (id, started_at, heartbeat_at, state, meta) "
                "VALUES (?, ?, ?, 'active', ?)",
                (instance_id, now, now, dump_json(meta)),
            )

    async def heartbeat_instance(self, instance_id: str, *, now: float) -> bool:
        """Stamp the heartbeat of an active replica."""
        changed, _ = await self._write_one(
            "UPDATE instances SET heartbeat_at = ? WHERE id = ? AND state = 'active'",
            (now, instance_id),
        )
        return changed == 1

    async def expire_instances(
        self, *, before: float, now: float, keep: str | None = None
    ) -> list[str]:
        """Expire active replicas with a heartbeat older than `before`, except `keep`."""
        stale = (
            "SELECT id FROM instances WHERE state = 'active' AND heartbeat_at < ? "
            "AND id IS NOT ? ORDER BY started_at, id"
        )
        if not self._read(stale + " LIMIT 1", (before, keep)):
            return []  # the usual case: no write transaction at all
        async with self._tx() as db:
            ids = [r[0] for r in db.execute(stale, (before, keep))]
            db.executemany(
                "UPDATE instances SET state = 'expired' WHERE id = ? AND state = 'active'",
                [(i,) for i in ids],
            )
            return ids

    async def stop_instance(self, instance_id: str, *, now: float) -> None:
        """Mark a replica stopped."""
        async with self._tx() as db:
            db.execute(
                "UPDATE instances SET state = 'stopped', heartbeat_at = ? WHERE id = ?",
                (now, instance_id),
            )

    async def list_instances(self) -> list[Instance]:
        """All replicas."""
        rows = self._read(
            "SELECT id, started_at, heartbeat_at, state, meta FROM instances "
            "ORDER BY started_at, id"
        )
        # Every pass reads every replica; its JSON meta is decoded only when the row changed.
        decoded = self._decoded_instances
        if len(decoded) > 4 * len(rows) + 64:
            decoded.clear()
        out = []
        for row in rows:
            instance = decoded.get(row)
            if instance is None:
                instance = decoded[row] = instance_from_row(row)
            out.append(instance)
        return out

    async def acquire_lease(
        self, name: str, *, holder: str, now: float, duration_s: float
    ) -> LeaseRecord | None:
        """Take or renew the lease by CAS."""
        async with self._tx() as db:
            row = db.execute(
                "SELECT name, holder, epoch, renewed_at, duration_s FROM leases WHERE name = ?",
                (name,),
            ).fetchone()
            if row is None:
                lease = LeaseRecord(name, holder, 1, now, duration_s)
                db.execute(
                    "INSERT INTO leases (name, holder, epoch, renewed_at, duration_s) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (name, holder, 1, now, duration_s),
                )
                return lease
            current = lease_from_row(row)
            if current.holder == holder and not current.expired(now):
                lease = LeaseRecord(name, holder, current.epoch, now, duration_s)
            elif current.holder == "" or current.expired(now):
                lease = LeaseRecord(name, holder, current.epoch + 1, now, duration_s)
            else:
                return None
            cur = db.execute(
                "UPDATE leases SET holder = ?, epoch = ?, renewed_at = ?, duration_s = ? "
                "WHERE name = ? AND holder = ? AND epoch = ?",
                (holder, lease.epoch, now, duration_s, name, current.holder, current.epoch),
            )
            return lease if cur.rowcount == 1 else None

    async def release_lease(self, name: str, *, holder: str, now: float) -> bool:
        """Give the lease up if we hold it."""
        async with self._tx() as db:
            cur = db.execute(
                "UPDATE leases SET holder = '', renewed_at = ? WHERE name = ? AND holder = ?",
                (now, name, holder),
            )
            return cur.rowcount == 1

    async def get_lease(self, name: str) -> LeaseRecord | None:
        """The lease row."""
        rows = self._read(
            "SELECT name, holder, epoch, renewed_at, duration_s FROM leases WHERE name = ?", (name,)
        )
        return lease_from_row(rows[0]) if rows else None

    # -- demand and housekeeping -------------------------------------------------------------

    async def record_demand(
        self, instance_id: str, demand: Mapping[str, tuple[int, int]], *, now: float
    ) -> None:
        """Upsert this replica's demand rows."""
        sql = (
            "INSERT INTO demand (pool, instance, misses, waiting, updated_at) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT (pool, instance) DO UPDATE SET "
            "misses = excluded.misses, waiting = excluded.waiting, "
            "updated_at = excluded.updated_at"
        )
        rows = [(pool, instance_id, m, w, now) for pool, (m, w) in sorted(demand.items())]
        if len(rows) == 1:
            await self._write_one(sql, rows[0])
            return
        async with self._tx() as db:
            db.executemany(sql, rows)

    async def read_demand(self) -> list[DemandRecord]:
        """Every replica's demand rows."""
        rows = self._read(
            "SELECT pool, instance, misses, waiting, updated_at FROM demand ORDER BY pool, instance"
        )
        return [DemandRecord(p, i, int(m), int(w), float(u)) for p, i, m, w, u in rows]

    async def purge(self, *, before: float) -> int:
        """Delete terminal history older than `before`."""
        async with self._tx() as db:
            deleted = db.execute(
                "DELETE FROM workers WHERE state = 'retired' AND updated_at < ?", (before,)
            ).rowcount
            deleted += db.execute(
                "DELETE FROM claims WHERE state <> 'bound' AND updated_at < ?", (before,)
            ).rowcount
            deleted += db.execute(
                "DELETE FROM demand WHERE instance IN (SELECT id FROM instances "
                "WHERE state <> 'active' AND heartbeat_at < ?)",
                (before,),
            ).rowcount
            deleted += db.execute(
                "DELETE FROM instances WHERE state <> 'active' AND heartbeat_at < ?", (before,)
            ).rowcount
            return int(deleted)


#: The store holding an open batch on each file, per event loop (see `_yield_write_lock`);
#: stores of other threads and processes wait for the write lock as usual.
_BATCHES: dict[tuple[asyncio.AbstractEventLoop, str], SqliteStore] = {}


class _Batch:
    """The writers waiting for one open transaction to commit."""

    __slots__ = ("loop", "waiters")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waiters: list[asyncio.Future[None]] = []

    def join(self) -> asyncio.Future[None]:
        """A future of this writer's own, done when the batch has committed (a writer that
        is cancelled while it waits cancels only its own)."""
        waiter: asyncio.Future[None] = self.loop.create_future()
        self.waiters.append(waiter)
        return waiter

    def settle(self, error: StoreError | None) -> None:
        for waiter in self.waiters:
            if waiter.done():
                continue
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(error)


def _rollback(db: sqlite3.Connection) -> None:
    """Roll back what is left of a failed transaction.

    After some errors (a full disk, I/O) SQLite has already rolled back on its own, and a
    second ROLLBACK would raise and mask the error being reported.
    """
    if db.in_transaction:
        db.execute("ROLLBACK")


def _filters(
    *,
    pool: str | None = None,
    org: str | None = None,
    owner: str | None = None,
    states: Collection[Any] | None = None,
    not_owners: Collection[str] | None = None,
) -> tuple[str, list[Any]]:
    clauses: list[str] = []
    params: list[Any] = []
    for column, value in (("pool", pool), ("org", org), ("owner", owner)):
        if value is not None:
            clauses.append(f"{column} = ?")
            params.append(value)
    if not_owners:
        marks = ", ".join("?" for _ in not_owners)
        clauses.append(f"(owner IS NULL OR owner NOT IN ({marks}))")
        params += list(not_owners)
    if states is not None:
        values = [s.value for s in states]
        if not values:
            clauses.append("1 = 0")
        else:
            clauses.append(f"state IN ({', '.join('?' for _ in values)})")
            params += values
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), params
