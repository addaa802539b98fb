"""What a policy's replicas report to the invariant checker, and the wrappers that report it.

Each replica's store is an `ObservedStore` over the one store every replica shares: it
passes every call through unchanged and reports each successful write of a worker or a
claim to the `Observer`, with the replica that made it and the row as written. Each
replica's runtime is an `ObservedRuntime`, which also measures how long its pods took to
start. Neither changes what the replica does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from stoker.adapters.runtime_kubernetes import KubernetesRuntime
from stoker.domain.records import Claim, Worker
from stoker.domain.specs import PoolSpec
from stoker.domain.states import WorkerState
from stoker.ports.clock import Clock
from stoker.ports.runtime import RuntimeListener
from stoker.ports.store import ReserveResult, SpawnRequest, SpawnResult, Store


class Observer(Protocol):
    """What the replicas' wrappers report to (the invariant checker)."""

    def worker_written(self, replica: int, before: WorkerState | None, worker: Worker) -> None:
        """A write of a worker row succeeded: `worker` as written, `before` the state it
        had (None for a new row; the same state for an update that kept it)."""
        ...

    def claim_bound(self, replica: int, claim: Claim) -> None:
        """A claim was bound to its worker (and stored)."""
        ...

    def claim_renewed(self, replica: int, claim: Claim) -> None:
        """A bound claim's lease was extended (`claim` as stored now)."""
        ...

    def claim_ended(self, replica: int, claim: Claim) -> None:
        """A bound claim was ended (released, expired or failed)."""
        ...

    def spawn_reserved(self, replica: int, req: SpawnRequest, reserved: int) -> None:
        """Spawn slots were reserved (the store already holds them)."""
        ...

    def activation(self, worker_id: str, org: str, epoch: int) -> None:
        """A worker received an activation."""
        ...

    def leader_changed(self, replica: int, leading: bool) -> None:
        """A replica started or stopped leading."""
        ...


class ObservedStore:
    """One replica's handle on the shared store (see the module docstring).

    Every write of a worker or a claim takes `write_latency` (a network round trip and a
    commit) and is reported once the store acknowledged it; every other call, reads
    included, is the shared store's own method. `open` opens the shared
    store once for all; `close` leaves it open: the runner closes it once every replica
    has stopped.
    """

    def __init__(
        self,
        inner: Store,
        *,
        replica: int,
        observer: Observer,
        write_latency: Callable[[], float] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.inner = inner
        self.replica = replica
        self._observer = observer
        self._latency = write_latency
        self._clock = clock

    async def _round_trip(self) -> None:
        """A write's trip to the database and back (`write_latency`), before it lands."""
        if self._latency is not None and self._clock is not None:
            await self._clock.sleep(self._latency())

    def __getattr__(self, name: str) -> Any:
        # Only for what this class does not define: the store's own bound method, kept
        # on the instance so the next call finds it at once.
        value = getattr(self.inner, name)
        setattr(self, name, value)
        return value

    async def open(self) -> None:
        """Open the shared store (a no-op once open)."""
        await self.inner.open()

    async def close(self) -> None:
        """Nothing: the store outlives every replica."""

    def _written(self, before: WorkerState | None, worker: Worker | None) -> None:
        if worker is not None:
            self._observer.worker_written(self.replica, before, worker)

    async def reserve_spawn_slots(
        self, req: SpawnRequest, ids: Sequence[str], now: float
    ) -> SpawnResult:
        """As `Store.reserve_spawn_slots`; each new row and the reservation reported."""
        await self._round_trip()
        result = await self.inner.reserve_spawn_slots(req, ids, now)
        for worker in result.workers:
            self._written(None, worker)
        self._observer.spawn_reserved(self.replica, req, len(result.workers))
        return result

    async def transition(self, worker_id: str, **cas: Any) -> Worker | None:
        """As `Store.transition`, reported."""
        await self._round_trip()
        worker = await self.inner.transition(worker_id, **cas)
        self._written(cas["expect"], worker)
        return worker

    async def reserve(self, worker_id: str, **cas: Any) -> ReserveResult:
        """As `Store.reserve`, reported."""
        await self._round_trip()
        result = await self.inner.reserve(worker_id, **cas)
        self._written(cas["expect"], result.worker)
        return result

    async def reserve_any(self, pool: str, revision: str, **cas: Any) -> ReserveResult:
        """As `Store.reserve_any`, reported."""
        await self._round_trip()
        result = await self.inner.reserve_any(pool, revision, **cas)
        self._written(cas["expect"], result.worker)
        return result

    async def bind(
        self, worker_id: str, *, epoch: int, version: int, claim: Claim, now: float
    ) -> Worker | None:
        """As `Store.bind`; the worker's move to hot and the claim reported."""
        await self._round_trip()
        worker = await self.inner.bind(
            worker_id, epoch=epoch, version=version, claim=claim, now=now
        )
        if worker is not None:
            self._observer.claim_bound(self.replica, claim)
        self._written(WorkerState.ACTIVATING, worker)
        return worker

    async def renew_claim(self, claim_id: str, *, expires_at: float, now: float) -> Claim | None:
        """As `Store.renew_claim`, reported."""
        await self._round_trip()
        claim = await self.inner.renew_claim(claim_id, expires_at=expires_at, now=now)
        if claim is not None:
            self._observer.claim_renewed(self.replica, claim)
        return claim

    async def end_claim(self, claim_id: str, **end: Any) -> tuple[Claim, Worker] | None:
        """As `Store.end_claim`; the claim's end and the worker's move reported."""
        await self._round_trip()
        result = await self.inner.end_claim(claim_id, **end)
        if result is not None:
            self._observer.claim_ended(self.replica, result[0])
            self._written(WorkerState.HOT, result[1])
        return result


class ObservedRuntime:
    """One replica's Kubernetes runtime, passed through (like `ObservedStore`), that also
    measures pod starts (spawn requested to ready) of the workers this replica spawned.
    The baselines subclass it to change one behaviour."""

    def __init__(self, inner: KubernetesRuntime, *, clock: Clock) -> None:
        self.inner = inner
        self._clock = clock
        self._listener: RuntimeListener | None = None
        self._spawned_at: dict[str, float] = {}
        #: Seconds from `spawn` to readiness, of every worker this replica spawned.
        self.pod_starts: list[float] = []

    def __getattr__(self, name: str) -> Any:
        # As in `ObservedStore`: what this class does not define is the runtime's own.
        value = getattr(self.inner, name)
        setattr(self, name, value)
        return value

    def subscribe(self, listener: RuntimeListener) -> None:
        """Receive the runtime's events first (see `worker_ready`, `worker_lost`)."""
        self._listener = listener
        self.inner.subscribe(self)

    def worker_ready(self, worker_id: str, endpoint: str) -> None:
        """Measure the pod start, then tell the pool manager."""
        started = self._spawned_at.pop(worker_id, None)
        if started is not None:
            self.pod_starts.append(self._clock.monotonic() - started)
        self._settled(worker_id)
        if self._listener is not None:
            self._listener.worker_ready(worker_id, endpoint)

    def worker_lost(self, worker_id: str, reason: str, detail: str | None = None) -> None:
        """Tell the pool manager."""
        self._spawned_at.pop(worker_id, None)
        self._settled(worker_id)
        if self._listener is not None:
            self._listener.worker_lost(worker_id, reason, detail)

    def worker_stalled(self, worker_id: str, stage: str, error: str) -> None:
        """Tell the pool manager."""
        if self._listener is not None:
            self._listener.worker_stalled(worker_id, stage, error)

    def worker_gone(self, worker_id: str, at: float) -> None:
        """Tell the pool manager."""
        if self._listener is not None:
            self._listener.worker_gone(worker_id, at)

    def _settled(self, worker_id: str) -> None:
        """Hook: the worker's spawn is over (ready, gone or stopped)."""

    async def spawn(self, worker: Worker, pool: PoolSpec) -> Mapping[str, Any]:
        """As `Runtime.spawn`, timed."""
        self._spawned_at[worker.id] = self._clock.monotonic()
        try:
            return await self.inner.spawn(worker, pool)
        except BaseException:
            self._spawned_at.pop(worker.id, None)
            raise

    async def stop(self, worker: Worker, grace_s: float) -> None:
        """As `Runtime.stop`; the worker's spawn, if still going, is over."""
        self._spawned_at.pop(worker.id, None)
        self._settled(worker.id)
        await self.inner.stop(worker, grace_s)
