"""A virtual-time asyncio loop: whenever every task waits, the clock jumps to the next timer.

The simulator's loop. It is asyncio's own selector loop with two changes:

- `time()` is a number that only moves when nothing is ready to run, and then straight
  to the due time of the earliest timer, so an hour of sleeping costs nothing;
- while callbacks are ready, the loop does not poll the operating system at all (the
  simulator does no I/O); it polls once, without waiting, before a jump, so a callback
  handed in from another thread (`call_soon_threadsafe`) still lands first. It polls only
  when there can be something to read: a callback was handed in since the last poll, or
  a signal handler or another file than the loop's own wake-up pipe is registered. A
  simulation has none, and a poll per jump was a few percent of a run.

With no timer left and nothing ready the loop waits for real I/O, as asyncio's does.
Timers are asyncio's, so ties keep asyncio's order and a run replays exactly.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any

#: asyncio's heap of timer handles, on the base loop (an internal of CPython's asyncio).
_SCHEDULED = "_scheduled"
#: The loop's signal handlers, by signal (an internal of asyncio's Unix loop).
_SIGNAL_HANDLERS = "_signal_handlers"


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """`asyncio.SelectorEventLoop` on a virtual clock that starts at `start` seconds."""

    def __init__(self, start: float = 0.0) -> None:
        super().__init__(selectors.DefaultSelector())
        self._virtual_now = float(start)
        selector = self._selector  # type: ignore[attr-defined]
        self._real_select = selector.select
        self._files = selector.get_map()
        selector.select = self._select
        #: A callback was handed in from another thread since the last poll.
        self._handed_in = False

    def time(self) -> float:
        """Virtual seconds since the loop's start value."""
        return self._virtual_now

    def _write_to_self(self) -> None:
        # `call_soon_threadsafe` wakes the loop through its pipe: poll before the next jump.
        self._handed_in = True
        super()._write_to_self()  # type: ignore[misc]

    def _may_read(self) -> bool:
        """Whether a poll can find anything: a callback handed in, a signal handler (its
        signals write to the pipe directly), or a file besides the wake-up pipe."""
        return (
            self._handed_in or bool(getattr(self, _SIGNAL_HANDLERS, None)) or len(self._files) > 1
        )

    def _select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        if timeout is not None and timeout <= 0:
            # Callbacks are ready: no time passes and there is nothing to wait for.
            return []
        if self._may_read():
            self._handed_in = False
            events: list[tuple[Any, int]] = self._real_select(0)
            if events:
                return events
        scheduled: list[asyncio.TimerHandle] = getattr(self, _SCHEDULED)
        if timeout is None or not scheduled:
            # Nothing will ever be due: only real I/O (another thread) can wake the loop.
            real: list[tuple[Any, int]] = self._real_select(timeout)
            return real
        # The earliest live timer is at the head (asyncio pops cancelled ones first); its
        # own due time, not now + timeout, so float rounding never leaves it short.
        self._virtual_now = max(self._virtual_now, scheduled[0].when())
        return []


def new_event_loop(start: float = 0.0) -> VirtualTimeLoop:
    """A fresh `VirtualTimeLoop` (not set as the current loop)."""
    return VirtualTimeLoop(start)
