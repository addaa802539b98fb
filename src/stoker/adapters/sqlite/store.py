"""SQLite store: the embedded default (`sqlite:///./stoker.db`).

One connection, used from the event loop without threads: the statements of one method
run with no `await` between them, so the writes of one process never interleave and the
loop's (possibly virtual) clock sees no hidden I/O. Writers from other processes are
serialised by `BEGIN IMMEDIATE`; WAL lets readers proceed meanwhile.

The parts: `schema` (tables and migrations), `batching` (group commit: the writes of one
loop iteration share one COMMIT), `live_rows` (the live workers in memory, fed by
triggers), `decoded` (records of unchanged rows), `workers` (the worker and claim rows:
reads, and writes that are each a compare-and-set), `replicas` (replicas, leases,
demand, purge) and `pools` (stored pools, on `stoker.adapters._pools`). This module
opens and closes the store.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3

from stoker.adapters._pools import PoolRows
from stoker.adapters.sqlite.batching import (
    LOOP_BUSY_MS,
    PROCESS_BATCHES,
    GroupCommit,
    OpenBatches,
)
from stoker.adapters.sqlite.decoded import DecodedRows
from stoker.adapters.sqlite.ledger import LedgerRows
from stoker.adapters.sqlite.live_rows import LiveRows
from stoker.adapters.sqlite.ownership import FileIdentity
from stoker.adapters.sqlite.pools import SqlitePoolHooks
from stoker.adapters.sqlite.replicas import ReplicaRows
from stoker.adapters.sqlite.schema import migrate
from stoker.adapters.sqlite.workers import WorkerRows
from stoker.domain.errors import StoreError

#: The oldest SQLite with `UPDATE ... RETURNING` (March 2021).
MIN_SQLITE = (3, 35, 0)


def keep_private(path: str) -> None:
    """Create the database file readable by its owner only (0600), and take group and other
    access away from an existing one and its WAL and shared-memory files.

    SQLite creates the WAL and shared-memory files with the database file's mode, so they
    follow. The store holds claims, org names and endpoints: nobody else on the machine
    needs to read them.
    """
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for name in (path, f"{path}-wal", f"{path}-shm"):
        try:
            mode = os.stat(name).st_mode & 0o777
        except FileNotFoundError:
            continue
        if mode & 0o077:
            os.chmod(name, mode & 0o700)


class SqliteStore(WorkerRows, ReplicaRows, LedgerRows, SqlitePoolHooks, PoolRows):
    """The Store port on one SQLite file (or `:memory:`)."""

    def __init__(
        self, path: str, *, busy_timeout_s: float = 5.0, batches: OpenBatches = PROCESS_BATCHES
    ) -> None:
        """`batches`: where the stores of one loop on one file find each other's open
        batch (shared by every store of the process unless given)."""
        self.path = path
        self._busy_timeout_s = busy_timeout_s
        file = None if path in ("", ":memory:") else os.path.realpath(path)
        self._live = LiveRows(private=file is None)
        self._decoded = DecodedRows()
        self._writes = GroupCommit(
            file, on_undo=self._live.forget, batches=batches, lock_wait_s=busy_timeout_s
        )
        self._identity: FileIdentity | None = None

    @property
    def db(self) -> sqlite3.Connection:
        """The open connection; StoreError when the store is not open."""
        return self._writes.conn

    async def open(self) -> None:
        """Open the file, switch to WAL and apply migrations; a no-op when already open."""
        if self._writes.db is not None:
            return
        if sqlite3.sqlite_version_info < MIN_SQLITE:
            raise StoreError(
                f"the sqlite store needs SQLite {'.'.join(map(str, MIN_SQLITE))} or newer "
                f"(UPDATE ... RETURNING); this Python has {sqlite3.sqlite_version}"
            )
        try:
            if self._writes.file is not None:
                keep_private(self._writes.file)
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except OSError as exc:
            raise StoreError(f"cannot open sqlite store {self.path!r}: {exc}") from exc
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open sqlite store {self.path!r}: {exc}") from exc
        self._writes.db = db
        try:
            db.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
            await self._switch_to_wal(db)
            db.execute("PRAGMA synchronous = NORMAL")
            with self._writes.tx_now() as tx:
                migrate(tx)
            # From now on the loop serves: SQLite's own wait for a lock holds it up for
            # LOOP_BUSY_MS at most, the rest of the wait is the loop's (see batching).
            db.execute(f"PRAGMA busy_timeout = {LOOP_BUSY_MS}")
            self._live.watch(db)
            if self._writes.file is not None:
                self._identity = FileIdentity.of(self._writes.file)
        except BaseException as exc:
            # A store that failed to open holds no connection: a retry starts afresh.
            self._writes.db = None
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
        db = self._writes.db
        if db is not None:
            self._writes.commit()
            db.close()
            self._writes.db = None
        self._live.close()

    async def schema_version(self) -> int:
        """The highest applied migration."""
        rows = self._writes.read("SELECT COALESCE(MAX(version), 0) FROM schema_migrations")
        return int(rows[0][0])
