"""Group commit on one SQLite connection: the writes made in one iteration of the event
loop share one transaction and one COMMIT.

A COMMIT of the WAL was a third of the store's time with one per write. Here the first
write of an iteration opens a transaction (`BEGIN IMMEDIATE`) and schedules its COMMIT for
the next iteration; each write runs in a savepoint, so an error undoes only that write, and
each writer resumes only once the batch has committed: a write is durable before anybody
acts on it. A private in-memory database (the simulator's) commits each write at once: a
COMMIT there costs no I/O, and callers are spared the extra loop step.

Nothing here knows the store's tables; the store is told through `on_undo` whenever SQLite
undid writes (a failed write, a rollback), since triggers may already have reported them.

The write lock is waited for without holding up the loop: SQLite's own busy handler waits
at most `LOOP_BUSY_MS` at a time (the connection's `busy_timeout`), and between tries the
writer sleeps on the loop, until `lock_wait_s` has passed; then the write fails with a
StoreError naming the lock. Another process holding the file's write lock for seconds
leaves `/healthz`, reads and everything else on the loop answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import Any

from stoker.domain.errors import StoreError

_Key = tuple[asyncio.AbstractEventLoop, str]

#: The longest SQLite's busy handler may hold the loop waiting for a lock, per try.
LOOP_BUSY_MS = 20
#: The loop's sleeps between tries for the write lock grow up to this.
_MAX_LOCK_SLEEP_S = 0.05


def is_busy(exc: sqlite3.Error) -> bool:
    """True when `exc` says another connection holds the lock (SQLITE_BUSY)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code == sqlite3.SQLITE_BUSY or (code is None and "database is locked" in str(exc))


async def sleep_between_tries(started: float, lock_wait_s: float, tries: int) -> bool:
    """Sleep before the next try for a lock; False (no sleep) once `lock_wait_s` passed
    since `started` (the loop's time, which the sleeps follow)."""
    if asyncio.get_running_loop().time() - started >= lock_wait_s:
        return False
    await asyncio.sleep(min(_MAX_LOCK_SLEEP_S, 0.005 * 2**tries))
    return True


class OpenBatches:
    """Which `GroupCommit` holds an open batch on each file, per event loop.

    A writer about to take a file's write lock first commits the open batch of another
    `GroupCommit` of the same loop and file: that batch's COMMIT waits for this loop's next
    iteration, which a thread waiting for the lock would keep from coming. Connections of
    other threads and processes wait for the lock as usual.
    """

    def __init__(self) -> None:
        self._holders: dict[_Key, GroupCommit] = {}

    def holder(self, key: _Key) -> GroupCommit | None:
        """The holder of an open batch on `key`'s file in `key`'s loop, if any."""
        return self._holders.get(key)

    def hold(self, key: _Key, commits: GroupCommit) -> None:
        """Record that `commits` opened a batch on `key`."""
        self._holders[key] = commits

    def release(self, key: _Key, commits: GroupCommit) -> None:
        """Forget `commits`'s batch on `key` (it committed or was undone)."""
        if self._holders.get(key) is commits:
            del self._holders[key]

    def __len__(self) -> int:
        return len(self._holders)


#: The registry every store of this process shares unless given one of its own: stores on
#: one file in one loop (several replicas in a test or the simulator) must see each other.
PROCESS_BATCHES = OpenBatches()


class Batch:
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
        """Resume every writer still waiting: committed, or failed with `error`."""
        for waiter in self.waiters:
            if waiter.done():
                continue
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(error)


class GroupCommit:
    """The connection of one store (`db`, set while it is open) and its write transactions.

    `file` is the database file's real path, or None for a private in-memory database.
    """

    def __init__(
        self,
        file: str | None,
        *,
        on_undo: Callable[[], None],
        batches: OpenBatches = PROCESS_BATCHES,
        lock_wait_s: float = 5.0,
    ) -> None:
        self.db: sqlite3.Connection | None = None
        self.file = file
        self._on_undo = on_undo
        self._batches = batches
        self.lock_wait_s = lock_wait_s
        #: The open transaction of this loop iteration's writes.
        self._batch: Batch | None = None
        #: Done when the writer trying to open the next batch got it (or gave up).
        self._opening: asyncio.Future[None] | None = None

    @property
    def conn(self) -> sqlite3.Connection:
        """The connection; StoreError once closed."""
        if self.db is None:
            raise StoreError("store is not open")
        return self.db

    def read(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> list[Any]:
        """The rows of one query (a read needs no transaction of its own)."""
        try:
            return self.conn.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"sqlite: {exc}") from exc

    def tx_now(self) -> TxNow:
        """One write transaction committed at once: BEGIN IMMEDIATE ... COMMIT."""
        return TxNow(self)

    def tx(self) -> AbstractAsyncContextManager[sqlite3.Connection]:
        """One write, committed with the other writes of this loop iteration (see the
        module docstring); the caller resumes once the batch has committed. A private
        in-memory database commits it at once (`tx_now`, used with `async with`)."""
        if self.file is None:
            return TxNow(self)
        return self._batched()

    def single_write(self) -> AbstractAsyncContextManager[sqlite3.Connection]:
        """A write of one statement (after reads): `tx`, except that a private in-memory
        database runs it without BEGIN and COMMIT (`SingleWrite`). The statement is atomic
        on its own, and no other connection can write between the reads and it."""
        if self.file is None:
            return SingleWrite(self)
        return self._batched()

    @asynccontextmanager
    async def _batched(self) -> AsyncIterator[sqlite3.Connection]:
        """`tx` on a file: a savepoint in the open batch."""
        db = self.conn
        batch = self._batch or await self._open_batch(db)
        committed = batch.join()
        try:
            db.execute("SAVEPOINT write")
            yield db
        except BaseException as exc:
            self._on_undo()
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

    async def write_one(self, sql: str, params: Sequence[Any] = ()) -> tuple[int, list[Any]]:
        """One statement, atomic on its own: inside the open batch if there is one (SQLite
        undoes a failed statement without the transaction around it), else without BEGIN
        and COMMIT. Returns how many rows it changed, and the rows it returned."""
        self.yield_write_lock()
        started, tries = asyncio.get_running_loop().time(), 0
        while True:
            try:
                cursor = self.conn.execute(sql, params)
                rows = cursor.fetchall()
                break
            except sqlite3.Error as exc:
                if (
                    self._batch is None
                    and is_busy(exc)
                    and await sleep_between_tries(started, self.lock_wait_s, tries)
                ):
                    # Another process holds the write lock: nothing ran, try again.
                    tries += 1
                    self.yield_write_lock()
                    continue
                self._on_undo()  # a failed statement is undone after its triggers ran
                self._check_batch(exc)
                raise StoreError(f"sqlite: {_locked(exc, self.lock_wait_s)}") from exc
        if self._batch is not None:
            await self._batch.join()
        return cursor.rowcount, rows

    def yield_write_lock(self) -> None:
        """Commit the open batch of another `GroupCommit` of this loop on the same file.

        Its commit waits for this loop's next iteration, and this thread waiting for the
        write lock would keep that iteration from coming: commit it first.
        """
        if self.file is None:
            return
        holder = self._batches.holder((asyncio.get_running_loop(), self.file))
        if holder is not None and holder is not self:
            holder.commit()

    def commit(self) -> None:
        """Commit the open batch now (if any) and resume its writers."""
        batch = self._take_batch()
        if batch is None or self.db is None:
            return
        try:
            self.db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback(self.db)
            batch.settle(StoreError(f"sqlite: {exc}"))
        else:
            batch.settle(None)

    async def _open_batch(self, db: sqlite3.Connection) -> Batch:
        """The open batch, opened now (BEGIN IMMEDIATE) unless another writer of this
        store opens it meanwhile; the write lock is waited for on the loop."""
        while self._opening is not None:
            # Another writer waits for the write lock: its batch will do for this one too.
            await asyncio.shield(self._opening)
            if self._batch is not None:
                return self._batch
        loop = asyncio.get_running_loop()
        opening = self._opening = loop.create_future()
        try:
            await self._begin(db)
        finally:
            self._opening = None
            opening.set_result(None)
        batch = self._batch = Batch(loop)
        loop.call_soon(self.commit)
        if self.file is not None:
            self._batches.hold((loop, self.file), self)
        return batch

    async def _begin(self, db: sqlite3.Connection) -> None:
        """BEGIN IMMEDIATE, trying again while another process holds the write lock."""
        started, tries = asyncio.get_running_loop().time(), 0
        while True:
            self.yield_write_lock()
            try:
                db.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.Error as exc:
                if is_busy(exc) and await sleep_between_tries(started, self.lock_wait_s, tries):
                    tries += 1
                    continue
                raise StoreError(f"sqlite: {_locked(exc, self.lock_wait_s)}") from exc

    def _check_batch(self, exc: BaseException) -> None:
        """After a failed write: if SQLite undid the whole transaction (a full disk, an I/O
        error), the batch's other writes went with it; fail their callers now, so that no
        later write runs outside a transaction believing it is in the batch."""
        if self._batch is not None and self.db is not None and not self.db.in_transaction:
            batch = self._take_batch()
            if batch is not None:
                batch.settle(StoreError(f"sqlite: the transaction was undone: {exc}"))

    def _take_batch(self) -> Batch | None:
        """The open batch, no longer open (None if there was none)."""
        batch, self._batch = self._batch, None
        if batch is not None and self.file is not None:
            self._batches.release((batch.loop, self.file), self)
        return batch

    def _rollback(self, db: sqlite3.Connection) -> None:
        # Triggers already reported the undone writes: the store must read them again.
        self._on_undo()
        rollback(db)


class TxNow:
    """`GroupCommit.tx_now`: BEGIN IMMEDIATE on entry; COMMIT on a clean exit, else
    ROLLBACK (an SQLite error raised as StoreError). A class rather than a generator: a
    simulated claim makes about five of these, and a generator-based context manager (two
    of them for `tx`) cost several times the BEGIN and COMMIT themselves. It serves
    `with` and, for `tx`, `async with`."""

    __slots__ = ("_commits", "_db")

    def __init__(self, commits: GroupCommit) -> None:
        self._commits = commits
        self._db: sqlite3.Connection | None = None

    def __enter__(self) -> sqlite3.Connection:
        db = self._commits.conn
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise StoreError(f"sqlite: {exc}") from exc
        self._db = db
        return db

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        db, self._db = self._db, None
        if db is None:  # never entered
            return
        if exc_type is None:
            try:
                db.execute("COMMIT")
            except sqlite3.Error as error:
                self._commits._rollback(db)
                raise StoreError(f"sqlite: {error}") from error
            return
        self._commits._rollback(db)
        if isinstance(exc, sqlite3.Error):
            raise StoreError(f"sqlite: {exc}") from exc

    async def __aenter__(self) -> sqlite3.Connection:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)


class SingleWrite:
    """`GroupCommit.single_write` on a private in-memory database: the connection as it is,
    in autocommit (each statement its own transaction). A simulated claim makes about five
    writes, most of them one statement each: their BEGIN and COMMIT were a third of the
    statements run. An error is handled as `TxNow` handles it (the store reads its rows
    again; an SQLite error raised as StoreError), with nothing left to roll back."""

    __slots__ = ("_commits", "_db")

    def __init__(self, commits: GroupCommit) -> None:
        self._commits = commits
        self._db: sqlite3.Connection | None = None

    async def __aenter__(self) -> sqlite3.Connection:
        self._db = self._commits.conn
        return self._db

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        db, self._db = self._db, None
        if exc_type is None or db is None:
            return
        self._commits._rollback(db)
        if isinstance(exc, sqlite3.Error):
            raise StoreError(f"sqlite: {exc}") from exc


def _locked(exc: sqlite3.Error, lock_wait_s: float) -> str:
    """The error's text, saying how long the write lock was waited for when it is that."""
    if is_busy(exc):
        return f"{exc} (another process held the write lock for {lock_wait_s:g}s)"
    return str(exc)


def rollback(db: sqlite3.Connection) -> None:
    """Roll back what is left of a failed transaction.

    After some errors (a full disk, I/O) SQLite has already rolled back on its own, and a
    second ROLLBACK would raise and mask the error being reported.
    """
    if db.in_transaction:
        db.execute("ROLLBACK")
