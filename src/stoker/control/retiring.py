"""Retiring: drain a worker (persisted), stop its runtime object, mark it retired.

A draining write that fails is remembered in the book and retried by the next pass if the
row is still as it was (a fence miss means someone else moved it: then not). The stop
runs in the background, once at a time per worker; a failed stop leaves the row
`draining` for the stuck sweep to retry. A retirement frees a slot against the caps.
"""

from __future__ import annotations

import asyncio

from stoker.control import logs
from stoker.control.book import PendingRetire
from stoker.control.shared import Shared
from stoker.domain.errors import RuntimeFailure, StoreError
from stoker.domain.records import Claim, Worker
from stoker.domain.specs import PoolSpec
from stoker.domain.states import ClaimState, RetireReason, WorkerState
from stoker.policy.reaping import hot_idle_to_reclaim
from stoker.ports.runtime import Runtime, RuntimeObject
from stoker.ports.store import StoreReader


class Retirer:
    """Retirements and the sessions that end with their worker (failed, expired)."""

    def __init__(self, shared: Shared, *, reader: StoreReader, runtime: Runtime) -> None:
        self._book, self._lifecycle = shared.book, shared.lifecycle
        self._catalog, self._metrics = shared.catalog, shared.metrics
        self._reader = reader
        self._runtime = runtime
        #: Workers whose stop task is running.
        self._stopping: set[str] = set()

    async def retire(
        self, worker: Worker, reason: RetireReason | str, *, stop: bool = True
    ) -> bool:
        """Drain the worker (persisted), stop its runtime object, then mark it retired.

        False when the draining write did not happen (the worker keeps its old state).
        """
        if worker.state is WorkerState.RETIRED:
            return False
        draining: Worker | None
        if worker.state is WorkerState.DRAINING:
            if worker.id in self._stopping:
                return True  # its stop is under way
            # A draining row from a snapshot may have been retired since: read it again.
            try:
                draining = await self._reader.get_worker(worker.id)
            except StoreError:
                return False
            if draining is None or (draining.state, draining.epoch) != (
                WorkerState.DRAINING,
                worker.epoch,
            ):
                return False
        elif worker.state is WorkerState.SPAWNING and not worker.runtime_ref and not stop:
            # Nothing was created: free the slot at once.
            done = await self._lifecycle.move(worker, WorkerState.RETIRED, reason=str(reason))
            if done is None:
                self._retry_later(worker, str(reason), stop)
                return False
            self._retired(done)
            return True
        else:
            draining = await self._lifecycle.move(worker, WorkerState.DRAINING, reason=str(reason))
        if draining is None:
            self._retry_later(worker, str(reason), stop)
            return False
        self._book.retirements.settled(worker.id)
        self._book.remember(draining)
        self.stop_soon(draining, stop=stop)
        return True

    async def reclaim(self, pool: PoolSpec, org: str) -> Worker | None:
        """Make room in a pool at its cap for a claim of `org`: drain the least recently
        used hot_idle worker of another org above its floor (`min_hot_idle`), at once.

        The drain is a CAS on the row as read from the store (every replica's parked
        workers are there), so a worker another replica reserved for reuse meanwhile is
        left alone and the next one is tried. None when no worker may go.
        """
        try:
            parked = await self._reader.list_workers(pool=pool.name, states=(WorkerState.HOT_IDLE,))
        except StoreError:
            return None
        busy = self._book.in_flight()
        for w in hot_idle_to_reclaim(parked, org, self._catalog.min_hot_idle):
            if w.id in busy or w.id in self._stopping:
                continue
            draining = await self._lifecycle.move(
                w, WorkerState.DRAINING, reason=RetireReason.RECLAIMED.value
            )
            if draining is not None:
                self._book.remember(draining)
                self.stop_soon(draining, stop=True)
                return draining
        return None

    def is_stopping(self, worker_id: str) -> bool:
        """Whether the worker's stop runs now (its slot frees when it ends)."""
        return worker_id in self._stopping

    async def fail_session(self, worker: Worker, why: RetireReason) -> bool:
        """Fail a hot worker's claim and drain the worker in one write (never one alone).

        False when that write failed; the caller retries later.
        """
        claim = await self._reader.get_claim(worker.claim_id or "")
        if claim is None or claim.state is not ClaimState.BOUND:
            # The claim ended meanwhile: its worker left `hot` in the same write.
            fresh = await self._reader.get_worker(worker.id)
            return fresh is not None and await self.retire(fresh, why)
        return await self.end_session(
            claim, ClaimState.FAILED, why, claim_reason=f"worker_{why.value}"
        )

    async def end_session(
        self, claim: Claim, state: ClaimState, why: RetireReason, *, claim_reason: str
    ) -> bool:
        """End a bound claim as `state` and drain its worker in one write, then stop it.

        False when the write failed or missed (someone else ended the claim).
        """
        try:
            ended = await self._lifecycle.end_claim(
                claim,
                state=state,
                worker_to=WorkerState.DRAINING,
                claim_reason=claim_reason,
                reason=why.value,
            )
        except StoreError:
            return False
        if ended is None:
            return False
        self._book.remember(ended[1])
        self._metrics.claims.labels(claim.pool, claim.source.value, state.value).inc()
        self.stop_soon(ended[1], stop=True)
        return True

    def stop_soon(self, worker: Worker, *, stop: bool) -> None:
        """Stop and retire a draining worker in the background, once at a time per worker."""
        if worker.id in self._stopping:
            return
        self._stopping.add(worker.id)
        task = self._book.spawn_task(self._stop_and_retire(worker, stop=stop), f"stop:{worker.id}")
        task.add_done_callback(lambda _t: self._stopping.discard(worker.id))

    def stopping(self) -> int:
        """Workers whose stop runs now."""
        return len(self._stopping)

    async def settle_pending(self) -> None:
        """Retry the remembered retirements against a fresh read of their rows."""
        for worker_id in self._book.retirements.copy():
            await self._settle(worker_id)

    async def _settle(self, worker_id: str) -> None:
        pending = self._book.retirements.take(worker_id)
        if pending is None:
            return
        try:
            fresh = await self._reader.get_worker(worker_id)
        except StoreError:
            self._book.retirements.note(worker_id, pending)
            return
        if fresh is not None and (fresh.state, fresh.epoch) == (pending.state, pending.epoch):
            await self.retire(fresh, pending.reason, stop=pending.stop)

    def _retry_later(self, worker: Worker, reason: str, stop: bool) -> None:
        """Remember a retirement whose write did not happen, as decided on `worker`."""
        self._book.retirements.note(
            worker.id, PendingRetire(worker.state, worker.epoch, reason, stop)
        )

    async def _stop_and_retire(self, worker: Worker, *, stop: bool) -> None:
        grace = self._catalog.stop_grace_s(worker.pool)
        if stop:
            try:
                await self._runtime.stop(worker, grace)
            except RuntimeFailure as exc:
                logs.worker_event("stop_failed", worker, error=str(exc), level=logs.WARNING)
                return
        retired = await self._lifecycle.move(worker, WorkerState.RETIRED)
        if retired is None:
            self._retry_later(worker, worker.reason or "unknown", False)
        else:
            self._retired(retired)

    async def stop_leftovers(self, instance: str) -> int:
        """Stop, through the runtime alone, every object still running that this replica
        started or owns (known in its book), whatever the store does; returns how many.

        The last step of a shutdown with `--stop-workers`: the rows' retirements need the
        store, and a store that is down, locked or full must not leave workers behind.
        Objects whose stop is under way already (a retirement's) are left to it.
        """
        try:
            objects = await self._runtime.list_objects()
        except RuntimeFailure as exc:
            logs.event("leftover_scan_failed", error=str(exc), level=logs.WARNING)
            return 0
        ours = [
            o
            for o in objects
            if not o.stopping and (o.instance == instance or self._owns(o.worker_id, instance))
        ]
        stopped = await asyncio.gather(*(self._stop_leftover(o) for o in ours))
        return sum(stopped)

    def _owns(self, worker_id: str, instance: str) -> bool:
        known = self._book.known(worker_id)
        return known is not None and known.owner == instance

    async def _stop_leftover(self, obj: RuntimeObject) -> bool:
        grace = self._catalog.stop_grace_s(obj.pool)
        try:
            await self._runtime.stop(ghost(obj), grace)
        except RuntimeFailure as exc:
            logs.event("stop_failed", worker=obj.worker_id, error=str(exc), level=logs.WARNING)
            return False
        logs.event("leftover_stopped", worker=obj.worker_id, pool=obj.pool, level=logs.WARNING)
        return True

    def _retired(self, worker: Worker) -> None:
        self._book.remember(worker)
        self._lifecycle.retired(worker)
        self._book.ready_settled(worker.id)
        self._book.slot_freed(worker.pool, worker.org)


def ghost(obj: RuntimeObject) -> Worker:
    """A retired record of a runtime object, to stop it by (no row of its own is used)."""
    return Worker(
        id=obj.worker_id,
        pool=obj.pool,
        revision="",
        state=WorkerState.RETIRED,
        epoch=0,
        owner="",
        created_at=obj.created_at,
        updated_at=obj.created_at,
        runtime_ref=obj.ref,
    )
