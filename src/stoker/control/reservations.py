"""Reservations: pick a worker for a claim and reserve it for the claim's org.

In order of preference, a claim asks for a worker its org parked (hot_idle), a neutral
warm one, and a cold spawn. The book's queues give O(1) picks; when they run dry
one store round trip picks any matching worker (another replica may have spawned it).
Every pick is a fenced reservation, so a stale queue entry costs one missed CAS.
"""

from __future__ import annotations

from collections.abc import Container

from stoker.control.attempt import Attempt
from stoker.control.retiring import Retirer
from stoker.control.shared import Shared
from stoker.control.spawning import Spawner
from stoker.domain.records import Worker
from stoker.domain.specs import PoolSpec
from stoker.domain.states import ClaimSource, RetireReason, WorkerState
from stoker.ports.runtime import Runtime
from stoker.ports.store import ReserveResult

_NONE = ReserveResult(None)


class Reservations:
    """Reserves hot_idle, warm and cold workers for claims."""

    def __init__(
        self, shared: Shared, *, retirer: Retirer, spawner: Spawner, runtime: Runtime
    ) -> None:
        self._book, self._lifecycle, self._clock = shared.book, shared.lifecycle, shared.clock
        self._rollouts = shared.rollouts
        self._retirer = retirer
        self._spawner = spawner
        self._runtime = runtime

    async def take(
        self, pool: PoolSpec, org: str, expect: WorkerState, org_cap: int = 0
    ) -> ReserveResult:
        """Reserve a `warm` worker of `pool`'s revision for `org` within `org_cap` (of
        another serving revision when it has none), or (`expect` hot_idle) one `org`
        parked at any revision that serves; moved on to activating where the store can.

        The result's worker is None when there was none; `at_org_cap` says the org's cap
        held a warm one back.
        """
        if expect is WorkerState.HOT_IDLE:
            # Reuse stays on the worker's own revision, whichever may still serve.
            revisions = self._rollouts.serving_revisions(pool.name)
            if not revisions:
                return _NONE
            also = self._rollouts.reusable(pool.name)
            return await self._take(pool.name, org, expect, org_cap, revisions, also)
        result = _NONE
        # During a rollout a claim whose revision has no warm worker takes one of the
        # other serving revision rather than a cold start (its share is a target, a cold
        # start is a cost).
        for revision in self._rollouts.warm_order(pool.name, pool.revision):
            result = await self._take(pool.name, org, expect, org_cap, (revision,), ())
            if result.worker is not None or result.at_org_cap:
                break
        return result

    async def _take(
        self,
        pool: str,
        org: str,
        expect: WorkerState,
        org_cap: int,
        revisions: tuple[str, ...],
        also: Container[str],
    ) -> ReserveResult:
        book, owner = self._book, self._book.instance_id
        while known := book.pop(expect, pool, org, revisions[0], also=also):
            try:
                result = await self._lifecycle.reserve(
                    known, org=org, org_cap=org_cap, owner=owner, activate=True
                )
            finally:
                book.clear_in_flight(known.id)
            if result.worker is not None:
                book.remember(result.worker)
                return result
            if result.at_org_cap:
                book.put_back_warm(known)
                return result
            await book.refresh(known.id)
        # The queue ran dry: any matching worker in the store (the queues are only hints).
        for revision in revisions:
            result = await self._lifecycle.reserve_any(
                pool,
                revision,
                expect=expect,
                org=org,
                org_cap=org_cap,
                owner=owner,
                activate=True,
            )
            if result.worker is not None or result.at_org_cap:
                break
        if result.worker is None:
            return result
        return await self._adopted(result)

    async def _adopted(self, result: ReserveResult) -> ReserveResult:
        """A worker reserved from the store: adopted if another replica spawned it."""
        worker = result.worker
        assert worker is not None
        if self._book.known(worker.id) is None and not await self._runtime.adopt(worker):
            # Another replica spawned it and it is gone: retire it rather than hand it out.
            await self._retirer.retire(worker, RetireReason.LOST)
            return _NONE
        self._book.remember(worker)
        return result

    async def make_room(self, a: Attempt) -> None:
        """The pool is at its cap: retire another org's parked worker for the claim, unless
        the one it retired already is still stopping (its slot is on its way)."""
        if a.reclaiming is not None and self._retirer.is_stopping(a.reclaiming):
            return
        victim = await self._retirer.reclaim(a.pool, a.org)
        a.reclaiming = victim.id if victim is not None else None

    async def start_cold(self, a: Attempt, slot: Worker) -> bool:
        """Create a cold spawn slot reserved for the claim's org, linked to the claim (which
        then waits for it, or for any worker that gets ready first); False if not created."""
        self._book.expect_ready(slot.id, a)
        return await self._spawner.create(slot, a.pool)

    async def take_spawn(self, a: Attempt) -> tuple[Worker, ClaimSource] | None:
        """Reserve the cold spawn handed to the claim once it got ready (one write)."""
        if a.spawn_ready is None:
            return None
        worker_id, ready = a.spawn_ready
        a.spawn_ready = None
        if ready.exception() is not None:
            return None  # lost before ready: the claim tries again
        endpoint = ready.result()
        book = self._book
        slot = book.known(worker_id)
        if slot is None or slot.state is not WorkerState.SPAWNING:
            return None
        if a.gone():
            await self._to_warm(slot, endpoint)
            return None
        if slot.org != a.org:
            return await self._take_others_spawn(a, slot, endpoint)
        reserved = await self._lifecycle.move(
            slot,
            WorkerState.RESERVED,
            bump_epoch=True,
            **book.with_unsaved_ref(slot.id, endpoint=endpoint, heartbeat_at=self._clock.now()),
        )
        if reserved is None:
            book.ready.note(slot.id, endpoint)
            return None
        book.ref_saved(slot.id)
        return book.remember(reserved), ClaimSource.COLD

    async def _take_others_spawn(
        self, a: Attempt, slot: Worker, endpoint: str
    ) -> tuple[Worker, ClaimSource] | None:
        """A spawn slot reserved for another org (or none) that the claim took: it becomes
        warm, then is reserved within the claim's org cap; offered to the others if not."""
        book = self._book
        warm = await self._lifecycle.move(
            slot, WorkerState.WARM, **book.with_unsaved_ref(slot.id, endpoint=endpoint, org=None)
        )
        if warm is None:
            book.ready.note(slot.id, endpoint)
            return None
        book.ref_saved(slot.id)
        book.remember(warm)
        if slot.org is not None:
            book.hot_idle_parked(slot.pool, slot.org)  # that org's cap has room again
        book.mark_in_flight(warm.id)
        try:
            result = await self._lifecycle.reserve(
                warm, org=a.org, org_cap=a.org_cap, owner=book.instance_id, activate=True
            )
        finally:
            book.clear_in_flight(warm.id)
        if result.worker is None:
            book.offer_warm(book.known(warm.id) or warm)
            return None
        return book.remember(result.worker), ClaimSource.COLD

    async def _to_warm(self, slot: Worker, endpoint: str) -> None:
        """A ready spawn nobody takes joins the warm pool (the next pass retries a miss)."""
        book = self._book
        warm = await self._lifecycle.move(
            slot, WorkerState.WARM, **book.with_unsaved_ref(slot.id, endpoint=endpoint, org=None)
        )
        if warm is None:
            book.ready.note(slot.id, endpoint)
        else:
            book.ref_saved(slot.id)
            book.offer_warm(book.remember(warm))

    async def free_own_spawn(self, a: Attempt) -> None:
        """Before the claim takes another worker, its spawn stops counting against its org's
        cap: the slot becomes neutral (it still comes to the claim if it gets ready first)."""
        book = self._book
        worker_id = book.spawn_of(a)
        slot = book.known(worker_id) if worker_id is not None else None
        if a.org_cap <= 0 or slot is None or slot.org is None:
            return
        if slot.state is WorkerState.SPAWNING:
            neutral = await self._lifecycle.move(slot, WorkerState.SPAWNING, org=None)
            if neutral is not None:
                book.remember(neutral)

    async def let_go(self, a: Attempt) -> None:
        """The claim is served or gone: a spawn it waits for goes on to the next claim
        without one (or to the warm pool), one handed to it and not taken goes warm."""
        book = self._book
        book.hand_on_spawn(a, a.pool.name)
        if a.spawn_ready is None:
            return
        worker_id, ready = a.spawn_ready
        a.spawn_ready = None
        slot = book.known(worker_id)
        if ready.exception() is None and slot is not None and slot.state is WorkerState.SPAWNING:
            await self._to_warm(slot, ready.result())
