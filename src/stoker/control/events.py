"""Runtime events: readiness and loss reported by the runtime become fenced transitions.

A fact is noted in the book first and forgotten once persisted, so a failed write is
retried by the next pass (persist before mutate).
"""

from __future__ import annotations

from stoker.control.retiring import Retirer
from stoker.control.shared import Shared
from stoker.control.spawning import Spawner
from stoker.domain.errors import RuntimeFailure, StoreError
from stoker.domain.states import RetireReason, WorkerState
from stoker.ports.store import StoreReader


class RuntimeEvents:
    """The runtime's listener (`RuntimeListener`) for this replica."""

    def __init__(
        self, shared: Shared, *, retirer: Retirer, spawner: Spawner, reader: StoreReader
    ) -> None:
        self._book, self._lifecycle, self._metrics = shared.book, shared.lifecycle, shared.metrics
        self._clock = shared.clock
        self._ledger = shared.ledger
        self._retirer = retirer
        self._spawner = spawner
        self._reader = reader
        #: How each lost worker whose loss is not yet settled ended, when the runtime said.
        self._details: dict[str, str] = {}

    def worker_ready(self, worker_id: str, endpoint: str) -> None:
        """Runtime event: the worker answers its readiness probe."""
        known = self._book.known(worker_id)
        pool = ""
        if known is not None:
            self._spawner.spawn_ready(known)
            pool = known.pool
            if known.state is WorkerState.SPAWNING:
                started = self._book.started_at(worker_id)
                since = known.created_at if started is None else started
                self._spawner.observe_ready(known.pool, self._clock.now() - since)
                if self._ledger is not None:
                    self._ledger.spawn_ready(known, self._clock.now() - since)
        if self._book.resolve_ready(worker_id, endpoint, pool=pool):
            return  # the cold claim waiting for it first takes it from here
        self._book.ready.note(worker_id, endpoint)
        self._book.spawn_task(self.settle_ready(worker_id), f"ready:{worker_id}")

    def worker_lost(self, worker_id: str, reason: str, detail: str | None = None) -> None:
        """Runtime event: the worker's process or pod is gone (`detail`: how, when the
        runtime can tell; the cause a failed spawn shows)."""
        known = self._book.known(worker_id)
        if detail:
            self._details[worker_id] = detail
        self._book.resolve_lost(
            worker_id,
            RuntimeFailure(_lost_before_ready(worker_id, reason, detail)),
            pool=known.pool if known is not None else "",
        )
        self._book.lost.note(worker_id, reason)
        self._book.spawn_task(self.settle_lost(worker_id), f"lost:{worker_id}")

    def worker_stalled(self, worker_id: str, stage: str, error: str) -> None:
        """Runtime event: a spawning worker of this replica cannot start as it is (no node
        fits it, its image cannot be pulled). A spawn failure of its revision: counted,
        backing the pool off and shown as its `last_spawn_error`; the worker itself stays
        until it starts or the stuck sweep retires it (`timeouts.pending_s`)."""
        known = self._book.known(worker_id)
        if known is None or known.state is not WorkerState.SPAWNING:
            return
        self._metrics.spawn_failures.labels(known.pool, stage).inc()
        self._spawner.spawn_failed(known.pool, known.revision, error, waiting=worker_id)

    def worker_gone(self, worker_id: str, at: float) -> None:
        """Runtime event: the object of a worker this replica stopped holds its node share
        no more (a pod ended or left the cluster after its delete). The worker was retired
        already; the ledger counts its terminating time up to here."""
        if self._ledger is not None:
            self._ledger.terminated(worker_id, at)

    async def settle_pending(self) -> None:
        """Retry the facts whose write failed earlier: losses first, then readiness."""
        for worker_id in self._book.lost.copy():
            await self.settle_lost(worker_id)
        for worker_id in self._book.ready.copy():
            await self.settle_ready(worker_id)

    async def settle_ready(self, worker_id: str) -> None:
        """Persist a readiness fact: a neutral spawning worker becomes warm."""
        book = self._book
        endpoint = book.ready.get(worker_id)
        if endpoint is None:
            return
        worker = book.known(worker_id) or await self._reader.get_worker(worker_id)
        if (
            worker is None
            or worker.state is not WorkerState.SPAWNING
            or worker.owner != book.instance_id
        ):
            book.ready_settled(worker_id)
            return
        warm = await self._lifecycle.move(
            worker,
            WorkerState.WARM,
            **book.with_unsaved_ref(worker_id, endpoint=endpoint, org=None),
        )
        if warm is None:
            fresh = await book.refresh(worker_id)
            if (
                fresh is None
                or fresh.state is not WorkerState.SPAWNING
                or fresh.owner != book.instance_id
            ):
                book.ready_settled(worker_id)  # someone else moved it on
            return
        book.ready_settled(worker_id)
        book.offer_warm(book.remember(warm))

    async def settle_lost(self, worker_id: str) -> None:
        """Persist a loss: fail the claim of a hot worker, then retire the worker."""
        reason = self._book.lost.get(worker_id)
        if reason is None:
            return
        try:
            worker = await self._reader.get_worker(worker_id)
        except StoreError:
            return
        if worker is None or worker.state is WorkerState.RETIRED:
            self._lost_settled(worker_id)
            return
        why = RetireReason.EVICTED if reason == "evicted" else RetireReason.LOST
        if worker.state is WorkerState.HOT and worker.claim_id:
            # Never silently swapped (I6): the session fails with a clear reason, in the
            # same write that drains the worker. A failed write is retried next pass.
            if await self._retirer.fail_session(worker, why):
                self._lost_settled(worker_id)
            return
        if worker.state is WorkerState.SPAWNING:
            why = RetireReason.SPAWN_FAILURE
            self._metrics.spawn_failures.labels(worker.pool, reason).inc()
            detail = self._details.get(worker_id)
            self._spawner.spawn_failed(
                worker.pool, worker.revision, _lost_before_ready(worker_id, reason, detail)
            )
        stop = worker.state is not WorkerState.DRAINING
        if await self._retirer.retire(worker, why, stop=stop):
            self._lost_settled(worker_id)

    def _lost_settled(self, worker_id: str) -> None:
        """The loss is in the store: forget it."""
        self._book.lost.settled(worker_id)
        self._details.pop(worker_id, None)


def _lost_before_ready(worker_id: str, reason: str, detail: str | None) -> str:
    """What a worker lost before it got ready failed with, and how, when known."""
    lost = f"worker {worker_id} {reason} before ready"
    return f"{lost}: {detail}" if detail else lost
