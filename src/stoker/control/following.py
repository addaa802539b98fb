"""Following the store's worker feed: what other replicas make claimable reaches this
replica's book (`heard`) as it happens, so its claims take those workers by one
compare-and-set instead of a scan of the store.

Each time the feed is listening again (at start and after a lost connection), the
claimable rows are read from the store once, for what was missed while it was not; until
then, and while the connection is down, claims fall back to the scan.
"""

from __future__ import annotations

from stoker.control import logs
from stoker.control.book import Book
from stoker.domain.errors import StoreError
from stoker.domain.states import WorkerState
from stoker.ports.store import StoreReader, WorkerFeed

#: What the feed announces (PostgreSQL's: workers that become warm).
_CLAIMABLE = (WorkerState.WARM,)


class Follower:
    """Feeds the book from the store's worker feed (a store that has one)."""

    def __init__(self, book: Book, reader: StoreReader) -> None:
        self._book = book
        self._reader = reader

    async def run(self, feed: WorkerFeed) -> None:
        """Follow until cancelled (the feed reconnects by itself)."""
        await feed.follow_workers(self._book.heard_worker, self._resync, self._lost)

    async def _resync(self) -> None:
        """Listening (again): replace what was heard with the store's claimable rows."""
        self._book.heard.clear()
        try:
            rows = await self._reader.list_workers(states=_CLAIMABLE)
        except StoreError as exc:
            logs.event("store_feed_resync_failed", error=str(exc), level=logs.WARNING)
            return
        for worker in rows:
            self._book.heard_worker(worker)
        self._book.feed_live = True

    def _lost(self) -> None:
        """The feed's connection is down: what was heard may be stale from now on."""
        self._book.feed_live = False
