"""Reservations: pick a worker for a claim and reserve it for the claim's org.

In order of preference, the claim's parts ask for the org's parked hot_idle worker, a
neutral warm one, and a cold spawn. The book's queues give O(1) picks; when they run dry
one store round trip picks any matching worker (another replica may have spawned it).
Every pick is a fenced reservation, so a stale queue entry costs one missed CAS.
"""

from __future__ import annotations

from stoker.control.attempt import Attempt
from stoker.control.book import Book
from stoker.control.lifecycle import Lifecycle
from stoker.control.retiring import Retirer
from stoker.control.spawning import Spawner
from stoker.domain.errors import RuntimeFailure
from stoker.domain.records import Worker
from stoker.domain.specs import PoolSpec
from stoker.domain.states import ClaimSource, RetireReason, WorkerState
from stoker.ports.clock import Clock
from stoker.ports.runtime import Runtime


class Reservations:
    """Reserves hot_idle, warm and cold workers for claims."""

    def __init__(
        self,
        *,
        book: Book,
        lifecycle: Lifecycle,
        retirer: Retirer,
        spawner: Spawner,
        runtime: Runtime,
        clock: Clock,
    ) -> None:
        self._book = book
        self._lifecycle = lifecycle
        self._retirer = retirer
        self._spawner = spawner
        self._runtime = runtime
        self._clock = clock

    async def take_hot_idle(self, pool: PoolSpec, org: str) -> Worker | None:
        """Reserve a worker `org` parked in `pool` (moved on to activating where the
        store can), or None."""
        book, owner = self._book, self._book.instance_id
        while (known := book.pop_hot_idle(pool.name, org, pool.revision)) is not None:
            try:
                result = await self._lifecycle.reserve(
                    known, org=org, org_cap=0, owner=owner, activate=True
                )
            finally:
                book.clear_in_flight(known.id)
            if result.worker is not None:
                return book.remember(result.worker)
            await book.refresh(known.id)
        result = await self._lifecycle.reserve_any(
            pool.name,
            pool.revision,
            expect=WorkerState.HOT_IDLE,
            org=org,
            org_cap=0,
            owner=owner,
            activate=True,
        )
        return await self._take_from_store(result.worker)

    async def take_warm(self, pool: PoolSpec, org: str, org_cap: int) -> tuple[Worker | None, bool]:
        """Reserve a neutral warm worker of `pool` for `org` within its cap; the worker
        (or None) and whether the org's cap held it back."""
        book, owner = self._book, self._book.instance_id
        while (known := book.pop_warm(pool.name, pool.revision)) is not None:
            try:
                result = await self._lifecycle.reserve(
                    known, org=org, org_cap=org_cap, owner=owner, activate=True
                )
            finally:
                book.clear_in_flight(known.id)
            if result.worker is not None:
                return book.remember(result.worker), False
            if result.at_org_cap:
                book.put_back_warm(known)
                return None, True
            await book.refresh(known.id)
        result = await self._lifecycle.reserve_any(
            pool.name,
            pool.revision,
            expect=WorkerState.WARM,
            org=org,
            org_cap=org_cap,
            owner=owner,
            activate=True,
        )
        return await self._take_from_store(result.worker), result.at_org_cap

    async def _take_from_store(self, worker: Worker | None) -> Worker | None:
        """A worker reserved straight from the store; adopt it if another replica spawned it."""
        if worker is None:
            return None
        if self._book.known(worker.id) is None and not await self._runtime.adopt(worker):
            await self._retirer.retire(worker, RetireReason.LOST)
            return None
        return self._book.remember(worker)

    async def take_cold(self, a: Attempt, slot: Worker) -> tuple[Worker, ClaimSource] | None:
        """Create a cold spawn slot reserved for the claim's org, wait for its readiness
        and reserve it; a slot whose requester left meanwhile goes to `warm`."""
        book = self._book
        ready = book.expect_ready(slot.id)
        if not await self._spawner.create(slot, a.pool):
            return None
        try:
            # Readiness is bounded by the runtime's spawn timeout, not by the requester.
            endpoint = await ready
        except RuntimeFailure:
            return None
        finally:
            book.drop_spawn_wait(slot.id)
        slot = book.known(slot.id) or slot
        if slot.state is not WorkerState.SPAWNING:
            return None
        if a.abandoned:
            warm = await self._lifecycle.move(
                slot,
                WorkerState.WARM,
                **book.with_unsaved_ref(slot.id, endpoint=endpoint, org=None),
            )
            if warm is None:
                book.note_ready(slot.id, endpoint)
            else:
                book.ref_saved(slot.id)
                book.offer_warm(book.remember(warm))
            return None
        reserved = await self._lifecycle.move(
            slot,
            WorkerState.RESERVED,
            bump_epoch=True,
            **book.with_unsaved_ref(slot.id, endpoint=endpoint, heartbeat_at=self._clock.now()),
        )
        if reserved is None:
            book.note_ready(slot.id, endpoint)
            return None
        book.ref_saved(slot.id)
        return book.remember(reserved), ClaimSource.COLD
