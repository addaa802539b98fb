"""Following the store's worker feed: a worker another replica makes claimable wakes a
claim of this replica that waits for one, at once, instead of at its deadline.

The woken claim reserves a worker from the store as before (one round trip, `FOR UPDATE
SKIP LOCKED`): measured on three replicas, taking the announced workers by their id made
replicas collide on rows others had taken (each collision a wasted round trip), where the
store's pick never does. Each time the feed is listening again (at start and after a lost
connection), the warm rows are read once, so a claim that waited through the outage wakes.

Beside the feed, and in its place on a store with none (SQLite), an offer pass: every
`OFFER_INTERVAL_S`, while claims of this replica wait for a warm worker, one read of the
store's counts wakes as many of them as their pool has warm workers at a serving
revision, whichever replica owns those. It catches what no event announces to a waiting
claim: a worker another replica made ready without a feed, one announced while the feed
was down, or one that got ready while the claim was on its way to wait (between its
reservation that found nothing and its registration as a waiter). One read per pass,
however many claims wait; a claim that lost the worker to another waits again.
"""

from __future__ import annotations

import contextlib
from collections import Counter

from stoker.control import logs
from stoker.control.book import Book
from stoker.control.rollouts import Rollouts
from stoker.domain.errors import StoreError
from stoker.domain.states import WorkerState
from stoker.ports.clock import Clock
from stoker.ports.store import StoreReader, WorkerFeed

#: How often a replica with waiting claims offers them the store's warm workers: a claim
#: no event woke waits at most this long beside a ready worker (a cold start takes
#: seconds), for at most four reads of the counts a second.
OFFER_INTERVAL_S = 0.25


class Follower:
    """Feeds the book from the store's worker feed and from offer passes."""

    def __init__(self, book: Book, reader: StoreReader, rollouts: Rollouts) -> None:
        self._book = book
        self._reader = reader
        self._rollouts = rollouts

    async def run(self, feed: WorkerFeed) -> None:
        """Follow until cancelled (the feed reconnects by itself)."""
        await feed.follow_workers(self._book.heard_worker, self._resync, _lost)

    async def _resync(self) -> None:
        """Listening (again): what became warm meanwhile wakes the claims that wait."""
        try:
            rows = await self._reader.list_workers(states=(WorkerState.WARM,))
        except StoreError as exc:
            logs.event("store_feed_resync_failed", error=str(exc), level=logs.WARNING)
            return
        for worker in rows:
            self._book.heard_worker(worker)

    async def offer_every(self, clock: Clock) -> None:
        """Offer passes until cancelled; a pass the store fails is skipped (the heartbeat
        reports a failing store)."""
        while True:
            # No timer runs while no claim waits: a long quiet run costs nothing.
            await self._book.until_warm_waiter()
            await clock.sleep(OFFER_INTERVAL_S)
            with contextlib.suppress(StoreError):
                await self.offer()

    async def offer(self) -> None:
        """One offer pass (see the module docstring); no read while no claim of this
        replica waits for a warm worker."""
        book = self._book
        pools = book.warm_waiting_pools()
        if not pools:
            return
        serving = {pool: set(self._rollouts.serving_revisions(pool)) for pool in pools}
        warm: Counter[str] = Counter()
        for count in await self._reader.count_workers():
            if count.state is WorkerState.WARM and count.revision in serving.get(count.pool, ()):
                warm[count.pool] += count.count
        for pool, ready in warm.items():
            book.offer_stored(pool, ready)


def _lost() -> None:
    """The feed's connection is down: claims wait for the offer passes, their own spawns
    or their deadline until it listens again (the feed logs the loss)."""
