"""Pins: a worker that holds an org's data asks the cluster not to disrupt its node.

A claim's first activation starts the pin in the background (off the claim's critical
path). A patch that fails (an API outage) must not leave a session's node movable for
good, so every janitor pass, on every replica, compares each of its own workers' pins,
as the runtime last saw them, with what the worker's state wants, and re-applies or
removes the ones out of date. `stoker_pins_out_of_date{pool}` counts those a pass
could not fix.
"""

from __future__ import annotations

from collections import Counter

from stoker.control import logs
from stoker.control.shared import Shared
from stoker.domain.errors import RuntimeFailure
from stoker.domain.records import Worker
from stoker.domain.states import WorkerState
from stoker.ports.runtime import Runtime

#: States of a worker that has held, or is about to hold, an org's data.
_PINNED = frozenset({WorkerState.ACTIVATING, WorkerState.HOT, WorkerState.HOT_IDLE})


def wants_pin(worker: Worker) -> bool | None:
    """Whether the worker's node must not be disrupted: True once it was activated for
    an org (activating, hot, hot_idle, reserved for reuse), False while neutral (warm, or
    reserved and never activated); None while spawning or on its way out (no opinion)."""
    if worker.state in _PINNED:
        return True
    if worker.state is WorkerState.RESERVED:
        return worker.activated
    if worker.state is WorkerState.WARM:
        return False
    return None


class Pins:
    """Sets and reconciles the do-not-disrupt pins of this replica's workers."""

    def __init__(self, shared: Shared, *, runtime: Runtime) -> None:
        self._book, self._catalog, self._metrics = shared.book, shared.catalog, shared.metrics
        self._runtime = runtime
        #: Workers whose pin patch runs now (the reconcile leaves them to it).
        self._patching: set[str] = set()

    def pin_soon(self, worker: Worker) -> None:
        """Pin `worker` in the background (a claim's first activation)."""
        self._patching.add(worker.id)
        self._book.spawn_task(self._pin_in_background(worker), f"busy:{worker.id}")

    async def _pin_in_background(self, worker: Worker) -> None:
        try:
            await self._pin(worker, True)
        finally:
            self._patching.discard(worker.id)

    async def reconcile(self) -> int:
        """Re-apply the pins of this replica's workers that the runtime shows out of date
        with their state; returns how many remain out of date (failed patches)."""
        stale: Counter[str] = Counter()
        for worker in self._book.known_workers().values():
            wanted = wants_pin(worker)
            if wanted is None or worker.id in self._patching:
                continue
            seen = self._runtime.pinned(worker)
            if seen is None or seen is wanted:
                continue
            # Read again: a claim may have moved it on while earlier patches ran.
            current = self._book.known(worker.id)
            if current is None or wants_pin(current) is not wanted:
                continue
            logs.worker_event("pin_out_of_date", current, pinned=seen, wanted=wanted)
            self._patching.add(worker.id)
            try:
                if not await self._pin(current, wanted):
                    stale[current.pool] += 1
            finally:
                self._patching.discard(worker.id)
        for pool in {*self._catalog.pools, *stale}:
            self._metrics.pins_out_of_date.labels(pool).set(stale[pool])
        return sum(stale.values())

    async def _pin(self, worker: Worker, busy: bool) -> bool:
        try:
            await self._runtime.set_busy(worker, busy)
        except RuntimeFailure as exc:
            logs.worker_event(
                "set_busy_failed", worker, busy=busy, error=str(exc), level=logs.WARNING
            )
            return False
        return True
