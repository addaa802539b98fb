"""A token bucket on the injected clock: spawns never outrun the runtime's API budget."""

from __future__ import annotations

import asyncio

from stoker.ports.clock import Clock


class TokenBucket:
    """`rate` tokens per second, at most `burst` saved up; `acquire` waits for one.

    Waiters are served first come, first served, so a burst of spawns proceeds at exactly
    the budget rather than in a thundering herd.
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
