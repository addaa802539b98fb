"""Records decoded from SQLite rows, kept for rows that have not changed.

Most rows read pass after pass are the same as last time: a `Worker` (or `Instance`) is
immutable, so the one decoded then serves every reader now, and decoding its JSON again is
saved. A live worker's row comes from the live rows in memory as the same tuple until it
changes: that tuple is recognised by its id and identity, without hashing its twenty
columns (the janitor, the ledger and every write read the fleet's rows this way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stoker.adapters._rows import instance_from_row, worker_from_row
from stoker.domain.records import Instance, Worker

#: Decoded worker rows kept at most (then the memo starts afresh).
WORKERS_MAX = 20_000


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
