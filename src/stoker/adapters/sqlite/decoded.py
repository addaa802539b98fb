"""Records decoded from SQLite rows, kept for rows that have not changed.

Most rows read pass after pass are the same as last time: a `Worker` (or `Instance`) is
immutable, so the one decoded then serves every reader now, and decoding its JSON again is
saved. A live worker's row comes from the live rows in memory as the same tuple until it
changes: that tuple is recognised by its id and identity, without hashing its twenty
columns (the janitor, the ledger and every write read the fleet's rows this way). And a
compare-and-set's own record of the row it wrote serves as that row's decoding when every
value it wrote reads back as itself (`reads_back`): the claim's next step, and the next
pass, read the row without decoding it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from stoker.adapters._rows import instance_from_row, worker_from_row
from stoker.adapters._schema import WORKERS, Kind
from stoker.domain.records import Instance, Worker
from stoker.domain.states import WorkerState

#: Decoded worker rows kept at most (then the memo starts afresh).
WORKERS_MAX = 20_000

#: The Python type a value of each kind of column reads back as (`worker_from_row`); a
#: JSON object reads back as a copy, sorted, so it never counts as read back.
_READS_AS: Mapping[Kind, type] = {Kind.TEXT: str, Kind.INT: int, Kind.REAL: float, Kind.FLAG: bool}
#: Each worker column: the type its values read back as (None: none does), and whether
#: it may be NULL.
_WORKER_COLUMNS: Mapping[str, tuple[type | None, bool]] = {
    column.name: (_READS_AS.get(column.kind), column.nullable) for column in WORKERS.columns
}


def reads_back(name: str, value: Any) -> bool:
    """Whether `value`, written to the worker column `name`, reads back as the very same
    value of the same type: None where NULL is allowed, an exact `str`, `int` or `bool`,
    a `float` SQLite keeps (`keeps_float`)."""
    kind, nullable = _WORKER_COLUMNS[name]
    if value is None:
        return nullable
    if type(value) is not kind:
        return False
    return not isinstance(value, float) or keeps_float(value)


def keeps_float(value: float) -> bool:
    """Not NaN (SQLite stores it as NULL), nor -0.0 (read back as 0.0)."""
    return value == value and (value != 0.0 or math.copysign(1.0, value) > 0)


class DecodedRows:
    """Workers and replicas decoded from rows, keyed by the whole row; a worker also by
    its id, with the row object it was last decoded from."""

    def __init__(self, *, workers_max: int = WORKERS_MAX) -> None:
        self._workers: dict[tuple[Any, ...], Worker] = {}
        #: Worker id -> (the row object last decoded for it, its `Worker`).
        self._by_id: dict[str, tuple[tuple[Any, ...], Worker]] = {}
        self._instances: dict[tuple[Any, ...], Instance] = {}
        self._workers_max = workers_max

    def worker(self, row: tuple[Any, ...]) -> Worker:
        """`worker_from_row`, remembered for identical rows (the very same row object is
        found by its id, without hashing it)."""
        known = self._by_id.get(row[0])
        if known is not None and known[0] is row:
            return known[1]
        worker = self._workers.get(row)
        if worker is None:
            if len(self._workers) >= self._workers_max:
                self._workers.clear()
                self._by_id.clear()
            worker = self._workers[row] = worker_from_row(row)
        self._by_id[row[0]] = (row, worker)
        return worker

    def workers(self, rows: Sequence[tuple[Any, ...]]) -> list[Worker]:
        """`worker` of each row, in one loop (a listing of the live fleet: each row is the
        live rows' own object, found by its id)."""
        by_id, decode = self._by_id, self.worker
        out = []
        for row in rows:
            known = by_id.get(row[0])
            out.append(known[1] if known is not None and known[0] is row else decode(row))
        return out

    def written(self, row: tuple[Any, ...], worker: Worker, changes: Mapping[str, Any]) -> None:
        """A compare-and-set wrote `row` (as the live rows hold it) and made `worker` of it:
        from the row it moved (a decoded one, or one taken here), the state, epoch, version,
        `updated_at` and `changes` written. Taken as the row's decoding when all of those
        read back as written; else the row is decoded when it is read."""
        if (
            type(worker.state) is not WorkerState
            or type(worker.epoch) is not int
            or type(worker.version) is not int
            or type(worker.updated_at) is not float
            or not keeps_float(worker.updated_at)
        ):
            return
        for name, value in changes.items():
            if not reads_back(name, value):
                return
        if len(self._by_id) >= self._workers_max:
            self._by_id.clear()
        self._by_id[row[0]] = (row, worker)

    def instances(self, rows: Sequence[tuple[Any, ...]]) -> list[Instance]:
        """`instance_from_row` of each row; only a changed row's JSON is decoded again."""
        decoded = self._instances
        if len(decoded) > 4 * len(rows) + 64:
            decoded.clear()
        out = []
        for row in rows:
            instance = decoded.get(row)
            if instance is None:
                instance = decoded[row] = instance_from_row(row)
            out.append(instance)
        return out
