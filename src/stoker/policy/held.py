"""The largest of the values added over a sliding window of time (pure).

The headroom falls only once it has been lower for the pool's hold (half an hour): each
janitor pass adds what it wants and gets the largest of the hold (the latest of equals).
The largest is kept at the front, without a scan of the hold's passes: a value with a later
one at least as large behind it is never the largest again, whatever the window, and is
dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class HeldMax(Generic[T]):
    """The largest value added within the last `window_s` seconds, by `key` (default: the
    value itself)."""

    def __init__(self, key: Callable[[T], Any] | None = None) -> None:
        self._key: Callable[[T], Any] = key if key is not None else (lambda value: value)
        #: (time, value), keys falling from the front; times rise.
        self._kept: deque[tuple[float, T]] = deque()

    def add(self, now: float, value: T, window_s: float) -> T:
        """Add `value` at `now` (not before the last add) and return the largest added
        since `now - window_s` (of equals, the latest)."""
        kept, key = self._kept, self._key
        size = key(value)
        while kept and key(kept[-1][1]) <= size:
            kept.pop()
        kept.append((now, value))
        while kept[0][0] < now - window_s:
            kept.popleft()
        return kept[0][1]
