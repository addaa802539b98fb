"""Reservations: pick a worker for a claim and reserve it for the claim's org.

In order of preference, a claim asks for a worker its org parked (hot_idle), a neutral
warm one, and a cold spawn. The book's queues give O(1) picks; when they run dry
one store round trip picks any matching worker (another replica may have spawned it).
Every pick is a fenced reservation, so a stale queue entry costs one missed CAS. On a
store that can (`ParkedFirst`: PostgreSQL), the look in the store for a worker the org
parked also reserves the next warm worker of the queue when it finds none: a warm claim
costs one write less.
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
            return (await self.take_parked(pool, org))[0]
        result = _NONE
        # During a rollout a claim whose revision has no warm worker takes one of the
        # other serving revision rather than a cold start (its share is a target, a cold
        # start is a cost).
        for revision in self._rollouts.warm_order(pool.name, pool.revision):
            result = await self._take(pool.name, org, expect, org_cap, (revision,), ())
            if result.worker is not None or result.at_org_cap:
                break
        return result

    async def take_parked(
        self, pool: PoolSpec, org: str, warm_cap: int | None = None
    ) -> tuple[ReserveResult, ReserveResult | None]:
        """Reserve a worker `org` parked (as `take` hot_idle does). With `warm_cap`, on a
        store that folds the look into a write, the store's look for one also reserves the
        next warm worker of the queue for `org` within that cap when it finds none: the
        second result is that warm reservation, None when it was not made."""
        # Reuse stays on the worker's own revision, whichever may still serve.
        revisions = self._rollouts.serving_revisions(pool.name)
        if not revisions:
            return _NONE, None
        also = self._rollouts.reusable(pool.name)
        queued = await self._take_queued(
            pool.name, org, WorkerState.HOT_IDLE, 0, revisions[0], also
        )
        if queued is not None:
            return queued, None
        if warm_cap is not None and self._lifecycle.folds_parked_look:
            revision = self._rollouts.warm_order(pool.name, pool.revision)[0]
            known = self._book.pop(WorkerState.WARM, pool.name, org, revision)
            if known is not None:
                return await self._parked_or_warm(known, revisions, org, warm_cap)
            if warm_cap == 0:
                # No warm worker of its own to name (another replica spawned them): the
                # store's pick, in the same write (and with the others of the iteration).
                return await self._parked_or_any(pool.name, revision, revisions, org)
        return await self._take_stored(pool.name, org, WorkerState.HOT_IDLE, 0, revisions), None

    async def _parked_or_warm(
        self, known: Worker, revisions: tuple[str, ...], org: str, org_cap: int
    ) -> tuple[ReserveResult, ReserveResult | None]:
        """One write: a worker `org` parked, else the warm worker `known` (popped)."""
        book = self._book
        try:
            result = await self._lifecycle.reserve_parked_or(
                known, revisions=revisions, org=org, org_cap=org_cap, owner=book.instance_id
            )
        finally:
            book.clear_in_flight(known.id)
        worker = result.worker
        if worker is not None and result.parked:
            if worker.id != known.id:
                book.put_back_warm(known)  # untouched: the next claim's
            return await self._adopted(result), None
        if worker is not None:
            book.remember(worker)
            return _NONE, result
        if result.at_org_cap:
            book.put_back_warm(known)
            return _NONE, result
        await book.refresh(known.id)
        return _NONE, None

    async def _parked_or_any(
        self, pool: str, revision: str, revisions: tuple[str, ...], org: str
    ) -> tuple[ReserveResult, ReserveResult | None]:
        """One write: a worker `org` parked, else any warm worker of `revision`."""
        result = await self._lifecycle.reserve_parked_or_any(
            pool, revision, revisions=revisions, org=org, owner=self._book.instance_id
        )
        if result.worker is None:
            return _NONE, None
        adopted = await self._adopted(result)
        if result.parked or adopted.worker is None:
            return adopted, None
        return _NONE, adopted

    async def _take(
        self,
        pool: str,
        org: str,
        expect: WorkerState,
        org_cap: int,
        revisions: tuple[str, ...],
        also: Container[str],
    ) -> ReserveResult:
        queued = await self._take_queued(pool, org, expect, org_cap, revisions[0], also)
        if queued is not None:
            return queued
        return await self._take_stored(pool, org, expect, org_cap, revisions)

    async def _take_queued(
        self,
        pool: str,
        org: str,
        expect: WorkerState,
        org_cap: int,
        revision: str,
        also: Container[str],
    ) -> ReserveResult | None:
        """Reserve from the book's queue; None when it ran dry."""
        book, owner = self._book, self._book.instance_id
        while known := book.pop(expect, pool, org, revision, also=also):
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
        return None

    async def _take_stored(
        self, pool: str, org: str, expect: WorkerState, org_cap: int, revisions: tuple[str, ...]
    ) -> ReserveResult:
        """The queue ran dry: any matching worker in the store (the queues are only hints)."""
        owner, result = self._book.instance_id, _NONE
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
