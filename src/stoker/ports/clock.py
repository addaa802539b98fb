"""The Clock port: the only place in stoker that reads the wall clock.

Control code reads time only through a `Clock`. `LoopClock` is built on `loop.time()`, so an
event loop with a virtual clock (looptime, the simulator) makes hours pass in seconds;
`VirtualClock` additionally lets a test jump `now()` forward without waiting.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, ClassVar, Protocol


class Clock(Protocol):
    """Time as control code sees it."""

    def now(self) -> float:
        """Seconds since the Unix epoch, for timestamps in the store."""
        ...

    def monotonic(self) -> float:
        """Seconds on a monotonic scale, for durations."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Sleep `seconds` of this clock's time."""
        ...


class LoopClock:
    """The system clock: `loop.time()` mapped once onto wall time.

    The mapping is taken at the first read, so virtual loops (looptime, the simulator's) run
    this very clock at their own pace. Pass `epoch` to fix the mapping (deterministic runs).
    """

    #: Its sleeps are the loop's own timers, so `asyncio.timeout` measures its time too.
    loop_timers: ClassVar[bool] = True

    def __init__(
        self, epoch: float | None = None, *, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self._epoch = epoch
        self._offset: float | None = None
        #: The one loop this clock reads, when given (the simulator's); else the running one.
        self._loop = loop

    def _loop_time(self) -> float:
        # Only loop time: a fallback to another clock would silently mix time scales.
        if self._loop is not None:
            return self._loop.time()
        return asyncio.get_running_loop().time()

    def monotonic(self) -> float:
        """`loop.time()` of the running loop."""
        return self._loop_time()

    def now(self) -> float:
        """Wall time derived from the loop clock."""
        t = self._loop_time()
        if self._offset is None:
            base = self._epoch if self._epoch is not None else time.time()
            self._offset = base - t
        return self._offset + t

    def sleep(self, seconds: float) -> Coroutine[Any, Any, None]:
        """`asyncio.sleep`, which follows the loop's (possibly virtual) clock: its own
        coroutine, with no frame of this method's around it (a simulated run sleeps
        about 30 times per claim)."""
        return asyncio.sleep(max(0.0, seconds))


class VirtualClock(LoopClock):
    """A loop clock that a test can move forward at once with `advance`.

    Sleepers wake as soon as either the loop clock or an `advance` reaches their deadline,
    so a test can make a TTL pass without waiting for it.
    """

    #: `advance` moves it past the loop's timers.
    loop_timers: ClassVar[bool] = False

    def __init__(self, epoch: float | None = 1_700_000_000.0) -> None:
        # A fixed default epoch keeps runs reproducible; None maps to the wall clock like
        # `LoopClock` (for tests that compare with times the OS reports).
        super().__init__(epoch)
        self._skipped = 0.0
        self._advanced = asyncio.Event()

    def monotonic(self) -> float:
        """Loop time plus everything skipped by `advance`."""
        return super().monotonic() + self._skipped

    def now(self) -> float:
        """Wall time plus everything skipped by `advance`."""
        return super().now() + self._skipped

    def advance(self, seconds: float) -> None:
        """Jump forward by `seconds` and wake sleepers whose deadline passed."""
        if seconds < 0:
            raise ValueError("time only moves forward")
        self._skipped += seconds
        self._advanced.set()
        self._advanced = asyncio.Event()

    async def sleep(self, seconds: float) -> None:
        """Sleep until the deadline on this clock, whichever way time gets there."""
        deadline = self.monotonic() + max(0.0, seconds)
        while (remaining := deadline - self.monotonic()) > 0:
            advanced = self._advanced
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
                # that lands in the same step as an `advance`.
                async with asyncio.timeout(remaining):
                    await advanced.wait()
            except TimeoutError:
                # The loop clock covered `remaining`. Re-checking could find a float-rounding
                # residue, and a 1e-12 s timer never advances a virtual loop clock.
                return


class TokenBucket:
    """`rate` tokens per second on a `Clock`, at most `burst` saved up; `acquire` waits.

    Spawns and cluster API calls never outrun their budget with it. Waiters are served
    first come, first served, so a burst proceeds at exactly the rate rather than in a
    thundering herd.
    """

    def __init__(self, clock: Clock, *, rate: float, burst: int) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a token bucket needs rate > 0 and burst >= 1")
        self._clock = clock
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._stamp: float | None = None
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = self._clock.monotonic()
        if self._stamp is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    async def acquire(self) -> None:
        """Take one token, waiting as long as the rate requires."""
        async with self._lock:
            self._refill()
            if self._tokens < 1:
                await self._clock.sleep((1 - self._tokens) / self.rate)
                self._refill()
                # The wait was exactly long enough: float rounding must not leave the token
                # a hair short (on a virtual clock a 1e-12 s sleep never advances time).
                self._tokens = max(self._tokens, 1.0)
            self._tokens -= 1
