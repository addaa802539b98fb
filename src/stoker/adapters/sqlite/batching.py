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
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from stoker.domain.errors import StoreError

_Key = tuple[asyncio.AbstractEventLoop, str]


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
    ) -> None:
        self.db: sqlite3.Connection | None = None
        self.file = file
        self._on_undo = on_undo
        self._batches = batches
        #: The open transaction of this loop iteration's writes.
        self._batch: Batch | None = None

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

    @contextmanager
    def tx_now(self) -> Iterator[sqlite3.Connection]:
        """One write transaction committed at once: BEGIN IMMEDIATE ... COMMIT."""
        db = self.conn
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
    async def tx(self) -> AsyncIterator[sqlite3.Connection]:
        """One write, committed with the other writes of this loop iteration (see the
        module docstring); the caller resumes once the batch has committed."""
        if self.file is None:
            with self.tx_now() as db:
                yield db
            return
        db = self.conn
        batch = self._batch or self._open_batch(db)
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
        try:
            cursor = self.conn.execute(sql, params)
            rows = cursor.fetchall()
        except sqlite3.Error as exc:
            self._on_undo()  # a failed statement is undone after its triggers ran
            self._check_batch(exc)
            raise StoreError(f"sqlite: {exc}") from exc
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

    def _open_batch(self, db: sqlite3.Connection) -> Batch:
        self.yield_write_lock()
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise StoreError(f"sqlite: {exc}") from exc
        loop = asyncio.get_running_loop()
        batch = self._batch = Batch(loop)
        loop.call_soon(self.commit)
        if self.file is not None:
            self._batches.hold((loop, self.file), self)
        return batch

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


def rollback(db: sqlite3.Connection) -> None:
    """Roll back what is left of a failed transaction.

    After some errors (a full disk, I/O) SQLite has already rolled back on its own, and a
    second ROLLBACK would raise and mask the error being reported.
    """
    if db.in_transaction:
        db.execute("ROLLBACK")
