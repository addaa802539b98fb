"""Deadlines on the injected clock, shared by the adapters.

Not `asyncio.timeout`, which reads the loop: a deadline on the injected clock also holds on
a virtual clock that a test or the simulator moves forward.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from stoker.ports.clock import Clock

T = TypeVar("T")


class DeadlinePassed(TimeoutError):
    """`within`'s deadline passed first (told apart from a `TimeoutError` of the call)."""


async def within(clock: Clock, call: Awaitable[T], seconds: float) -> T:
    """Await `call` for at most `seconds` of `clock` time; `DeadlinePassed` after that
    (the call is cancelled)."""
    work: asyncio.Future[T] = asyncio.ensure_future(call)
    timer = asyncio.ensure_future(clock.sleep(max(seconds, 0.0)))
    try:
        await asyncio.wait((work, timer), return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, timer, return_exceptions=True)
    if work.cancelled():
        raise DeadlinePassed(f"no answer within {seconds:g}s")
    return work.result()
