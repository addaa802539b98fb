"""The live worker rows of one SQLite store, in memory, and the counts made from them.

The janitor lists and counts the live fleet every pass, and every spawn slot and warm
reservation counts the live workers of its pool and org inside its write transaction:
these answers come from memory, and so does the row a write reads by id before its
compare-and-set. Temporary triggers hand every row the store's connection writes to `put`
and `drop`; another connection's commit changes SQLite's `data_version`, and a write
SQLite undid (after its triggers ran) calls `forget`: either way the next read loads the
rows again. A private in-memory database (`:memory:`, the simulator's) has no other
connection: its rows, once read, skip the `data_version` check.

Rows are tuples in `WORKER_COLUMNS` order, as `SELECT {WORKER_SELECT}` returns them.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Collection, Iterable
from operator import itemgetter
from typing import Any

from stoker.adapters._rows import LIVE_SQL, WORKER_COLUMNS, WORKER_SELECT
from stoker.domain.errors import StoreError
from stoker.domain.states import WorkerState
from stoker.ports.store import StateCount

Row = tuple[Any, ...]

#: Positions in a worker row (`WORKER_COLUMNS` order) that the filters and counts read.
_POOL, _REVISION, _STATE, _OWNER, _CREATED, _ORG = (
    WORKER_COLUMNS.index(c) for c in ("pool", "revision", "state", "owner", "created_at", "org")
)
_RETIRED = WorkerState.RETIRED.value
_WARM, _SPAWNING = WorkerState.WARM.value, WorkerState.SPAWNING.value


#: A row's `(created_at, id)`: listings run oldest first (a C-level key: the janitor and
#: the ledger sort the fleet's rows with it every pass).
_oldest_first = itemgetter(_CREATED, 0)


def _count_key(row: Row) -> tuple[str, str, str, bool]:
    return row[_POOL], row[_REVISION], row[_STATE], row[_ORG] is not None


def _bump(counter: Counter[Any], key: Any, n: int) -> None:
    """Add `n` to `counter[key]`, dropping the key when it reaches zero (one look-up
    each way: every write of a row moves its counts twice)."""
    left = counter.get(key, 0) + n
    if left:
        counter[key] = left
    else:
        del counter[key]


class LiveRows:
    """Live worker rows by id and by state, with counts per (pool, revision, state, bound)
    and per (pool, org) of the bound ones."""

    def __init__(self, *, private: bool = False) -> None:
        """`private`: the database is the connection's own (`:memory:`): no other
        connection can change it, so the rows once read need no `data_version` check."""
        self._private = private
        self._db: sqlite3.Connection | None = None
        #: None until read, and after SQLite undid a write. Kept oldest first (by
        #: `(created_at, id)`, which a write never changes) while `_ordered`: a new row goes
        #: last, a written one stays where it is.
        self._rows: dict[str, Row] | None = None
        self._ordered = True
        #: The `(created_at, id)` of the newest row put last.
        self._newest: tuple[Any, Any] | None = None
        self._data_version = -1
        self._by_state: dict[str, dict[str, Row]] = {}
        self._counts: Counter[tuple[str, str, str, bool]] = Counter()
        self._org_counts: Counter[tuple[str, str]] = Counter()
        #: Rows per (state, owner): a select that leaves out some owners (the janitor's
        #: hot rows of dead replicas, most passes none) is answered without a scan.
        self._owner_counts: Counter[tuple[str, str]] = Counter()
        #: `state_counts` until a count changes (the janitor and the pool samples ask every
        #: pass; a quiet fleet's counts stay the same for many).
        self._state_counts: list[StateCount] | None = None

    def watch(self, db: sqlite3.Connection) -> None:
        """Install the triggers that hand every row `db` writes to this copy."""
        self._db = db
        db.create_function("stoker_worker_put", len(WORKER_COLUMNS), self.put)
        db.create_function("stoker_worker_drop", 1, self.drop)
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

    def close(self) -> None:
        """Stop reading from the connection (it is being closed)."""
        self._db = None
        self._rows = None

    def forget(self) -> None:
        """SQLite undid writes the triggers already reported: read every row again."""
        self._rows = None

    def put(self, *row: Any) -> None:
        """Trigger: a row was inserted or updated."""
        rows = self._rows
        if rows is None:
            return
        worker_id = row[0]
        old = rows.get(worker_id)
        if old is not None:
            self._by_state.get(old[_STATE], {}).pop(worker_id, None)
            self._count(old, -1)
        if row[_STATE] == _RETIRED:
            if old is not None:
                del rows[worker_id]
            return
        if old is None:
            key = _oldest_first(row)
            if self._newest is not None and key < self._newest:
                self._ordered = False  # older than a row already last: sorted when listed
            else:
                self._newest = key
        elif old[_CREATED] != row[_CREATED]:
            self._ordered = False
        rows[worker_id] = row
        self._by_state.setdefault(row[_STATE], {})[worker_id] = row
        self._count(row, 1)

    def drop(self, worker_id: str) -> None:
        """Trigger: a row was deleted (or is about to be replaced)."""
        if self._rows is None:
            return
        old = self._rows.pop(worker_id, None)
        if old is not None:
            self._by_state.get(old[_STATE], {}).pop(worker_id, None)
            self._count(old, -1)

    def _count(self, row: Row, n: int) -> None:
        """Add `n` to the counts `row` falls in."""
        self._state_counts = None
        _bump(self._counts, _count_key(row), n)
        _bump(self._owner_counts, (row[_STATE], row[_OWNER]), n)
        if row[_ORG] is not None:
            _bump(self._org_counts, (row[_POOL], row[_ORG]), n)

    def rows(self) -> dict[str, Row]:
        """Every live worker row by id, loaded again if another connection committed."""
        if self._private and self._rows is not None:
            return self._rows
        db = self._db
        if db is None:
            raise StoreError("store is not open")
        try:
            data_version = db.execute("PRAGMA data_version").fetchone()[0]
            if self._rows is not None and data_version == self._data_version:
                return self._rows
            loaded = db.execute(
                f"SELECT {WORKER_SELECT} FROM workers WHERE state IN {LIVE_SQL}"
            ).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"sqlite: {exc}") from exc
        rows = self._keep_ordered(tuple(row) for row in loaded)
        self._by_state = {}
        self._counts, self._org_counts, self._owner_counts = Counter(), Counter(), Counter()
        self._state_counts = None
        for row in rows.values():
            self._by_state.setdefault(row[_STATE], {})[row[0]] = row
            self._count(row, 1)
        self._data_version = data_version
        return rows

    def held(self, worker_id: str) -> Row | None:
        """The live row of `worker_id` as held now, without looking for other connections'
        commits: for a write that has just put it (None when not live, or not read yet)."""
        return None if self._rows is None else self._rows.get(worker_id)

    def _keep_ordered(self, rows: Iterable[Row]) -> dict[str, Row]:
        """Hold `rows`, oldest first; returns them by id."""
        ordered = sorted(rows, key=_oldest_first)
        self._rows = {row[0]: row for row in ordered}
        self._ordered = True
        self._newest = _oldest_first(ordered[-1]) if ordered else None
        return self._rows

    # -- answers ------------------------------------------------------------------------

    def row(self, worker_id: str) -> Row | None:
        """The live row of `worker_id`; None when it is retired or unknown."""
        return self.rows().get(worker_id)

    def count_live(self, pool: str, org: str | None = None) -> int:
        """Live workers of `pool` (bound to `org` if given).

        Called inside write transactions: holding the write lock, nobody else can commit
        between this count and the write it decides.
        """
        self.rows()
        if org is not None:
            return self._org_counts[(pool, org)]
        return sum(n for (of_pool, *_), n in self._counts.items() if of_pool == pool)

    def count_neutral(self, pool: str, revision: str) -> int:
        """Warm plus neutral (not yet bound) spawning workers of one pool revision."""
        self.rows()
        counts = self._counts
        return (
            counts[(pool, revision, _WARM, False)]
            + counts[(pool, revision, _WARM, True)]
            + counts[(pool, revision, _SPAWNING, False)]
        )

    def may_hold(self, pool: str, revision: str, state: WorkerState, org: str) -> bool:
        """False when no live worker of the pool revision is in `state` (for hot_idle: none
        of the org's at all)."""
        self.rows()
        if state is WorkerState.HOT_IDLE and not self._org_counts[(pool, org)]:
            return False
        counts = self._counts
        return bool(
            counts[(pool, revision, state.value, False)]
            or counts[(pool, revision, state.value, True)]
        )

    def state_counts(self) -> list[StateCount]:
        """Live workers grouped by pool, revision, state and binding."""
        self.rows()
        if self._state_counts is None:
            self._state_counts = [
                StateCount(pool, revision, WorkerState(state), bound, n)
                for (pool, revision, state, bound), n in sorted(self._counts.items())
            ]
        return list(self._state_counts)

    def select(
        self,
        states: Collection[WorkerState],
        *,
        pool: str | None = None,
        org: str | None = None,
        owner: str | None = None,
        not_owners: Collection[str] | None = None,
        after: tuple[float, str] | None = None,
        limit: int | None = None,
    ) -> list[Row]:
        """The live rows in `states` matching every filter given, oldest first (after
        `after`, a `(created_at, id)`, when given)."""
        live = self.rows()
        excluded = set(not_owners or ())
        values = {s.value for s in states}
        if excluded and not any(
            n
            for (state, of), n in self._owner_counts.items()
            if state in values and of not in excluded
        ):
            return []
        by_state = self._by_state
        # Most of the fleet (the ledger's and the stranded objects' listings): walked in
        # the rows' order; a few states (the janitor's idle rows): gathered, then sorted.
        walk = 2 * sum(len(by_state.get(state, ())) for state in values) >= len(live)
        if walk:
            if not self._ordered:
                live = self._keep_ordered(live.values())
            rows = [row for row in live.values() if row[_STATE] in values]
        else:
            rows = [row for state in values for row in by_state.get(state, {}).values()]
        # Only the filters given are applied (most listings give one or none).
        if pool is not None:
            rows = [row for row in rows if row[_POOL] == pool]
        if org is not None:
            rows = [row for row in rows if row[_ORG] == org]
        if owner is not None:
            rows = [row for row in rows if row[_OWNER] == owner]
        if excluded:
            rows = [row for row in rows if row[_OWNER] not in excluded]
        if after is not None:
            rows = [row for row in rows if _oldest_first(row) > after]
        if not walk:
            rows.sort(key=_oldest_first)
        if limit is not None:
            rows = rows[: max(0, int(limit))]
        return rows
