"""The simulated cluster's own time: actions on a grid of ticks, run by asyncio tasks.

Every delay the cluster model draws (an image pull, a node's boot, a grace period) ends
on the next multiple of `tick_s`, and everything due at one tick runs in one batch, in
the order it was scheduled. Two reasons:

- a virtual-time loop pays for every distinct instant it jumps to (a loop iteration, and
  a task woken for it), so a day of a busy cluster must not become millions of
  instants; with the default half-second grid it is at most 172,800;
- Kubernetes itself reports pod state on a coarse cadence (the kubelet's PLEG relists
  containers every second), so sub-tick precision would be false precision.

Actions are plain synchronous callables: the cluster side never awaits, so nothing
interleaves inside a tick and the same seed replays the same history. One asyncio task
sleeps (on the injected `Clock`) towards each tick that has work; an action that raises
stops the timeline and the error is kept for `raise_if_failed`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from stoker.ports.clock import Clock

logger = logging.getLogger("stoker.sim.cluster.timeline")

Action = Callable[[], None]

# Float division of a time that is already on the grid must not round up a whole tick.
_EPSILON = 1e-9


class Timeline:
    """Runs scheduled actions at ticks of `tick_s` seconds of `clock.monotonic()` time."""

    def __init__(self, clock: Clock, tick_s: float) -> None:
        if tick_s <= 0:
            raise ValueError("tick_s must be > 0")
        self.clock = clock
        self.tick_s = tick_s
        self._due: dict[int, list[Action]] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._running = False
        self._current: int | None = None
        self._current_time = 0.0
        self._batch: list[Action] = []
        self.failure: BaseException | None = None

    @property
    def running(self) -> bool:
        """True between `start` and `stop`, while no action has failed."""
        return self._running

    def now(self) -> float:
        """The clock's monotonic time (read once per tick while a tick runs)."""
        if self._current is not None:
            return self._current_time
        return self.clock.monotonic()

    def current_tick(self) -> int:
        """The tick being run, or the first tick at or after now."""
        if self._current is not None:
            return self._current
        return self.tick_of(self.clock.monotonic())

    def tick_of(self, t: float) -> int:
        """The first tick at or after time `t`."""
        return math.ceil(t / self.tick_s - _EPSILON)

    def time_of(self, tick: int) -> float:
        """The time of `tick`."""
        return tick * self.tick_s

    def at(self, t: float, action: Action) -> int:
        """Run `action` at the first tick at or after `t` (now, if `t` has passed).

        Returns that tick. Actions scheduled for the tick being run join its batch.
        """
        tick = max(self.tick_of(t), self.tick_of(self.now()))
        if self._current is not None and tick <= self._current:
            self._batch.append(action)
            return self._current
        batch = self._due.get(tick)
        if batch is None:
            self._due[tick] = [action]
            if self._running:
                self._arm(tick)
        else:
            batch.append(action)
        return tick

    def after(self, delay_s: float, action: Action) -> int:
        """Run `action` `delay_s` seconds from now, on the grid."""
        return self.at(self.now() + max(0.0, delay_s), action)

    def start(self) -> None:
        """Begin running actions, including those scheduled before the start."""
        if self._running:
            return
        self._running = True
        for tick in sorted(self._due):
            self._arm(tick)

    async def stop(self) -> None:
        """Stop: pending actions are dropped and the tick tasks end."""
        self._running = False
        tasks = list(self._tasks.values())
        self._tasks.clear()
        self._due.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def raise_if_failed(self) -> None:
        """Re-raise the exception of the action that stopped the timeline, if any."""
        if self.failure is not None:
            raise RuntimeError("the simulated cluster failed") from self.failure

    def _arm(self, tick: int) -> None:
        if tick not in self._tasks:
            self._tasks[tick] = asyncio.get_running_loop().create_task(
                self._run_tick(tick), name=f"sim-tick-{tick}"
            )

    async def _run_tick(self, tick: int) -> None:
        try:
            await self.clock.sleep(self.time_of(tick) - self.clock.monotonic())
        finally:
            self._tasks.pop(tick, None)
        batch = self._due.pop(tick, None)
        if batch is None or not self._running:
            return
        # The tick's own time, not the clock's: a clock that reached it by a sum of floats
        # can read one rounding step short, and a pass that waits for time to accrue would
        # then find itself due again in the same tick.
        self._current_time = self.time_of(tick)
        self._current = tick
        self._batch = batch
        try:
            index = 0
            # The batch may grow while it runs: actions due "now" join it.
            while index < len(batch):
                batch[index]()
                index += 1
        except Exception as error:  # an inconsistent model must not keep running
            logger.exception("event=sim_action_failed tick=%s", tick)
            self.failure = error
            self._running = False
            for task in list(self._tasks.values()):
                task.cancel()
        finally:
            self._current = None
            self._batch = []


class Trigger:
    """Runs one action at most once per tick, at the earliest tick anyone asked for.

    The scheduler pass, the provisioner's batch and the like are idempotent passes over
    state; asking for one many times in a tick must cost one pass.
    """

    def __init__(self, timeline: Timeline, action: Action) -> None:
        self._timeline = timeline
        self._action = action
        self._next: int | None = None

    @property
    def armed_tick(self) -> int | None:
        """The tick the action will run at, or None."""
        return self._next

    def at(self, t: float) -> None:
        """Make sure the action runs at the first tick at or after `t`, or earlier."""
        tick = max(self._timeline.tick_of(t), self._timeline.tick_of(self._timeline.now()))
        if self._next is not None and self._next <= tick:
            return
        self._next = self._timeline.at(self._timeline.time_of(tick), self._fire)

    def soon(self) -> None:
        """Run at the current tick if it is still running, else the next one."""
        if self._next is not None and self._next <= self._timeline.current_tick():
            return  # already due now
        self.at(self._timeline.now())

    def _fire(self) -> None:
        current = self._timeline.tick_of(self._timeline.now())
        if self._next is None or self._next > current:
            return  # a stale entry: re-armed for a later tick in the meantime
        self._next = None
        self._action()
