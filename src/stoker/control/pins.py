"""Pins: a worker that holds an org's data asks the cluster not to disrupt its node.

A claim's first activation starts the pin in the background (off the claim's critical
path). A patch that fails (an API outage) must not leave a session's node movable for
good, so every janitor pass, on every replica, compares the pins of its own activated
workers (activating, hot, hot_idle, reserved for reuse), as the runtime last saw them,
with their state and re-applies the missing ones; `stoker_pins_out_of_date{pool}`
counts those a pass could not fix. The leader's pass also removes a pin a neutral (warm)
worker carries, for warm workers as the store says they are: a replica's own book may
still show a worker warm that another replica has just taken for a claim, and removing
that pin would expose a live session.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable

from stoker.control import logs
from stoker.control.shared import Shared
from stoker.domain.errors import RuntimeFailure, StoreError
from stoker.domain.records import Worker
from stoker.domain.states import WorkerState
from stoker.ports.runtime import Runtime
from stoker.ports.store import StoreReader

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

    def __init__(self, shared: Shared, *, runtime: Runtime, reader: StoreReader) -> None:
        self._book, self._catalog, self._metrics = shared.book, shared.catalog, shared.metrics
        self._runtime = runtime
        self._reader = reader
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
        """Re-apply the pins of this replica's activated workers that the runtime shows
        without one; returns how many remain without (failed patches)."""
        stale: Counter[str] = Counter()
        # Only a worker whose live object shows no pin can miss one: the runtime's index of
        # those is read, not the runtime asked about every worker of the fleet each pass.
        unpinned = self._runtime.unpinned()
        if any(self._misses_pin(self._book.known(worker_id)) for worker_id in unpinned):
            await self._repin(unpinned, stale)
        for pool in {*self._catalog.pools, *stale}:
            self._metrics.pins_out_of_date.labels(pool).set(stale[pool])
        return sum(stale.values())

    def _misses_pin(self, worker: Worker | None) -> bool:
        """Whether `worker` (known to this replica) wants a pin its pod lacks, and no patch
        of it runs."""
        return (
            worker is not None
            and bool(wants_pin(worker))
            and worker.id not in self._patching
            and self._runtime.pinned(worker) is False
        )

    async def _repin(self, unpinned: Collection[str], stale: Counter[str]) -> None:
        """Pin the known workers missing one, in the book's order (most passes find none
        among the few unpinned pods, and never come here: the fleet is not walked)."""
        for worker in self._book.known_workers().values():
            if worker.id not in unpinned:
                continue
            if not wants_pin(worker) or worker.id in self._patching:
                continue
            if self._runtime.pinned(worker) is not False:
                continue
            # Read again: it may have moved on (retired) while earlier patches ran.
            current = self._book.known(worker.id)
            if current is None or not wants_pin(current):
                continue
            logs.worker_event("pin_missing", current)
            self._patching.add(worker.id)
            try:
                if not await self._pin(current, True):
                    stale[current.pool] += 1
            finally:
                self._patching.discard(worker.id)
            # The patch took time: pods changed meanwhile.
            unpinned = self._runtime.unpinned()

    async def unpin_neutral(self, warm: Iterable[Worker]) -> int:
        """Remove the pin from warm workers (of any replica, as the store listed them)
        whose pods carry one; each is read again first, since a claim may have taken it
        since the list. Returns how many pins were removed."""
        removed = 0
        for worker in warm:
            if self._runtime.pinned(worker) is not True or worker.id in self._patching:
                continue
            try:
                current = await self._reader.get_worker(worker.id)
            except StoreError:
                return removed
            if current is None or wants_pin(current) is not False:
                continue
            logs.worker_event("pin_removed", current, reason="neutral")
            removed += await self._pin(current, False)
        return removed

    async def _pin(self, worker: Worker, busy: bool) -> bool:
        try:
            await self._runtime.set_busy(worker, busy)
        except RuntimeFailure as exc:
            logs.worker_event(
                "set_busy_failed", worker, busy=busy, error=str(exc), level=logs.WARNING
            )
            return False
        return True
