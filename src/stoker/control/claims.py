"""Where a claim enters: serve it reuse -> warm -> cold, by its mode, within its timeout.

The work of binding a claim runs in a task of its own, so a requester that gives up
(timeout, disconnect) never interrupts a transition half-way: a worker that becomes ready
after its requester left goes back to `warm` if it was never activated, else to that
org's `hot_idle`. A claim that finds nothing waits in the book until a worker is offered
or a slot frees, and counts one miss (the demand signal) unless its org's cap held it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from stoker.control.attempt import Attempt
from stoker.control.binding import Binder
from stoker.control.demand import DemandPublisher
from stoker.control.reservations import Reservations
from stoker.control.rollouts import Outcome
from stoker.control.sessions import Sessions
from stoker.control.shared import Shared
from stoker.control.spawning import Spawner
from stoker.domain.errors import (
    CapacityError,
    InvalidRequest,
    OrgCapError,
    StokerError,
    StoreError,
    Unavailable,
)
from stoker.domain.records import Claim, ClaimRequest, Worker
from stoker.domain.states import ClaimMode, ClaimSource, MissReason, Reuse, WorkerState


def _consume(future: asyncio.Future[Claim]) -> None:
    if not future.cancelled():
        future.exception()


class Claims:
    """Serves the claims of one replica."""

    def __init__(
        self,
        shared: Shared,
        *,
        reservations: Reservations,
        spawner: Spawner,
        binder: Binder,
        sessions: Sessions,
        demand: DemandPublisher,
    ) -> None:
        self._book, self._catalog, self._lifecycle = shared.book, shared.catalog, shared.lifecycle
        self._rollouts = shared.rollouts
        self._clock, self._metrics, self._settings = shared.clock, shared.metrics, shared.settings
        self._reservations, self._spawner = reservations, spawner
        self._binder, self._sessions, self._demand = binder, sessions, demand
        self._tracer = shared.tracer
        self._ledger = shared.ledger
        self._in_flight = 0

    async def claim(self, req: ClaimRequest) -> Claim:
        """Serve a claim: reuse -> warm -> cold by its mode, within its timeout.

        Raises `OrgCapError` or `CapacityError` when no worker came in time, `NotFound` for
        an unknown pool, `Unavailable` while shutting down.
        """
        pool = self._catalog.pool(req.pool)
        if self._book.closing:
            raise Unavailable("control plane is shutting down")
        if self._catalog.draining(req.pool):
            raise Unavailable(f"pool {req.pool!r} is draining: it hands out no new claims")
        if not req.org:
            raise InvalidRequest("org must not be empty")
        timeout = pool.claim_timeout_s if req.timeout_s is None else req.timeout_s
        loop = asyncio.get_running_loop()
        now = self._clock.monotonic()
        attempt = Attempt(
            req=req,
            # A new claim goes to its org's revision by the rollout plan (reuse finds the
            # org's parked workers at any revision that serves).
            pool=self._rollouts.route(pool, req.org),
            org_cap=self._catalog.org_cap(pool, req.org),
            started=now,
            deadline=now + timeout,
            result=loop.create_future(),
        )
        # An abandoned attempt's outcome has nobody to read it: mark it read.
        attempt.result.add_done_callback(_consume)
        self._in_flight += 1
        self._book.spawn_task(self._serve(attempt), f"claim:{req.org}")
        try:
            # A claim that waits for nothing (timeout 0) still looks once for a parked or
            # warm worker: its requester waits for that one look (and the activation).
            async with asyncio.timeout(timeout or None):
                return await asyncio.shield(attempt.result)
        except TimeoutError:
            if attempt.result.done() and not attempt.result.exception():
                return attempt.result.result()
            attempt.abandon()
            raise self._timeout_error(attempt) from None
        except asyncio.CancelledError:
            attempt.abandon(cancelled=True)
            if attempt.result.done() and not attempt.result.exception():
                # Bound just as the requester left: give the worker back at once.
                claim_id = attempt.result.result().id
                self._book.spawn_task(self._sessions.release(claim_id), "release:abandoned")
            raise
        finally:
            self._in_flight -= 1

    def in_flight(self) -> int:
        """Claims being served now (their requesters wait)."""
        return self._in_flight

    async def drain(self, timeout: float) -> None:
        """Stop taking claims and wait (bounded) for in-flight ones to finish."""
        self._book.start_closing()
        deadline = self._clock.monotonic() + timeout
        while self._in_flight and self._clock.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _timeout_error(self, attempt: Attempt, *, count: bool = True) -> StokerError:
        """The error of a claim that found no worker in time, counted once in
        `stoker_claims_total` unless `count` is off (nobody will read it)."""
        pool = attempt.pool.name
        counted = self._metrics.claims if count else None
        if attempt.blocked_by is MissReason.ORG_CAP:
            if counted is not None:
                counted.labels(pool, "none", "org_cap").inc()
            return OrgCapError(
                f"org {attempt.req.org!r} holds its cap of {attempt.org_cap} workers in pool "
                f"{pool!r}",
                retry_after=self._settings.org_cap_retry_after_s,
            )
        within = f"within {attempt.deadline - attempt.started:g}s"
        failed = self._lifecycle.last_store_failure
        if failed is not None and failed[0] >= attempt.started:
            # Its writes failed meanwhile (a locked or failing store): say so, not "no worker".
            if counted is not None:
                counted.labels(pool, "none", "store_unavailable").inc()
            return StoreError(
                f"no worker of pool {pool!r} could be claimed {within}: the store is failing: "
                f"{failed[1]}"
            )
        trouble = self._spawner.trouble(attempt.pool)
        error = trouble.last_error if trouble else attempt.spawn_error
        if error is not None and attempt.blocked_by is not MissReason.POOL_CAP:
            if counted is not None:
                counted.labels(pool, "none", "spawn_failing").inc()
            failures = f" ({trouble.failures} in a row)" if trouble else ""
            return CapacityError(
                f"no worker of pool {pool!r} became available {within}: its spawns are "
                f"failing{failures}; last error: {error}",
                reason="spawn_failing",
            )
        # A claim that had room made for it at the cap (`reclaiming`) was held by the cap.
        capped = attempt.blocked_by is MissReason.POOL_CAP or attempt.reclaiming is not None
        reason = "pool_cap" if capped else "no_capacity"
        if counted is not None:
            counted.labels(pool, "none", reason).inc()
        detail = f"no worker of pool {pool!r} became available"
        if capped:
            detail = (
                f"pool {pool!r} is at its cap of {self._catalog.pool_cap(attempt.pool)} workers"
            )
            if attempt.reclaiming is not None:
                detail += " (a parked worker of another org was retiring to make room)"

        return CapacityError(f"{detail} {within}", reason=reason)

    async def _serve(self, a: Attempt) -> None:
        """Try until bound, abandoned or past the deadline; then settle the future."""
        first = True
        try:
            # The first pass runs even at the deadline: a zero timeout looks, never waits.
            while not a.gone() and (first or a.left(self._clock.monotonic())):
                first = False
                with self._tracer.span("stoker.reserve") as span:
                    picked = await self._acquire(a)
                    span.set("stoker.reserve.source", picked[1].value if picked else "none")
                if picked is None:
                    continue
                worker, source = picked
                claim = await self._binder.activate_and_bind(a, worker, source)
                if claim is None:
                    continue
                self._rollouts.note(a.pool.name, worker.revision, Outcome.CLAIM)
                if self._ledger is not None:
                    # In memory only: the ledger writes it with its next flush.
                    wait = self._clock.monotonic() - a.started
                    self._ledger.claimed(claim, revision=worker.revision, wait_s=wait)
                if a.gone():
                    # The requester is gone: the session never starts, park the worker.
                    await self._sessions.release(claim.id)
                else:
                    a.result.set_result(claim)
                return
        except asyncio.CancelledError:
            # Only a shutdown cancels an attempt (its grace ended with the claim waiting).
            if not a.result.done():
                a.result.set_exception(Unavailable("control plane is shutting down"))
            raise
        except StokerError as exc:
            if not a.result.done():
                a.result.set_exception(exc)
        finally:
            if not a.result.done():
                # A requester that gave up was answered (and counted) where it gave up; one
                # cancelled (it disconnected, or the shutdown grace ended) was told no
                # capacity refusal, so the claim log says `failed` (docs/claim-log.md).
                a.result.set_exception(
                    Unavailable("the claim's requester left as it waited")
                    if a.cancelled
                    else self._timeout_error(a, count=not a.abandoned)
                )
                if a.blocked_by is not MissReason.ORG_CAP:
                    self._rollouts.note(a.pool.name, a.pool.revision, Outcome.CLAIM)
                    self._rollouts.note(a.pool.name, a.pool.revision, Outcome.CLAIM_ERROR)
            if self._ledger is not None and not a.result.cancelled():
                error = a.result.exception()
                if error is not None:
                    self._ledger.failed(
                        pool=a.pool.name,
                        revision=a.pool.revision,
                        org=a.req.org,
                        mode=a.req.mode,
                        wait_s=self._clock.monotonic() - a.started,
                        error=error,
                    )
            # A spawn the claim waited for goes on to the next claim (or warm).
            await self._reservations.let_go(a)

    async def _acquire(self, a: Attempt) -> tuple[Worker, ClaimSource] | None:
        """Reserve a worker for the claim, or wait and return None (the caller loops).

        A claim waiting for its cold spawn takes whatever gets ready for it first: that
        spawn, or a warm or parked worker offered meanwhile.
        """
        pool, org, book = a.pool, a.req.org, self._book
        if a.spawn_ready is not None:
            return await self._reservations.take_spawn(a)
        spawning = book.spawn_of(a) is not None
        if a.req.mode is not ClaimMode.COLD:
            warm = None
            if pool.reuse is Reuse.SAME_ORG:
                # Without a spawn of its own to free first, the store's look for a parked
                # worker may reserve a warm one when it finds none, in the same write.
                parked, warm = await self._reservations.take_parked(
                    pool, org, None if spawning else a.org_cap
                )
                if parked.worker is not None:
                    book.hand_on_spawn(a, pool.name)
                    return parked.worker, ClaimSource.REUSE
            if not a.counted:
                # Not served by reuse: this claim wants a neutral worker (demand rate).
                a.counted = True
                self._demand.record_claim(pool.name)
                self._rollouts.note_neutral(pool.name, pool.revision)
            if spawning:
                await self._reservations.free_own_spawn(a)
            if warm is None:
                warm = await self._reservations.take(pool, org, WorkerState.WARM, a.org_cap)
            if warm.worker is not None:
                book.hand_on_spawn(a, pool.name)
                # A warm worker that got ready while the claim waited for a start is the
                # start it waited for: the claim was served cold, not from the warm pool.
                source = ClaimSource.COLD if a.waited_for_start else ClaimSource.WARM
                return warm.worker, source
            if warm.at_org_cap and not spawning:
                self._miss(a, MissReason.ORG_CAP)
                await self._wait(a, lambda: book.wait_for_slot(pool.name, org, a))
                return None
            self._miss(a, MissReason.NO_WARM)
            if a.req.mode is ClaimMode.REQUIRE_WARM:
                await self._wait(a, lambda: book.wait_for_warm(pool.name, a))
                return None
        if spawning:
            await self._wait_for_spawn(a)
            return None
        if not a.waits:
            # A claim that waits for nothing (timeout 0) could never take a spawn: it
            # starts none, nor waits for a start-up slot or a back-off on its way.
            return None
        return await self._spawn_for(a)

    async def _wait_for_spawn(self, a: Attempt) -> None:
        """Wait for the claim's spawn or, in arrival order, for any worker offered first."""
        if a.in_order:
            await self._wait(a, lambda: self._book.wait_for_warm(a.pool.name, a))
        else:
            await self._wait(a, lambda: None)

    async def _spawn_for(self, a: Attempt) -> tuple[Worker, ClaimSource] | None:
        """Cold path: a spawn slot bound to the claim's org, then wait for readiness."""
        pool, org, book = a.pool, a.req.org, self._book
        result = await self._spawner.reserve_cold_slot(pool, org, a.org_cap)
        if not result.workers:
            if result.limited_by == "backoff":
                # The pool's spawns keep failing: wait for the back-off to end (or for a
                # worker), rather than try again at once.
                trouble = self._spawner.trouble(pool)
                a.spawn_error = trouble.last_error if trouble else None
                left = self._spawner.backoff_left(pool)
                await self._wait(a, lambda: book.wait_for_warm(pool.name, a), at_most=left)
            elif result.limited_by == "org_cap":
                self._miss(a, MissReason.ORG_CAP)
                await self._wait(a, lambda: book.wait_for_slot(pool.name, org, a))
            else:
                if result.limited_by == "pool_cap":
                    self._miss(a, MissReason.POOL_CAP)
                    await self._reservations.make_room(a)
                await self._wait(a, lambda: self._wait_for_slot_or_worker(a))
            return None
        if await self._reservations.start_cold(a, result.workers[0]):
            await self._wait_for_spawn(a)
        return None

    def _wait_for_slot_or_worker(self, a: Attempt) -> None:
        """A claim held by the pool cap takes a freed slot or a worker offered first."""
        self._book.wait_for_slot(a.pool.name, "", a)
        if a.in_order:
            self._book.wait_for_warm(a.pool.name, a)

    def _miss(self, a: Attempt, reason: MissReason) -> None:
        """Record one miss per claim; a miss caused by the org's own cap is not demand."""
        a.blocked_by = reason
        if reason is MissReason.NO_WARM:
            a.waited_for_start = True
        if a.missed:
            return
        a.missed = True
        self._metrics.misses.labels(a.pool.name, reason.value).inc()
        # A require_warm claim counts as demand while it is queued (`waiting`), not twice.
        if reason is not MissReason.ORG_CAP and a.req.mode is not ClaimMode.REQUIRE_WARM:
            self._demand.record_miss(a.pool.name)

    async def _wait(
        self, a: Attempt, register: Callable[[], None], *, at_most: float | None = None
    ) -> None:
        """Sleep until woken by a release, a new warm worker or a freed slot, or the deadline
        (or `at_most` seconds)."""
        a.wakeup = asyncio.get_running_loop().create_future()
        register()
        self._metrics.claims_waiting.labels(a.pool.name).inc()
        self._demand.publish_soon()
        try:
            remaining = a.left(self._clock.monotonic())
            if at_most is not None:
                remaining = min(remaining, at_most)
            # A requester that left while the attempt was on its way here woke nobody; a
            # spawn handed over before the wait began (ready at once) is taken right away.
            if remaining and not a.gone() and a.spawn_ready is None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await asyncio.shield(a.wakeup)
        finally:
            # However the wait ended, the book lets go of the claim (and of its config).
            self._book.stop_waiting(a.pool.name, a.req.org, a)
            self._metrics.claims_waiting.labels(a.pool.name).dec()
            a.wakeup = None
