"""Following the store's worker feed: a worker another replica makes claimable wakes a
claim of this replica that waits for one, at once, instead of at its deadline.

The woken claim reserves a worker from the store as before (one round trip, `FOR UPDATE
SKIP LOCKED`): measured on three replicas, taking the announced workers by their id made
replicas collide on rows others had taken (each collision a wasted round trip), where the
store's pick never does. Each time the feed is listening again (at start and after a lost
connection), the warm rows are read once, so a claim that waited through the outage wakes.
"""

from __future__ import annotations

from stoker.control import logs
from stoker.control.book import Book
from stoker.domain.errors import StoreError
from stoker.domain.states import WorkerState
from stoker.ports.store import StoreReader, WorkerFeed


class Follower:
    """Feeds the book from the store's worker feed (a store that has one)."""

    def __init__(self, book: Book, reader: StoreReader) -> None:
        self._book = book
        self._reader = reader

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


def _lost() -> None:
    """The feed's connection is down: claims wait for their deadline or a local offer
    until it listens again (the feed logs the loss)."""
