"""The bound on worker start-ups: at most `limit` processes of this runtime start at once.

A process "starts" from its fork until its `/healthz` first answers (or it fails, or it is
stopped, or it goes idle: a start-up that waits rather than computes gives its slot on).
Python workers spend most of that on CPU (imports), so a storm of start-ups on a machine
with few cores starves everything else, the control plane included, and pushes every
start-up past its spawn timeout. Beyond the bound, spawns wait in a queue, the ones
a claim waits for (cold spawns, bound to an org) ahead of neutral refills, first come
first served within each; a queued spawn has not started, so its spawn timeout has not
begun either. The gate measures how long a start-up holds its slot (an exponentially
weighted mean, `hold_s`): with `limit`, what a backtest of the pool replays its queue with.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os

from stoker.domain.errors import RuntimeFailure, SpawnWithdrawn
from stoker.ports.clock import Clock


def default_start_limit() -> int:
    """Start-ups at once by default: one per core this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores)


#: The weight of each new start-up in the mean hold (as the spawn-to-ready estimate's).
HOLD_WEIGHT = 0.2


class StartGate:
    """Counts the start-ups in progress and queues the ones beyond `limit`."""

    def __init__(self, limit: int, clock: Clock | None = None) -> None:
        self.limit = _at_least_one(limit)
        #: What measures how long a start-up holds its slot (none: nothing is measured).
        self._clock = clock
        #: Workers starting now (holding a slot).
        self._starting: set[str] = set()
        #: (rank, order, worker id): rank 0 for urgent starts, then first come.
        self._queue: list[tuple[int, int, str]] = []
        self._waiting: dict[str, asyncio.Future[None]] = {}
        #: Workers granted a slot whose `enter` has not returned yet (their spawn resumes on
        #: the loop's next turn): a stop in that moment must still keep them from starting.
        self._granted: set[str] = set()
        #: Granted workers withdrawn before their `enter` returned.
        self._revoked: set[str] = set()
        self._order = itertools.count()
        #: The most start-ups ever in progress at once (for tests and the status page).
        self.peak = 0
        #: When each start-up in progress took its slot (monotonic seconds).
        self._taken_at: dict[str, float] = {}
        #: The mean time a start-up held its slot (weight `HOLD_WEIGHT`); None before one
        #: gave it on.
        self.hold_s: float | None = None

    @property
    def starting(self) -> int:
        """Start-ups in progress."""
        return len(self._starting)

    @property
    def queued(self) -> int:
        """Spawns waiting for a slot."""
        return len(self._waiting)

    async def enter(self, worker_id: str, *, urgent: bool = False) -> None:
        """Take a start-up slot for `worker_id`, waiting in the queue while all are taken.

        Raises `SpawnWithdrawn` when `withdraw` (or `close`) removes it from the queue.
        """
        if worker_id in self._starting or worker_id in self._waiting:
            raise RuntimeFailure(f"worker {worker_id} is already starting")
        if len(self._starting) < self.limit and not self._waiting:
            self._take(worker_id)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[worker_id] = waiter
        heapq.heappush(self._queue, (0 if urgent else 1, next(self._order), worker_id))
        try:
            await waiter
        except asyncio.CancelledError:
            self._granted.discard(worker_id)
            self._revoked.discard(worker_id)
            if self._waiting.pop(worker_id, None) is None and worker_id in self._starting:
                # Granted just as the caller was cancelled: hand the slot on (no start-up
                # held it).
                self._taken_at.pop(worker_id, None)
                self.leave(worker_id)
            raise
        self._granted.discard(worker_id)
        if worker_id in self._revoked:
            # Withdrawn after the grant, before this spawn resumed: it must not start.
            self._revoked.discard(worker_id)
            self._taken_at.pop(worker_id, None)
            self.leave(worker_id)
            raise SpawnWithdrawn(f"worker {worker_id} was withdrawn before it started")

    def leave(self, worker_id: str) -> None:
        """`worker_id`'s start-up is over (ready, failed, stopped): the next one may start."""
        if worker_id not in self._starting:
            return
        self._starting.discard(worker_id)
        taken = self._taken_at.pop(worker_id, None)
        if taken is not None and self._clock is not None:
            held = max(0.0, self._clock.monotonic() - taken)
            last = self.hold_s
            self.hold_s = held if last is None else last + HOLD_WEIGHT * (held - last)
        self._grant()

    def withdraw(self, worker_id: str, why: str) -> bool:
        """Take a spawn that has not started out of the queue (or take back the slot it was
        just granted); False when it is neither queued nor granted (it started already)."""
        if worker_id in self._granted:
            self._granted.discard(worker_id)
            self._revoked.add(worker_id)
            return True
        waiter = self._waiting.pop(worker_id, None)
        if waiter is None:
            return False
        if not waiter.done():
            waiter.set_exception(SpawnWithdrawn(f"worker {worker_id} {why} before it started"))
        return True

    def close(self) -> None:
        """Withdraw every queued spawn (the runtime is closing)."""
        for worker_id in [*self._waiting, *self._granted]:
            self.withdraw(worker_id, "was withdrawn as the runtime closed")

    def _take(self, worker_id: str) -> None:
        self._starting.add(worker_id)
        if self._clock is not None:
            self._taken_at[worker_id] = self._clock.monotonic()
        self.peak = max(self.peak, len(self._starting))

    def _grant(self) -> None:
        """Hand free slots to the head of the queue (skipping withdrawn entries)."""
        while self._queue and len(self._starting) < self.limit:
            _rank, _order, worker_id = heapq.heappop(self._queue)
            waiter = self._waiting.pop(worker_id, None)
            if waiter is None or waiter.done():
                continue
            self._take(worker_id)
            self._granted.add(worker_id)
            waiter.set_result(None)


def _at_least_one(limit: int) -> int:
    if limit < 1:
        raise ValueError("the start-up limit must be at least 1")
    return limit
