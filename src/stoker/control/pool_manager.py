"""Where a claim enters: serves claims reuse -> warm -> cold and turns runtime events into
fenced transitions.

The in-memory queues (a ready queue per pool revision, a hot_idle queue per pool and org)
are fed by runtime events and give O(1) picks; the store's compare-and-set is the
authority, so a stale queue entry costs one missed CAS, never a double assignment. An
in-flight set keeps this replica from handing out a worker it is already handing out.

The work of binding a claim runs in a task of its own, so a requester that gives up
(timeout, disconnect) never interrupts a transition half-way: a worker that becomes ready
after its requester left goes back to `warm` if it was never activated, else to that
org's `hot_idle`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stoker.control import logs
from stoker.control.ids import Ids
from stoker.control.lifecycle import Lifecycle
from stoker.control.metrics import Metrics
from stoker.domain.errors import (
    CapacityError,
    ClaimConflict,
    InvalidRequest,
    NotFound,
    OrgCapError,
    RuntimeFailure,
    StokerError,
    StoreError,
    Unavailable,
)
from stoker.domain.records import Claim, ClaimRequest, Worker
from stoker.domain.specs import Activation, OrgSpec, PlaneSettings, PoolSpec
from stoker.domain.states import (
    ClaimMode,
    ClaimSource,
    ClaimState,
    MissReason,
    RetireReason,
    Reuse,
    WorkerState,
)
from stoker.policy.reaping import resolve_ttl
from stoker.policy.scaling import effective_cap
from stoker.ports.activator import ActivationPayload, Activator
from stoker.ports.clock import Clock, TokenBucket
from stoker.ports.runtime import Runtime
from stoker.ports.store import SpawnRequest, Store

S = WorkerState
#: Deadlines count as reached this close to them: on a virtual clock a float-rounding
#: residue of 1e-12 s would otherwise be a timer that never advances time.
_EPS = 1e-6


@dataclass(eq=False)
class _Attempt:
    """One claim being served; outlives its requester if the requester gives up."""

    req: ClaimRequest
    pool: PoolSpec
    org_cap: int
    started: float
    deadline: float
    result: asyncio.Future[Claim]
    abandoned: bool = False
    #: Why the last try found nothing, reported if the deadline passes.
    blocked_by: MissReason | None = None
    missed: bool = False
    wakeup: asyncio.Future[None] | None = field(default=None, repr=False)

    def gone(self) -> bool:
        """True once the requester gave up (a method, so checks are never narrowed away)."""
        return self.abandoned

    def left(self, now: float) -> float:
        """Seconds left before the deadline (0 when reached)."""
        remaining = self.deadline - now
        return remaining if remaining > _EPS else 0.0

    def wake(self) -> None:
        if self.wakeup is not None and not self.wakeup.done():
            self.wakeup.set_result(None)


def _consume(future: asyncio.Future[Claim]) -> None:
    if not future.cancelled():
        future.exception()


class PoolManager:
    """Claims, releases, renewals and runtime events of one control-plane replica."""

    def __init__(
        self,
        *,
        store: Store,
        runtime: Runtime,
        activator: Activator,
        clock: Clock,
        metrics: Metrics,
        pools: Mapping[str, PoolSpec],
        orgs: Mapping[str, OrgSpec],
        settings: PlaneSettings,
        instance_id: str,
        ids: Ids,
    ) -> None:
        self.store = store
        self.runtime = runtime
        self.activator = activator
        self.clock = clock
        self.metrics = metrics
        self.pools = dict(pools)
        self.orgs = dict(orgs)
        self.settings = settings
        self.instance_id = instance_id
        self.ids = ids
        self.lifecycle = Lifecycle(store, clock, metrics)
        self.spawn_bucket = TokenBucket(clock, rate=settings.spawn_rate, burst=settings.spawn_burst)
        #: Last persisted record of every worker this replica owns.
        self.known: dict[str, Worker] = {}
        self._ready: dict[tuple[str, str], deque[str]] = defaultdict(deque)
        self._idle: dict[tuple[str, str], deque[str]] = defaultdict(deque)
        self._in_flight: set[str] = set()
        #: Cold spawns whose claim waits for readiness: worker id -> endpoint future.
        self._spawn_waits: dict[str, asyncio.Future[str]] = {}
        #: Facts from the runtime not yet persisted (a failed write is retried by the next pass).
        self.pending_ready: dict[str, str] = {}
        self.pending_lost: dict[str, str] = {}
        #: Retirements whose write failed: (state, epoch) they were decided on, reason, stop.
        self.pending_retire: dict[str, tuple[WorkerState, int, str, bool]] = {}
        #: Runtime refs of spawns not persisted yet. The write that takes a worker out of
        #: `spawning` carries its ref, so that no worker becomes claimable without the ref
        #: another replica needs to adopt and to stop its process.
        self.unsaved_refs: dict[str, dict[str, Any]] = {}
        #: Workers whose stop task is running.
        self._stopping: set[str] = set()
        self._warm_waiters: dict[str, deque[_Attempt]] = defaultdict(deque)
        self._cap_waiters: dict[tuple[str, str], list[_Attempt]] = defaultdict(list)
        #: Cumulative misses per pool (the demand signal this replica publishes).
        self.misses_total: dict[str, int] = dict.fromkeys(self.pools, 0)
        self._demand_flush: asyncio.Task[None] | None = None
        #: The demand rows last written, and when (see `publish_demand`).
        self._published: tuple[dict[str, tuple[int, int]], float] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._claims_in_flight = 0
        self.closing = False

    # -- helpers ----------------------------------------------------------------------------

    def pool(self, name: str) -> PoolSpec:
        """The pool spec, or NotFound."""
        try:
            return self.pools[name]
        except KeyError:
            raise NotFound(f"unknown pool {name!r}") from None

    def pool_cap(self, pool: PoolSpec) -> int:
        """The pool cap in force (0 = unbounded)."""
        return effective_cap(pool.max_workers, self.runtime.derived_cap(pool))

    def org_cap(self, pool: PoolSpec, org: str) -> int:
        """The org's cap in the pool (0 = unbounded)."""
        spec = self.orgs.get(org)
        if spec is not None and spec.max_workers is not None:
            return spec.max_workers
        return pool.max_workers_per_org

    def min_hot_idle(self, pool_name: str, org: str) -> int:
        """The org's hot_idle floor in the pool (org -> pool)."""
        spec = self.orgs.get(org)
        if spec is not None and spec.min_hot_idle is not None:
            return spec.min_hot_idle
        pool = self.pools.get(pool_name)
        return pool.min_hot_idle if pool else 0

    def spawn_task(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        """Run `coro` in the background, keeping a reference until it ends."""
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logs.event("task_failed", task=task.get_name(), error=repr(exc), level=logs.ERROR)

    def remember(self, worker: Worker) -> Worker:
        """Record the last persisted state of a worker this replica owns."""
        if worker.state is S.RETIRED or worker.owner != self.instance_id:
            self.known.pop(worker.id, None)
        else:
            self.known[worker.id] = worker
        return worker

    async def refresh(self, worker_id: str) -> Worker | None:
        """Re-read a worker after a missed CAS: another replica may have taken it over."""
        try:
            fresh = await self.store.get_worker(worker_id)
        except StoreError:
            return None
        if fresh is None:
            self.known.pop(worker_id, None)
            return None
        return self.remember(fresh)

    def waiting(self, pool: str) -> int:
        """Claims of `pool` queued for a warm worker (part of demand)."""
        return sum(1 for a in self._warm_waiters.get(pool, ()) if not a.abandoned)

    def demand_snapshot(self) -> dict[str, tuple[int, int]]:
        """(cumulative misses, claims waiting now) per pool."""
        return {name: (self.misses_total[name], self.waiting(name)) for name in self.pools}

    def publish_demand_soon(self) -> None:
        """Publish demand once the current burst of claims has been seen (coalesced)."""
        if self._demand_flush is None or self._demand_flush.done():
            self._demand_flush = self.spawn_task(self.publish_demand(), "demand")

    async def publish_demand(self) -> None:
        """Write this replica's demand rows so the leader's janitor sees them."""
        await asyncio.sleep(0)  # let the claims of the same burst record their misses first
        snapshot, now = self.demand_snapshot(), self.clock.now()
        if (
            self._published is not None
            and self._published[0] == snapshot
            and now - self._published[1] < self.settings.instance_expiry_s / 2
        ):
            # Nothing new, and the rows stay fresh (younger than the expiry) until the
            # next pass rewrites them: no write.
            return
        try:
            await self.store.record_demand(self.instance_id, snapshot, now=now)
            self._published = (snapshot, now)
        except StoreError as exc:
            # The next miss or pass publishes again: counters are cumulative, nothing is lost.
            logs.event("demand_publish_failed", error=str(exc), level=logs.WARNING)

    def in_flight(self) -> frozenset[str]:
        """Workers this replica is handing out right now (the sweeps leave them alone)."""
        return frozenset(self._in_flight)

    # -- runtime events ---------------------------------------------------------------------

    def worker_ready(self, worker_id: str, endpoint: str) -> None:
        """Runtime event: the worker answers its readiness probe."""
        waiter = self._spawn_waits.pop(worker_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(endpoint)
            return
        self.pending_ready[worker_id] = endpoint
        self.spawn_task(self.settle_ready(worker_id), f"ready:{worker_id}")

    def worker_lost(self, worker_id: str, reason: str) -> None:
        """Runtime event: the worker's process or pod is gone."""
        waiter = self._spawn_waits.pop(worker_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(RuntimeFailure(f"worker {worker_id} {reason} before ready"))
        self.pending_lost[worker_id] = reason
        self.spawn_task(self.settle_lost(worker_id), f"lost:{worker_id}")

    async def settle_ready(self, worker_id: str) -> None:
        """Persist a readiness fact: a neutral spawning worker becomes warm."""
        endpoint = self.pending_ready.get(worker_id)
        if endpoint is None:
            return
        worker = self.known.get(worker_id) or await self.store.get_worker(worker_id)
        if worker is None or worker.state is not S.SPAWNING or worker.owner != self.instance_id:
            self.pending_ready.pop(worker_id, None)
            self.unsaved_refs.pop(worker_id, None)
            return
        warm = await self.lifecycle.move(
            worker, S.WARM, **self._with_unsaved_ref(worker_id, endpoint=endpoint, org=None)
        )
        if warm is None:
            fresh = await self.refresh(worker_id)
            if fresh is None or fresh.state is not S.SPAWNING or fresh.owner != self.instance_id:
                self.pending_ready.pop(worker_id, None)  # someone else moved it on
                self.unsaved_refs.pop(worker_id, None)
            return
        self.pending_ready.pop(worker_id, None)
        self.unsaved_refs.pop(worker_id, None)
        self.offer_warm(self.remember(warm))

    def _with_unsaved_ref(self, worker_id: str, **changes: Any) -> dict[str, Any]:
        """`changes` plus the worker's runtime ref if its own write has not succeeded."""
        ref = self.unsaved_refs.get(worker_id)
        return changes if ref is None else {**changes, "runtime_ref": ref}

    async def settle_lost(self, worker_id: str) -> None:
        """Persist a loss: fail the claim of a hot worker, then retire the worker."""
        reason = self.pending_lost.get(worker_id)
        if reason is None:
            return
        try:
            worker = await self.store.get_worker(worker_id)
        except StoreError:
            return
        if worker is None or worker.state is S.RETIRED:
            self.pending_lost.pop(worker_id, None)
            return
        why = RetireReason.EVICTED if reason == "evicted" else RetireReason.LOST
        if worker.state is S.HOT and worker.claim_id:
            # Never silently swapped (I6): the session fails with a clear reason, in the
            # same write that drains the worker. A failed write is retried next pass.
            if await self.fail_session(worker, why):
                self.pending_lost.pop(worker_id, None)
            return
        if worker.state is S.SPAWNING:
            why = RetireReason.SPAWN_FAILURE
            self.metrics.spawn_failures.labels(worker.pool, reason).inc()
        if await self.retire(worker, why, stop=worker.state is not S.DRAINING):
            self.pending_lost.pop(worker_id, None)

    async def fail_session(self, worker: Worker, why: RetireReason) -> bool:
        """Fail a hot worker's claim and drain the worker in one write (never one alone).

        False when that write failed; the caller retries later.
        """
        claim = await self.store.get_claim(worker.claim_id or "")
        if claim is None or claim.state is not ClaimState.BOUND:
            # The claim ended meanwhile: its worker left `hot` in the same write.
            fresh = await self.store.get_worker(worker.id)
            return fresh is not None and await self.retire(fresh, why)
        try:
            ended = await self.lifecycle.end_claim(
                claim,
                state=ClaimState.FAILED,
                worker_to=S.DRAINING,
                claim_reason=f"worker_{why.value}",
                reason=why.value,
            )
        except StoreError:
            return False
        if ended is None:
            return False
        self.remember(ended[1])
        self.metrics.claims.labels(claim.pool, claim.source.value, "failed").inc()
        self._stop_soon(ended[1], stop=True)
        return True

    def offer_warm(self, worker: Worker) -> None:
        """Queue a warm worker and wake the first claim waiting for one."""
        self._ready[(worker.pool, worker.revision)].append(worker.id)
        self._wake_warm_waiter(worker.pool)

    def offer_hot_idle(self, worker: Worker) -> None:
        """Queue a hot_idle worker for its org and wake that org's waiting claims."""
        if worker.org is None:
            return
        self._idle[(worker.pool, worker.org)].append(worker.id)
        self._wake_cap_waiters(worker.pool, worker.org)

    def _wake_warm_waiter(self, pool: str) -> None:
        waiters = self._warm_waiters.get(pool)
        while waiters:
            attempt = waiters.popleft()
            if not attempt.abandoned:
                attempt.wake()
                return

    def _wake_cap_waiters(self, pool: str, org: str | None) -> None:
        if org is None:
            return
        for attempt in self._cap_waiters.pop((pool, org), []):
            attempt.wake()

    def _wake_pool_cap_waiters(self, pool: str) -> None:
        for (p, _org), attempts in list(self._cap_waiters.items()):
            if p == pool:
                for attempt in attempts:
                    attempt.wake()
        self._wake_warm_waiter(pool)

    # -- retiring ---------------------------------------------------------------------------

    async def retire(
        self, worker: Worker, reason: RetireReason | str, *, stop: bool = True
    ) -> bool:
        """Drain the worker (persisted), stop its runtime object, then mark it retired.

        False when the draining write did not happen (the worker keeps its old state).
        The stop runs in the background; a failed stop leaves the row `draining` for the
        stuck sweep to retry.
        """
        if worker.state is S.RETIRED:
            return False
        if worker.state is S.DRAINING:
            if worker.id in self._stopping:
                return True  # its stop is under way
            # A draining row from a snapshot may have been retired since: read it again.
            try:
                draining: Worker | None = await self.store.get_worker(worker.id)
            except StoreError:
                return False
            if draining is None or (draining.state, draining.epoch) != (S.DRAINING, worker.epoch):
                return False
        elif worker.state is S.SPAWNING and not worker.runtime_ref and not stop:
            # Nothing was created: free the slot at once.
            done = await self.lifecycle.move(worker, S.RETIRED, reason=str(reason))
            if done is None:
                self._retry_retire(worker, reason, stop)
                return False
            self._retired(done)
            return True
        else:
            draining = await self.lifecycle.move(worker, S.DRAINING, reason=str(reason))
        if draining is None:
            self._retry_retire(worker, reason, stop)
            return False
        self.pending_retire.pop(worker.id, None)
        self.remember(draining)
        self._stop_soon(draining, stop=stop)
        return True

    def _stop_soon(self, worker: Worker, *, stop: bool) -> None:
        """Stop and retire a draining worker in the background, once at a time per worker."""
        if worker.id in self._stopping:
            return
        self._stopping.add(worker.id)
        task = self.spawn_task(self._stop_and_retire(worker, stop=stop), f"stop:{worker.id}")
        task.add_done_callback(lambda _t: self._stopping.discard(worker.id))

    def _retry_retire(self, worker: Worker, reason: RetireReason | str, stop: bool) -> None:
        """Remember a retirement whose write did not happen; the next pass retries it if
        the row is still as it was (a fence miss means someone else moved it: then not)."""
        self.pending_retire[worker.id] = (worker.state, worker.epoch, str(reason), stop)

    async def settle_retire(self, worker_id: str) -> None:
        """Retry one remembered retirement against a fresh read of the row."""
        pending = self.pending_retire.pop(worker_id, None)
        if pending is None:
            return
        state, epoch, reason, stop = pending
        try:
            fresh = await self.store.get_worker(worker_id)
        except StoreError:
            self.pending_retire[worker_id] = pending
            return
        if fresh is not None and (fresh.state, fresh.epoch) == (state, epoch):
            await self.retire(fresh, reason, stop=stop)

    async def _stop_and_retire(self, worker: Worker, *, stop: bool) -> None:
        pool = self.pools.get(worker.pool)
        grace = pool.timeouts.stop_grace_s if pool else 10.0
        if stop:
            try:
                await self.runtime.stop(worker, grace)
            except RuntimeFailure as exc:
                logs.worker_event("stop_failed", worker, error=str(exc), level=logs.WARNING)
                return
        retired = await self.lifecycle.move(worker, S.RETIRED)
        if retired is None:
            self._retry_retire(worker, worker.reason or "unknown", False)
        else:
            self._retired(retired)

    def _retired(self, worker: Worker) -> None:
        self.remember(worker)
        self.lifecycle.retired(worker)
        self.pending_ready.pop(worker.id, None)
        self.unsaved_refs.pop(worker.id, None)
        # A retirement frees a slot against the caps.
        self._wake_cap_waiters(worker.pool, worker.org)
        self._wake_pool_cap_waiters(worker.pool)

    # -- spawning ---------------------------------------------------------------------------

    async def spawn_warm(self, pool: PoolSpec, count: int, *, target: int) -> int:
        """Reserve up to `count` neutral spawn slots (never beyond `target`) and spawn them."""
        req = SpawnRequest(
            pool=pool.name,
            revision=pool.revision,
            count=count,
            owner=self.instance_id,
            pool_cap=self.pool_cap(pool),
            target=target,
        )
        result = await self.lifecycle.reserve_slots(req, [self.ids.worker() for _ in range(count)])
        for worker in result.workers:
            self.remember(worker)
            self.metrics.spawns.labels(pool.name, "warm").inc()
            self.spawn_task(self._create(worker, pool), f"spawn:{worker.id}")
        return len(result.workers)

    async def _create(self, worker: Worker, pool: PoolSpec) -> bool:
        """Create the runtime object of a spawning slot; a failure frees the slot at once."""
        await self.spawn_bucket.acquire()
        try:
            ref = await self.runtime.spawn(worker, pool)
        except RuntimeFailure as exc:
            self.metrics.spawn_failures.labels(pool.name, "create").inc()
            logs.worker_event("spawn_failed", worker, error=str(exc), level=logs.WARNING)
            self._spawn_waits.pop(worker.id, None)
            await self.retire(worker, RetireReason.SPAWN_FAILURE, stop=False)
            return False
        # Kept until written: if this write fails (or readiness overtakes it), the write
        # that makes the worker ready carries the ref instead.
        self.unsaved_refs[worker.id] = dict(ref)
        current = self.known.get(worker.id, worker)
        if current.state is S.SPAWNING and current.epoch == worker.epoch:
            recorded = await self.lifecycle.move(current, S.SPAWNING, runtime_ref=dict(ref))
            if recorded is not None:
                self.unsaved_refs.pop(worker.id, None)
                self.remember(recorded)
        return True

    # -- claims -----------------------------------------------------------------------------

    async def claim(self, req: ClaimRequest) -> Claim:
        """Serve a claim: reuse -> warm -> cold by its mode, within its timeout.

        Raises `OrgCapError` or `CapacityError` when no worker came in time, `NotFound` for
        an unknown pool, `Unavailable` while shutting down.
        """
        pool = self.pool(req.pool)
        if self.closing:
            raise Unavailable("control plane is shutting down")
        if not req.org:
            raise InvalidRequest("org must not be empty")
        timeout = pool.claim_timeout_s if req.timeout_s is None else req.timeout_s
        loop = asyncio.get_running_loop()
        now = self.clock.monotonic()
        attempt = _Attempt(
            req=req,
            pool=pool,
            org_cap=self.org_cap(pool, req.org),
            started=now,
            deadline=now + timeout,
            result=loop.create_future(),
        )
        # An abandoned attempt's outcome has nobody to read it: mark it read.
        attempt.result.add_done_callback(_consume)
        self._claims_in_flight += 1
        self.spawn_task(self._serve(attempt), f"claim:{req.org}")
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(attempt.result)
        except TimeoutError:
            if attempt.result.done() and not attempt.result.exception():
                return attempt.result.result()
            attempt.abandoned = True
            attempt.wake()
            raise self._timeout_error(attempt) from None
        except asyncio.CancelledError:
            attempt.abandoned = True
            attempt.wake()
            if attempt.result.done() and not attempt.result.exception():
                # Bound just as the requester left: give the worker back at once.
                self.spawn_task(self.release(attempt.result.result().id), "release:abandoned")
            raise
        finally:
            self._claims_in_flight -= 1

    def _timeout_error(self, attempt: _Attempt) -> StokerError:
        pool = attempt.pool.name
        if attempt.blocked_by is MissReason.ORG_CAP:
            self.metrics.claims.labels(pool, "none", "org_cap").inc()
            return OrgCapError(
                f"org {attempt.req.org!r} holds its cap of {attempt.org_cap} workers in pool "
                f"{pool!r}",
                retry_after=self.settings.org_cap_retry_after_s,
            )
        reason = "pool_cap" if attempt.blocked_by is MissReason.POOL_CAP else "no_capacity"
        self.metrics.claims.labels(pool, "none", reason).inc()
        detail = (
            f"pool {pool!r} is at its cap of {self.pool_cap(attempt.pool)} workers"
            if reason == "pool_cap"
            else f"no worker of pool {pool!r} became available"
        )
        return CapacityError(
            f"{detail} within {attempt.deadline - attempt.started:g}s", reason=reason
        )

    async def _serve(self, a: _Attempt) -> None:
        """Try until bound, abandoned or past the deadline; then settle the future."""
        try:
            while not a.gone() and a.left(self.clock.monotonic()):
                picked = await self._acquire(a)
                if picked is None:
                    continue
                worker, source = picked
                claim = await self._activate_and_bind(a, worker, source)
                if claim is None:
                    continue
                if a.gone():
                    # The requester is gone: the session never starts, park the worker.
                    await self.release(claim.id)
                else:
                    a.result.set_result(claim)
                return
        except StokerError as exc:
            if not a.result.done():
                a.result.set_exception(exc)
        finally:
            if not a.result.done():
                a.result.set_exception(self._timeout_error(a))

    def _miss(self, a: _Attempt, reason: MissReason) -> None:
        """Record one miss per claim; a miss caused by the org's own cap is not demand."""
        a.blocked_by = reason
        if a.missed:
            return
        a.missed = True
        self.metrics.misses.labels(a.pool.name, reason.value).inc()
        # A require_warm claim counts as demand while it is queued (`waiting`), not twice.
        if reason is not MissReason.ORG_CAP and a.req.mode is not ClaimMode.REQUIRE_WARM:
            self.misses_total[a.pool.name] += 1
            self.publish_demand_soon()

    async def _wait(self, a: _Attempt, register: Callable[[], None]) -> None:
        """Sleep until woken by a release, a new warm worker or a freed slot, or the deadline."""
        a.wakeup = asyncio.get_running_loop().create_future()
        register()
        self.metrics.claims_waiting.labels(a.pool.name).inc()
        self.publish_demand_soon()
        try:
            remaining = a.left(self.clock.monotonic())
            if remaining:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await asyncio.shield(a.wakeup)
        finally:
            self.metrics.claims_waiting.labels(a.pool.name).dec()
            a.wakeup = None

    async def _acquire(self, a: _Attempt) -> tuple[Worker, ClaimSource] | None:
        """Reserve a worker for the claim, or wait and return None (the caller loops)."""
        pool, org = a.pool, a.req.org
        if a.req.mode is not ClaimMode.COLD:
            if pool.reuse is Reuse.SAME_ORG:
                worker = await self._take_hot_idle(pool, org)
                if worker is not None:
                    return worker, ClaimSource.REUSE
            worker, at_cap = await self._take_warm(pool, org, a.org_cap)
            if worker is not None:
                return worker, ClaimSource.WARM
            if at_cap:
                self._miss(a, MissReason.ORG_CAP)
                await self._wait(a, lambda: self._cap_waiters[(pool.name, org)].append(a))
                return None
            self._miss(a, MissReason.NO_WARM)
            if a.req.mode is ClaimMode.REQUIRE_WARM:
                await self._wait(a, lambda: self._warm_waiters[pool.name].append(a))
                return None
        return await self._spawn_for(a)

    async def _take_hot_idle(self, pool: PoolSpec, org: str) -> Worker | None:
        queue = self._idle.get((pool.name, org))
        while queue:
            worker_id = queue.popleft()
            known = self.known.get(worker_id)
            if (
                known is None
                or known.state is not S.HOT_IDLE
                or known.revision != pool.revision
                or worker_id in self._in_flight
            ):
                continue
            self._in_flight.add(worker_id)
            try:
                result = await self.lifecycle.reserve(
                    known, org=org, org_cap=0, owner=self.instance_id, activate=True
                )
            finally:
                self._in_flight.discard(worker_id)
            if result.worker is not None:
                return self.remember(result.worker)
            await self.refresh(worker_id)
        result = await self.lifecycle.reserve_any(
            pool.name,
            pool.revision,
            expect=S.HOT_IDLE,
            org=org,
            org_cap=0,
            owner=self.instance_id,
            activate=True,
        )
        return await self._take_from_store(result.worker)

    async def _take_warm(
        self, pool: PoolSpec, org: str, org_cap: int
    ) -> tuple[Worker | None, bool]:
        queue = self._ready.get((pool.name, pool.revision))
        while queue:
            worker_id = queue.popleft()
            known = self.known.get(worker_id)
            if known is None or known.state is not S.WARM or worker_id in self._in_flight:
                continue
            self._in_flight.add(worker_id)
            try:
                result = await self.lifecycle.reserve(
                    known, org=org, org_cap=org_cap, owner=self.instance_id, activate=True
                )
            finally:
                self._in_flight.discard(worker_id)
            if result.worker is not None:
                return self.remember(result.worker), False
            if result.at_org_cap:
                queue.appendleft(worker_id)
                return None, True
            await self.refresh(worker_id)
        result = await self.lifecycle.reserve_any(
            pool.name,
            pool.revision,
            expect=S.WARM,
            org=org,
            org_cap=org_cap,
            owner=self.instance_id,
            activate=True,
        )
        return await self._take_from_store(result.worker), result.at_org_cap

    async def _take_from_store(self, worker: Worker | None) -> Worker | None:
        """A worker reserved straight from the store; adopt it if another replica spawned it."""
        if worker is None:
            return None
        if worker.id not in self.known and not await self.runtime.adopt(worker):
            await self.retire(worker, RetireReason.LOST)
            return None
        return self.remember(worker)

    async def _spawn_for(self, a: _Attempt) -> tuple[Worker, ClaimSource] | None:
        """Cold path: a spawn slot bound to the claim's org, then wait for readiness."""
        pool, org = a.pool, a.req.org
        req = SpawnRequest(
            pool=pool.name,
            revision=pool.revision,
            count=1,
            owner=self.instance_id,
            org=org,
            pool_cap=self.pool_cap(pool),
            org_cap=a.org_cap,
        )
        result = await self.lifecycle.reserve_slots(req, [self.ids.worker()])
        if not result.workers:
            if result.limited_by == "org_cap":
                self._miss(a, MissReason.ORG_CAP)
                await self._wait(a, lambda: self._cap_waiters[(pool.name, org)].append(a))
            else:
                if result.limited_by == "pool_cap":
                    self._miss(a, MissReason.POOL_CAP)
                await self._wait(a, lambda: self._cap_waiters[(pool.name, "")].append(a))
            return None
        slot = self.remember(result.workers[0])
        self.metrics.spawns.labels(pool.name, "cold").inc()
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._spawn_waits[slot.id] = ready
        if not await self._create(slot, pool):
            return None
        try:
            # Readiness is bounded by the runtime's spawn timeout, not by the requester.
            endpoint = await ready
        except RuntimeFailure:
            return None
        finally:
            self._spawn_waits.pop(slot.id, None)
        slot = self.known.get(slot.id, slot)
        if slot.state is not S.SPAWNING:
            return None
        if a.abandoned:
            warm = await self.lifecycle.move(
                slot, S.WARM, **self._with_unsaved_ref(slot.id, endpoint=endpoint, org=None)
            )
            if warm is None:
                self.pending_ready[slot.id] = endpoint
            else:
                self.unsaved_refs.pop(slot.id, None)
                self.offer_warm(self.remember(warm))
            return None
        reserved = await self.lifecycle.move(
            slot,
            S.RESERVED,
            bump_epoch=True,
            **self._with_unsaved_ref(slot.id, endpoint=endpoint, heartbeat_at=self.clock.now()),
        )
        if reserved is None:
            self.pending_ready[slot.id] = endpoint
            return None
        self.unsaved_refs.pop(slot.id, None)
        return self.remember(reserved), ClaimSource.COLD

    async def _give_back(self, worker: Worker) -> None:
        """A reserved worker whose requester left: warm if never activated, else hot_idle."""
        if not worker.activated:
            back = await self.lifecycle.move(worker, S.WARM, org=None)
            if back is not None:
                self.offer_warm(self.remember(back))
                return
        elif worker.state in (S.RESERVED, S.ACTIVATING):
            pool = self.pools.get(worker.pool)
            if pool is not None and pool.reuse is Reuse.SAME_ORG and worker.org is not None:
                ttl = self._ttl(pool, worker.org, None)
                back = await self.lifecycle.move(
                    worker, S.HOT_IDLE, idle_since=self.clock.now(), ttl_s=ttl
                )
                if back is not None:
                    self.offer_hot_idle(self.remember(back))
                    return
        # Keeping it is not possible (or the write failed): retire rather than leak.
        await self.retire(worker, RetireReason.NO_REUSE)

    async def _activate_and_bind(
        self, a: _Attempt, worker: Worker, source: ClaimSource
    ) -> Claim | None:
        pool = a.pool
        if a.abandoned:
            await self._give_back(worker)
            return None
        self._in_flight.add(worker.id)
        try:
            if worker.state is S.ACTIVATING:
                # The store moved it on with the reservation (one write for both).
                activating: Worker | None = worker
            else:
                activating = await self.lifecycle.move(
                    worker, S.ACTIVATING, activated=True, heartbeat_at=self.clock.now()
                )
            if activating is None:
                # The reservation stands in the store; give it back rather than strand it.
                await self._give_back(worker)
                return None
            self.remember(activating)
            if source is not ClaimSource.REUSE:
                # First activation (warm and cold workers have never held an org's data):
                # from now on it does. A reused worker is still marked busy from its first.
                self.spawn_task(self._set_busy(activating, True), f"busy:{worker.id}")
            token = self.ids.token()
            started = self.clock.monotonic()
            if pool.activation is Activation.HTTP:
                payload = ActivationPayload(
                    worker_id=worker.id,
                    org=a.req.org,
                    epoch=activating.epoch,
                    token=token,
                    config=dict(a.req.config),
                )
                # The heartbeat starts only if activation outlasts one interval: most take
                # milliseconds, and a timer is cheaper than a task on the claim path.
                heartbeat = asyncio.get_running_loop().call_later(
                    pool.timeouts.activation_s / 3, self._start_heartbeat, activating.id
                )
                try:
                    await self.activator.activate(activating, payload, pool.timeouts.activation_s)
                except RuntimeFailure as exc:
                    self.metrics.spawn_failures.labels(pool.name, "activation").inc()
                    logs.worker_event("activation_failed", activating, error=str(exc))
                    await self.retire(
                        self.known.get(worker.id, activating), RetireReason.ACTIVATION_FAILURE
                    )
                    return None
                finally:
                    heartbeat.cancel()
            self.metrics.activation_seconds.labels(pool.name).observe(
                self.clock.monotonic() - started
            )
            activating = self.known.get(worker.id, activating)
            if a.gone():
                await self._give_back(activating)
                return None
            now = self.clock.now()
            lease_s = a.req.lease_s if a.req.lease_s is not None else pool.lease_s
            claim = Claim(
                id=self.ids.claim(),
                pool=pool.name,
                org=a.req.org,
                worker_id=worker.id,
                worker_epoch=activating.epoch,
                source=source,
                mode=a.req.mode,
                state=ClaimState.BOUND,
                token=token if pool.activation is Activation.HTTP else "",
                endpoint=activating.endpoint or "",
                lease_s=lease_s,
                expires_at=now + lease_s,
                created_at=now,
                updated_at=now,
                owner=self.instance_id,
                ttl_s=a.req.ttl_s,
            )
            hot = await self.lifecycle.bind(activating, claim)
            if hot is None:
                await self._give_back(activating)
                return None
            self.remember(hot)
        finally:
            self._in_flight.discard(worker.id)
        self.metrics.claims.labels(pool.name, source.value, "bound").inc()
        self.metrics.claim_seconds.labels(pool.name, source.value).observe(
            self.clock.monotonic() - a.started
        )
        logs.event(
            "claim_bound",
            claim=claim.id,
            worker=worker.id,
            pool=pool.name,
            org=claim.org,
            epoch=claim.worker_epoch,
            source=source.value,
        )
        return claim

    def _start_heartbeat(self, worker_id: str) -> None:
        self.spawn_task(self._heartbeat(worker_id), f"hb:{worker_id}")

    async def _heartbeat(self, worker_id: str) -> None:
        """Re-stamp an activating worker so the stuck sweep knows its activation is alive."""
        worker = self.known.get(worker_id)
        if worker is None:
            return
        pool = self.pools.get(worker.pool)
        interval = (pool.timeouts.activation_s if pool else 30.0) / 3
        while True:
            current = self.known.get(worker_id)
            if current is None or current.state is not S.ACTIVATING:
                return
            stamped = await self.lifecycle.heartbeat(current)
            if stamped is not None:
                self.remember(stamped)
            await self.clock.sleep(interval)

    async def _set_busy(self, worker: Worker, busy: bool) -> None:
        try:
            await self.runtime.set_busy(worker, busy)
        except RuntimeFailure as exc:
            logs.worker_event("set_busy_failed", worker, error=str(exc), level=logs.WARNING)

    def _ttl(self, pool: PoolSpec, org: str, claim_ttl: float | None) -> float:
        org_spec = self.orgs.get(org)
        org_ttl = org_spec.hot_idle_ttl if org_spec else None
        return resolve_ttl(claim_ttl, org_ttl, pool.hot_idle_ttl, pool.max_ttl)

    # -- after binding ----------------------------------------------------------------------

    async def get_claim(self, claim_id: str) -> Claim:
        """A claim by id, or NotFound."""
        claim = await self.store.get_claim(claim_id)
        if claim is None:
            raise NotFound(f"unknown claim {claim_id!r}")
        return claim

    async def renew(self, claim_id: str, lease_s: float | None = None) -> Claim:
        """Extend a bound claim's lease by `lease_s` (default: the claim's own) from now."""
        claim = await self.get_claim(claim_id)
        if claim.state is not ClaimState.BOUND:
            raise ClaimConflict(f"claim {claim_id!r} is {claim.state.value}, not bound")
        now = self.clock.now()
        expires_at = now + (lease_s if lease_s is not None else claim.lease_s)
        renewed = await self.store.renew_claim(claim_id, expires_at=expires_at, now=now)
        if renewed is None:
            raise ClaimConflict(f"claim {claim_id!r} ended while renewing")
        return renewed

    async def release(self, claim_id: str) -> Claim:
        """End a session: the worker parks as hot_idle (reuse: same_org) or retires.

        Releasing a claim that already ended returns it unchanged.
        """
        claim = await self.get_claim(claim_id)
        if claim.state is not ClaimState.BOUND:
            return claim
        return await self._end(claim, ClaimState.RELEASED)

    async def expire(self, claim: Claim) -> bool:
        """End a claim whose lease ran out and retire its worker."""
        try:
            ended = await self.lifecycle.end_claim(
                claim,
                state=ClaimState.EXPIRED,
                worker_to=S.DRAINING,
                claim_reason=RetireReason.LEASE_EXPIRED.value,
                reason=RetireReason.LEASE_EXPIRED.value,
            )
        except StoreError:
            return False
        if ended is None:
            return False
        self.remember(ended[1])
        self.metrics.claims.labels(claim.pool, claim.source.value, "expired").inc()
        self._stop_soon(ended[1], stop=True)
        return True

    async def _end(self, claim: Claim, state: ClaimState) -> Claim:
        pool = self.pools.get(claim.pool)
        # Only the revision is needed, which never changes: memory will do when it knows.
        worker = self.known.get(claim.worker_id) or await self.store.get_worker(claim.worker_id)
        reuse = (
            pool is not None
            and pool.reuse is Reuse.SAME_ORG
            and worker is not None
            and worker.revision == pool.revision
            and not self.closing
        )
        if pool is not None and reuse:
            ended = await self.lifecycle.end_claim(
                claim,
                state=state,
                worker_to=S.HOT_IDLE,
                idle_since=self.clock.now(),
                ttl_s=self._ttl(pool, claim.org, claim.ttl_s),
            )
        else:
            why = (
                RetireReason.ROLLOUT
                if pool is not None and pool.reuse is Reuse.SAME_ORG
                else (RetireReason.NO_REUSE)
            )
            ended = await self.lifecycle.end_claim(
                claim, state=state, worker_to=S.DRAINING, reason=why.value
            )
        if ended is None:
            # Someone else ended it meanwhile (lease expiry, a lost worker): report that.
            return await self.get_claim(claim.id)
        done, moved = ended
        self.metrics.claims.labels(claim.pool, claim.source.value, state.value).inc()
        if moved.state is S.HOT_IDLE:
            if moved.owner == self.instance_id:
                self.offer_hot_idle(self.remember(moved))
            else:
                self._wake_cap_waiters(moved.pool, moved.org)
        else:
            self.remember(moved)
            self._stop_soon(moved, stop=True)
        return done

    # -- start-up and shutdown --------------------------------------------------------------

    def load(self, workers: Iterable[Worker]) -> None:
        """Fill memory from workers this replica owns (after adoption at start-up)."""
        for worker in workers:
            self.remember(worker)
            if worker.state is S.WARM:
                self.offer_warm(worker)
            elif worker.state is S.HOT_IDLE:
                self.offer_hot_idle(worker)

    async def drain_claims(self, timeout: float) -> None:
        """Stop taking claims and wait (bounded) for in-flight ones to finish."""
        self.closing = True
        deadline = self.clock.monotonic() + timeout
        while self._claims_in_flight and self.clock.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def wait_background(self, timeout: float) -> None:
        """Wait (bounded) for background stops and spawns to finish, then cancel the rest."""
        tasks = [t for t in self._tasks if not t.done()]
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
