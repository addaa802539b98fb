"""Spawning: reserve spawn slots in the store within caps and target, then create the
runtime objects, rate-limited by a token bucket sized to the runtime's API budget.

A failed create frees its slot at once (I4).
"""

from __future__ import annotations

from stoker.control import logs
from stoker.control.retiring import Retirer
from stoker.control.shared import Shared
from stoker.domain.errors import RuntimeFailure
from stoker.domain.records import Worker
from stoker.domain.specs import PoolSpec
from stoker.domain.states import RetireReason, WorkerState
from stoker.ports.clock import TokenBucket
from stoker.ports.runtime import Runtime
from stoker.ports.store import SpawnRequest, SpawnResult


class Spawner:
    """Neutral warm spawns for the janitor, cold spawns for one org's claim."""

    def __init__(self, shared: Shared, *, retirer: Retirer, runtime: Runtime) -> None:
        self._book, self._lifecycle = shared.book, shared.lifecycle
        self._catalog, self._metrics, self._ids = shared.catalog, shared.metrics, shared.ids
        self._retirer = retirer
        self._runtime = runtime
        settings = shared.settings
        self._bucket = TokenBucket(
            shared.clock, rate=settings.spawn_rate, burst=settings.spawn_burst
        )

    async def spawn_warm(self, pool: PoolSpec, count: int, *, target: int) -> int:
        """Reserve up to `count` neutral spawn slots (never beyond `target`) and spawn them."""
        req = SpawnRequest(
            pool=pool.name,
            revision=pool.revision,
            count=count,
            owner=self._book.instance_id,
            pool_cap=self._catalog.pool_cap(pool),
            target=target,
        )
        ids = [self._ids.worker() for _ in range(count)]
        result = await self._lifecycle.reserve_slots(req, ids)
        for worker in result.workers:
            self._book.remember(worker)
            self._metrics.spawns.labels(pool.name, "warm").inc()
            self._book.spawn_task(self.create(worker, pool), f"spawn:{worker.id}")
        return len(result.workers)

    async def reserve_cold_slot(self, pool: PoolSpec, org: str, org_cap: int) -> SpawnResult:
        """One spawn slot bound to `org` within the pool and org caps (not created yet)."""
        req = SpawnRequest(
            pool=pool.name,
            revision=pool.revision,
            count=1,
            owner=self._book.instance_id,
            org=org,
            pool_cap=self._catalog.pool_cap(pool),
            org_cap=org_cap,
        )
        result = await self._lifecycle.reserve_slots(req, [self._ids.worker()])
        for worker in result.workers:
            self._book.remember(worker)
            self._metrics.spawns.labels(pool.name, "cold").inc()
        return result

    async def create(self, worker: Worker, pool: PoolSpec) -> bool:
        """Create the runtime object of a spawning slot; a failure frees the slot at once."""
        await self._bucket.acquire()
        try:
            ref = await self._runtime.spawn(worker, pool)
        except RuntimeFailure as exc:
            self._metrics.spawn_failures.labels(pool.name, "create").inc()
            logs.worker_event("spawn_failed", worker, error=str(exc), level=logs.WARNING)
            self._book.drop_spawn_wait(worker.id)
            await self._retirer.retire(worker, RetireReason.SPAWN_FAILURE, stop=False)
            return False
        # Kept until written: if this write fails (or readiness overtakes it), the write
        # that makes the worker ready carries the ref instead.
        self._book.keep_unsaved_ref(worker.id, ref)
        current = self._book.known(worker.id) or worker
        if current.state is WorkerState.SPAWNING and current.epoch == worker.epoch:
            recorded = await self._lifecycle.move(
                current, WorkerState.SPAWNING, runtime_ref=dict(ref)
            )
            if recorded is not None:
                self._book.ref_saved(worker.id)
                self._book.remember(recorded)
        return True
