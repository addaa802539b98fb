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

Timers are asyncio's `TimerHandle`s, but the heap holds each one's due time as a float
(`_Due`, which carries the handle): asyncio's heap compares handles with a Python
`__lt__`, on due times only, which was about a tenth of the loop's cost; floats compare
in C, with the same answers, so every push and pop moves the heap exactly as asyncio's
would and ties keep asyncio's order: a run replays exactly. `_run_once` is asyncio's
own (CPython 3.11), on that heap.
"""

from __future__ import annotations

import asyncio
import heapq
import selectors
from asyncio import events
from asyncio.base_events import (  # type: ignore[attr-defined]
    _MIN_CANCELLED_TIMER_HANDLES_FRACTION,
    _MIN_SCHEDULED_TIMER_HANDLES,
    MAXIMUM_SELECT_TIMEOUT,
    _format_handle,
    logger,
)
from collections.abc import Callable
from contextvars import Context
from typing import Any, TypeVarTuple

#: The loop's signal handlers, by signal (an internal of asyncio's Unix loop).
_SIGNAL_HANDLERS = "_signal_handlers"

_Ts = TypeVarTuple("_Ts")


class _Due(float):
    """A timer's due time on the heap, with its handle: compared as the float it is."""

    __slots__ = ("handle",)
    handle: asyncio.TimerHandle


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """`asyncio.SelectorEventLoop` on a virtual clock that starts at `start` seconds."""

    #: asyncio's count of cancelled timers still on the heap (the base loop's attribute).
    _timer_cancelled_count: int

    def __init__(self, start: float = 0.0) -> None:
        super().__init__(selectors.DefaultSelector())
        self._virtual_now = float(start)
        selector = self._selector  # type: ignore[attr-defined]
        self._real_select = selector.select
        self._files = selector.get_map()
        selector.select = self._select
        #: A callback was handed in from another thread since the last poll.
        self._handed_in = False
        #: asyncio's timer heap (the base loop's attribute), of `_Due` entries here.
        self._scheduled: list[_Due] = []

    def time(self) -> float:
        """Virtual seconds since the loop's start value."""
        return self._virtual_now

    def call_at(
        self,
        when: float,
        callback: Callable[[*_Ts], object],
        *args: *_Ts,
        context: Context | None = None,
    ) -> asyncio.TimerHandle:
        """asyncio's `call_at`, onto the heap of due times."""
        if when is None:
            raise TypeError("when cannot be None")
        self._check_closed()  # type: ignore[attr-defined]
        if self._debug:  # type: ignore[attr-defined]
            self._check_thread()  # type: ignore[attr-defined]
            self._check_callback(callback, "call_at")  # type: ignore[attr-defined]
        timer = events.TimerHandle(when, callback, args, self, context)
        if timer._source_traceback:  # type: ignore[attr-defined]
            del timer._source_traceback[-1]  # type: ignore[attr-defined]
        due = _Due(when)
        due.handle = timer
        heapq.heappush(self._scheduled, due)
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    def _run_once(self) -> None:
        """asyncio's `_run_once` (CPython 3.11) on the heap of due times; with callbacks
        ready it skips the poll outright (`_select` would return nothing)."""
        scheduled = self._scheduled
        sched_count = len(scheduled)
        if (
            sched_count > _MIN_SCHEDULED_TIMER_HANDLES
            and self._timer_cancelled_count / sched_count > _MIN_CANCELLED_TIMER_HANDLES_FRACTION
        ):
            # Remove cancelled timers when there are many of them.
            kept = []
            for due in scheduled:
                if due.handle._cancelled:
                    due.handle._scheduled = False  # type: ignore[attr-defined]
                else:
                    kept.append(due)
            heapq.heapify(kept)
            self._scheduled = scheduled = kept
            self._timer_cancelled_count = 0
        else:
            # Remove cancelled timers from the head of the heap.
            while scheduled and scheduled[0].handle._cancelled:
                self._timer_cancelled_count -= 1
                heapq.heappop(scheduled).handle._scheduled = False  # type: ignore[attr-defined]

        ready = self._ready  # type: ignore[attr-defined]
        timeout: float | None = None
        if ready or self._stopping:  # type: ignore[attr-defined]
            timeout = 0
        elif scheduled:
            timeout = min(max(0, scheduled[0] - self.time()), MAXIMUM_SELECT_TIMEOUT)
        if timeout != 0:
            self._process_events(self._selector.select(timeout))  # type: ignore[attr-defined]

        # The timers that are due.
        end_time = self.time() + self._clock_resolution  # type: ignore[attr-defined]
        while scheduled:
            if scheduled[0] >= end_time:
                break
            handle = heapq.heappop(scheduled).handle
            handle._scheduled = False  # type: ignore[attr-defined]
            ready.append(handle)

        # Run the callbacks ready now, not the ones they make ready (asyncio's rule).
        for _ in range(len(ready)):
            handle = ready.popleft()
            if handle._cancelled:
                continue
            if self._debug:  # type: ignore[attr-defined]
                try:
                    self._current_handle = handle
                    t0 = self.time()
                    handle._run()
                    dt = self.time() - t0
                    if dt >= self.slow_callback_duration:
                        logger.warning("Executing %s took %.3f seconds", _format_handle(handle), dt)
                finally:
                    self._current_handle = None
            else:
                handle._run()
        handle = None  # type: ignore[assignment]  # breaks a cycle when a callback raised

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
        scheduled = self._scheduled
        if timeout is None or not scheduled:
            # Nothing will ever be due: only real I/O (another thread) can wake the loop.
            real: list[tuple[Any, int]] = self._real_select(timeout)
            return real
        # The earliest live timer is at the head (asyncio pops cancelled ones first); its
        # own due time, not now + timeout, so float rounding never leaves it short.
        self._virtual_now = max(self._virtual_now, float(scheduled[0]))
        return []


def new_event_loop(start: float = 0.0) -> VirtualTimeLoop:
    """A fresh `VirtualTimeLoop` (not set as the current loop)."""
    return VirtualTimeLoop(start)
