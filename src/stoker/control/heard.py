"""Workers other replicas made claimable, as the store's change feed tells this replica.

On a store that announces its worker changes (PostgreSQL: LISTEN/NOTIFY), every replica
hears of each worker that becomes `warm` anywhere (`hot_idle` too, on a feed that
announces it). A replica whose own
queues ran dry takes the next worker it heard of by a compare-and-set on that row (one
round trip, the same as its own queue's), instead of a scan of the store. Each replica
takes the heard workers in an order of its own (stripes picked by a hash of the worker
and the replica), so that replicas draining the same workers at once rarely try the same
row.

Like the book's queues these are hints: a stale entry (a worker another replica took
since) costs one missed CAS. An entry leaves when a claim takes it or the worker is heard
of again; the whole is bounded (`LIMIT`: beyond it, what was heard is dropped, and claims
fall back to the scan until the feed tells of new workers).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict

from stoker.domain.records import Worker
from stoker.domain.states import WorkerState

#: Stripes per queue: each replica fills and drains them in an order of its own.
_STRIPES = 8
#: The most heard workers kept.
LIMIT = 50_000


class _Queue:
    """Workers of one key, in `_STRIPES` ordered sets."""

    __slots__ = ("cursor", "size", "stripes")

    def __init__(self) -> None:
        self.stripes: list[OrderedDict[str, Worker]] = [OrderedDict() for _ in range(_STRIPES)]
        self.cursor = 0
        self.size = 0


class HeardWorkers:
    """Claimable workers owned by other replicas, by (pool, revision) when warm and by
    (pool, org) when hot_idle."""

    def __init__(self, instance_id: str) -> None:
        self._instance = instance_id.encode()
        self._queues: dict[tuple[WorkerState, str, str], _Queue] = {}
        #: Where each heard worker is queued: its key and stripe.
        self._where: dict[str, tuple[tuple[WorkerState, str, str], int]] = {}

    def _key(self, worker: Worker) -> tuple[WorkerState, str, str] | None:
        if worker.state is WorkerState.WARM:
            return WorkerState.WARM, worker.pool, worker.revision
        if worker.state is WorkerState.HOT_IDLE and worker.org is not None:
            return WorkerState.HOT_IDLE, worker.pool, worker.org
        return None

    def heard(self, worker: Worker) -> bool:
        """Record a worker as the feed told it (latest version wins); True when it is now
        queued as claimable."""
        where = self._where.get(worker.id)
        if where is not None:
            key, stripe = where
            queue = self._queues[key]
            old = queue.stripes[stripe].get(worker.id)
            if old is not None and old.version >= worker.version:
                return False  # an older event of the same worker
            self.discard(worker.id)
        found = self._key(worker)
        if found is None:
            return False
        if len(self._where) >= LIMIT:
            self.clear()
        stripe = zlib.crc32(worker.id.encode() + self._instance) % _STRIPES
        into = self._queues.get(found)
        if into is None:
            into = self._queues[found] = _Queue()
        into.stripes[stripe][worker.id] = worker
        into.size += 1
        self._where[worker.id] = (found, stripe)
        return True

    def discard(self, worker_id: str) -> None:
        """Forget a worker (taken, or heard to have left its state)."""
        where = self._where.pop(worker_id, None)
        if where is None:
            return
        key, stripe = where
        queue = self._queues[key]
        if queue.stripes[stripe].pop(worker_id, None) is not None:
            queue.size -= 1
        if not queue.size:
            del self._queues[key]

    def pop(self, state: WorkerState, pool: str, key: str) -> Worker | None:
        """The next heard worker of (`state`, `pool`, revision or org `key`), taken out."""
        queue = self._queues.get((state, pool, key))
        if queue is None:
            return None
        for _ in range(_STRIPES):
            stripe = queue.stripes[queue.cursor]
            queue.cursor = (queue.cursor + 1) % _STRIPES
            if stripe:
                worker_id, worker = stripe.popitem(last=False)
                self._where.pop(worker_id, None)
                queue.size -= 1
                if not queue.size:
                    del self._queues[(state, pool, key)]
                return worker
        return None

    def clear(self) -> None:
        """Forget everything (the feed reconnects and reads the store again)."""
        self._queues.clear()
        self._where.clear()

    def size(self) -> int:
        """Workers heard of and queued."""
        return len(self._where)
