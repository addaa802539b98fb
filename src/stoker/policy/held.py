"""The largest of the values added over a sliding window of time (pure).

The forecast headroom falls only once it has been lower for the pool's hold (half an hour):
each janitor pass adds what it wants and gets the largest of the hold. The largest is kept
at the front, without a scan of the hold's passes: a value with a later one at least as
large behind it is never the largest again, whatever the window, and is dropped.
"""

from __future__ import annotations

from collections import deque


class HeldMax:
    """The largest value added within the last `window_s` seconds."""

    def __init__(self) -> None:
        #: (time, value), values falling from the front; times rise.
        self._kept: deque[tuple[float, int]] = deque()

    def add(self, now: float, value: int, window_s: float) -> int:
        """Add `value` at `now` (not before the last add) and return the largest added
        since `now - window_s`."""
        kept = self._kept
        while kept and kept[-1][1] <= value:
            kept.pop()
        kept.append((now, value))
        while kept[0][0] < now - window_s:
            kept.popleft()
        return kept[0][1]
