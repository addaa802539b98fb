"""The demand signal: misses counted in time buckets (pure; the caller passes the time)."""

from __future__ import annotations

from collections import deque


class MissCounter:
    """Counts misses of one pool and hands them to the reconciler once.

    A miss counts as demand in exactly one reconcile pass (`consume`), so one pass closes
    the gap it opened and the next pass does not spawn for it again.
    """

    __slots__ = ("_events", "_window_s")

    def __init__(self, window_s: float = 60.0) -> None:
        self._window_s = window_s
        self._events: deque[float] = deque()

    def record(self, now: float, n: int = 1) -> None:
        """Note `n` misses at `now`."""
        self._events.extend([now] * n)

    def consume(self, now: float) -> int:
        """Misses since the last call that are younger than the window; clears them."""
        fresh = sum(1 for t in self._events if now - t <= self._window_s)
        self._events.clear()
        return fresh

    def pending(self) -> int:
        """Misses recorded and not yet consumed."""
        return len(self._events)
