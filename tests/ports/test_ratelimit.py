"""The spawn token bucket on virtual time."""

from __future__ import annotations

import asyncio

import pytest

from stoker.ports.clock import LoopClock, TokenBucket

pytestmark = pytest.mark.looptime


async def test_a_burst_passes_then_the_rate_holds() -> None:
    bucket = TokenBucket(LoopClock(), rate=5, burst=3)
    loop = asyncio.get_running_loop()
    start = loop.time()
    for _ in range(3):
        await bucket.acquire()
    assert loop.time() - start == pytest.approx(0.0)
    for _ in range(5):
        await bucket.acquire()
    assert loop.time() - start == pytest.approx(1.0)


async def test_many_waiters_never_stall_on_rounding() -> None:
    # A token left a hair under 1 by float rounding once made acquire spin forever.
    bucket = TokenBucket(LoopClock(), rate=5, burst=1)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await asyncio.gather(*(bucket.acquire() for _ in range(51)))
    assert loop.time() - start == pytest.approx(10.0)


def test_invalid_budget_is_refused() -> None:
    with pytest.raises(ValueError):
        TokenBucket(LoopClock(), rate=0, burst=1)
