"""`ControlPlane`: one stoker replica, composed from ports.

It composes the replica's parts, starts the store (migrations), registers the replica,
starts the runtime, and runs three loops: the janitor (while leader), the fallback reaper
and the replica heartbeat. Claims go to `Claims`; releases and renewals to `Sessions`.

The parts, each with one job (upper ones call lower ones, never the reverse; the
import contract in pyproject.toml holds them to it):

    plane ─ janitor (the active step of a pass) ─ world (its passive sync)
          ─ claims (the entry: reuse -> warm -> cold, waits, misses)
              ─ reservations (pick and reserve) · binding (activate, bind, give back)
          ─ runtime events (readiness, loss) · sessions (renew, release, expire)
          ─ spawning ─ retiring (drain, stop, retire) ─ demand (misses, published rows)
          ─ shared: book (this replica's memory) · catalog (pools, orgs, caps, TTLs)
                    · lifecycle (the only writer of workers and claims)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from stoker.control import logs
from stoker.control.book import Book
from stoker.control.catalog import Catalog
from stoker.control.faults import FAILING_AFTER, PoolProblem, describe
from stoker.control.following import Follower
from stoker.control.history import History
from stoker.control.holdings import org_cap_retry_after
from stoker.control.ids import Ids
from stoker.control.journal import EventKind, Journal
from stoker.control.ledger import Ledger
from stoker.control.lifecycle import Lifecycle
from stoker.control.metrics import Metrics
from stoker.control.parts import assemble
from stoker.control.rollout_actions import RolloutActions
from stoker.control.rollouts import Planner, Rollouts
from stoker.control.scaler import DemandSource, PassReport
from stoker.control.shared import Shared
from stoker.control.status import PoolStatus, add_samples, pool_statuses, revision_samples
from stoker.control.stored_pools import StoredPools
from stoker.domain.errors import (
    OrgCapError,
    RuntimeFailure,
    StokerError,
    StoreError,
    Unavailable,
)
from stoker.domain.records import Claim, ClaimRequest, Worker
from stoker.domain.rollouts import Strategy
from stoker.domain.specs import OrgSpec, PlaneSettings, PoolSpec
from stoker.domain.states import LIVE, RetireReason, WorkerState
from stoker.policy.rollout import rollout_plan
from stoker.ports.activator import Activator
from stoker.ports.clock import Clock, LoopClock
from stoker.ports.elector import Elector, SoleLeader
from stoker.ports.runtime import Runtime, StartGated
from stoker.ports.store import StateCount, Store, WorkerFeed
from stoker.ports.tracer import NO_TRACER, Tracer

#: How many times a shutdown reads a worker again whose retirement missed its fence (the
#: row moved on since the listing); each read sees every write made until then.
SHUTDOWN_REREADS = 3


class ControlPlane:
    """One control-plane replica."""

    def __init__(
        self,
        *,
        store: Store,
        runtime: Runtime,
        activator: Activator,
        pools: Iterable[PoolSpec],
        orgs: Iterable[OrgSpec] = (),
        settings: PlaneSettings | None = None,
        clock: Clock | None = None,
        elector: Elector | None = None,
        ids: Ids | None = None,
        metrics: Metrics | None = None,
        demand: DemandSource | None = None,
        planner: Planner | None = None,
        instance_id: str | None = None,
        closers: Sequence[Callable[[], Awaitable[None]]] = (),
        tracer: Tracer = NO_TRACER,
        strategies: Mapping[str, Strategy] | None = None,
        views: bool = True,
    ) -> None:
        """`runtime` runs the workers and `activator` hands them their orgs. `closers` run
        at the end of `stop`, in order, after the runtime, the activator and the store are
        closed: they release what the plane's adapters use but do not own (a cluster client
        shared by a runtime and an elector, say). `tracer` records a span for each claim
        and its steps (closed with the plane). `views` off, the replica keeps nothing that
        only a reader of its API would see: no dashboard samples (`history` stays empty)
        and no published sizing (`GET /v1/pools` on another replica shows the static
        target); the simulator, whose replicas nobody reads, turns it off."""
        self.settings = settings or PlaneSettings()
        self.clock = clock or LoopClock()
        self.ids = ids or Ids()
        self.instance_id = instance_id or self.ids.instance()
        self.store = store
        self.runtime = runtime
        self.activator = activator
        self.elector = elector or SoleLeader()
        self.metrics = metrics or Metrics()
        self.tracer = tracer
        seeds = {p.name: p for p in pools}
        self.catalog = Catalog(seeds, {o.name: o for o in orgs}, derived_cap=runtime.derived_cap)
        # Every replica reads a pool's drain at its next pass: two passes after it, no
        # replica serves the pool's claims any more, and it may be deleted.
        self.pools = StoredPools(
            self.catalog,
            store,
            self.clock,
            self.ids,
            seeds,
            strategies,
            settle_s=2 * self.settings.janitor_interval_s,
        )
        self.book = Book(
            reader=store,
            instance_id=self.instance_id,
            node_sessions=runtime.node_sessions if runtime.has_nodes else None,
        )
        #: Recent events and the last hour of each pool, for the dashboard.
        self.journal = Journal(self.clock.now)
        #: Each pool's rollout plan (routing, reuse and sizing by revision).
        self.rollouts = Rollouts(
            self.catalog, self.metrics, planner or rollout_plan, journal=self.journal
        )
        #: An admin's pause, resume, abort and promote of a rollout.
        self.rollout_actions = RolloutActions(
            store=store, catalog=self.catalog, rollouts=self.rollouts, clock=self.clock
        )
        self.history = History(self.settings.pool_sample_s)
        self.lifecycle = Lifecycle(store, self.clock, self.metrics, self.journal)
        #: What warmth costs and buys, and the claim log (docs/warmth.md).
        self.ledger = Ledger(
            clock=self.clock,
            catalog=self.catalog,
            instance_id=self.instance_id,
            metrics=self.metrics,
            ends_reported=runtime.kind == "kubernetes",
        )
        self.lifecycle.on_moved = self.ledger.moved
        self.lifecycle.on_claim_ended = self.ledger.claim_ended
        self.lifecycle.on_adopted = self.ledger.adopted
        shared = Shared(
            book=self.book,
            lifecycle=self.lifecycle,
            catalog=self.catalog,
            rollouts=self.rollouts,
            clock=self.clock,
            metrics=self.metrics,
            ids=self.ids,
            settings=self.settings,
            journal=self.journal,
            tracer=tracer,
            ledger=self.ledger,
            views=views,
        )
        self.views = views
        parts = assemble(shared, self.pools, store, runtime, activator, demand=demand)
        self.claims, self.sessions, self.retirer = parts.claims, parts.sessions, parts.retirer
        self.idempotent = parts.idempotent
        self.spawner, self.events, self.demand = parts.spawner, parts.events, parts.demand
        self.janitor, self.reaper = parts.janitor, parts.reaper
        self.pins = parts.pins
        # A pool deleted from the store: its series, chart and spawn trouble go with it.
        self.pools.forgotten += [self.metrics.drop_pool, self.history.forget, self.spawner.forget]
        self.closers = tuple(closers)
        self._loops: list[asyncio.Task[None]] = []
        self.started = False
        self.reconciled = False
        #: Set when this replica finds its own registration expired while it still runs
        #: (it was paused, or cut off from the store, for longer than `instance_expiry_s`):
        #: the others have adopted or retired its workers, so the identity is dead. A
        #: server exits on it so that its supervisor starts a fresh replica.
        self.expired = False
        #: What the last heartbeat's store write failed with (None: it succeeded). While
        #: set, the replica is not ready and claims fail at once with 503
        #: `store_unavailable` instead of waiting out their timeout on a dead store.
        self.store_error: str | None = None
        #: Whether this replica's last janitor pass led (the leader's gauges are its own).
        self._led = False

    # -- lifecycle of the replica -------------------------------------------------------------

    async def start(self, *, loops: bool = True) -> None:
        """Open the store, register, start the runtime, adopt, then start the loops.

        With `loops=False` nothing runs in the background: tests drive passes themselves.
        """
        await self.store.open()
        await self.pools.seed()
        await self.store.register_instance(
            self.instance_id, now=self.clock.now(), meta={"runtime": self.runtime.kind}
        )
        self.runtime.subscribe(self.events)
        await self.runtime.start()
        self.started = True
        for pool in self.catalog.pools.values():
            self._log_cap(pool)
        logs.event("control_plane_started", instance=self.instance_id, runtime=self.runtime.kind)
        # The first janitor pass adopts what a previous run left (docs/guides/replicas.md:
        # reconcile the store and the runtime at start: adopt live, retire dead).
        if self.elector.is_leader:
            await self._guarded("janitor", self.run_janitor_pass)
        self.reconciled = True
        if loops:
            every = [
                ("janitor", self.settings.janitor_interval_s, self._janitor_pass),
                ("reaper", self.settings.reaper_interval_s, self._reaper_pass),
                ("heartbeat", self.settings.instance_heartbeat_s, self._heartbeat),
            ]
            if self.views:
                # The chart starts with the pools as they are at start.
                await self._guarded("sample", self.sample_pools)
                every.append(("sample", self.settings.pool_sample_s, self.sample_pools))
            self._loops = [
                asyncio.create_task(self._elect(), name="elector"),
                *self._feed(),
                *(
                    asyncio.create_task(self._every(interval, name, step), name=name)
                    for name, interval, step in every
                ),
            ]

    def _feed(self) -> list[asyncio.Task[None]]:
        """Following the store's worker feed, on a store that has one, and the offer
        passes (`following`)."""
        follower = Follower(self.book, self.store, self.rollouts)
        offers = asyncio.create_task(follower.offer_every(self.clock), name="offer")
        if not isinstance(self.store, WorkerFeed):
            return [offers]
        return [asyncio.create_task(follower.run(self.store), name="feed"), offers]

    def _log_cap(self, pool: PoolSpec) -> None:
        if pool.max_workers > 0:
            logs.event("pool_cap", pool=pool.name, cap=pool.max_workers, source="max_workers")
            return
        try:
            derived = self.runtime.derived_cap(pool)
        except Exception as exc:
            # A stored template the cap cannot be read from: the janitor reports the pool
            # (`/readyz`); the replica starts and serves the other pools.
            logs.event("pool_cap", pool=pool.name, cap="unknown", error=describe(exc))
            return
        if derived > 0:
            logs.event(
                "pool_cap",
                pool=pool.name,
                cap=derived,
                source="memory_budget",
                detail="max_workers is 0 in local mode: cap = memory budget / worker memory",
            )
        else:
            logs.event("pool_cap", pool=pool.name, cap="unbounded", source="max_workers=0")

    async def stop(self, *, stop_workers: bool = False) -> None:
        """Stop taking claims, finish in-flight ones, then leave workers for the next start
        to adopt (or stop them with `stop_workers`)."""
        if not self.started:
            return
        # Read before the elector's loop stops: the leader keeps the headroom placeholders.
        leading = self.elector.is_leader
        await self.claims.drain(self.settings.shutdown_grace_s)
        self.spawner.close()
        for task in self._loops:
            task.cancel()
        for task in self._loops:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._loops = []
        if stop_workers:
            await self._stop_own_workers()
            if leading:
                await self._remove_headroom()
        await self.book.wait_background(self.settings.shutdown_grace_s)
        # The ledger's last counts and log rows: a clean stop loses none of them.
        await self.ledger.flush(self.store, final=True)
        with contextlib.suppress(StokerError):
            await self.elector.resign()
        with contextlib.suppress(StokerError):
            await self.store.stop_instance(self.instance_id, now=self.clock.now())
        await self.runtime.close()
        await self.activator.close()
        await self.store.close()
        self.tracer.close()
        for close in self.closers:
            # One failing closer must not keep the others from releasing their resources.
            try:
                await close()
            except Exception as exc:
                logs.event("closer_failed", error=repr(exc), level=logs.WARNING)
        self.started = False
        logs.event("control_plane_stopped", instance=self.instance_id, stop_workers=stop_workers)

    async def _stop_own_workers(self) -> None:
        """Retire this replica's workers; then stop whatever of them still runs through
        the runtime alone, so that a store that is down, locked or full leaves none."""
        try:
            workers = await self.store.list_workers(states=LIVE, owner=self.instance_id)
        except StoreError as exc:
            logs.event("shutdown_store_failed", error=str(exc), level=logs.WARNING)
            workers = []
        for worker in workers:
            if not await self._retire_at_shutdown(worker):
                # A write failed: the store is failing, the rest go without it.
                logs.event("shutdown_store_failed", worker=worker.id, level=logs.WARNING)
                break
        await self.book.wait_background(self.settings.shutdown_grace_s)
        await self.retirer.stop_leftovers(self.instance_id)

    async def _retire_at_shutdown(self, worker: Worker) -> bool:
        """Retire one of this replica's workers as listed; False when the store failed.

        The listing may be a step behind: a spawn records its process's ref, a worker gets
        ready, while the workers before it retire. Such a write misses its fence, and the
        worker is read again and retired as it now is (a spawn's ref is what stops it).
        """
        for _ in range(SHUTDOWN_REREADS + 1):
            failed_before = self.lifecycle.last_store_failure
            if worker.state is WorkerState.HOT and worker.claim_id:
                done = await self.retirer.fail_session(worker, RetireReason.SHUTDOWN)
            else:
                done = await self.retirer.retire(worker, RetireReason.SHUTDOWN)
            if self.lifecycle.last_store_failure is not failed_before:
                return False
            if done:
                return True
            try:
                fresh = await self.store.get_worker(worker.id)
            except StoreError:
                return False
            if fresh is None or fresh.state not in LIVE or fresh.owner != self.instance_id:
                return True  # retired or taken over meanwhile
            if (fresh.state, fresh.version) == (worker.state, worker.version):
                return True  # nothing to retry: its retirement is under way or remembered
            worker = fresh
        return True

    async def _remove_headroom(self) -> None:
        """Delete the fleet's headroom placeholders (a leader's `--stop-workers`): they hold
        nodes for workers that no longer come. A leader that goes on recreates them."""
        try:
            await self.runtime.reconcile_headroom([])
        except RuntimeFailure as exc:
            logs.event("headroom_failed", error=str(exc), level=logs.WARNING)

    # -- loops ------------------------------------------------------------------------------

    async def _every(self, interval: float, name: str, body: Callable[[], Awaitable[Any]]) -> None:
        while True:
            await self.clock.sleep(interval)
            await self._guarded(name, body)

    async def _guarded(self, name: str, body: Callable[[], Awaitable[Any]]) -> bool:
        started = self.clock.monotonic()
        try:
            await body()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.metrics.pass_failures.labels(name, "").inc()
            logs.event("pass_failed", loop=name, error=repr(exc), level=logs.WARNING)
            self.journal.record(EventKind.PASS_FAILED, reason=name, detail=repr(exc))
            return False
        self.metrics.pass_seconds.labels(name).observe(self.clock.monotonic() - started)
        return True

    async def _elect(self) -> None:
        await self.elector.run()

    def refresh_gauges(self) -> None:
        """Set the gauges that must be current whenever they are read (before a scrape).

        `stoker_janitor_is_leader` asks the elector each time: a janitor pass that began
        while leading can outlast the lease (a stalled process, a slow store), and the
        gauge must not report a second leader meanwhile.
        """
        self.metrics.is_leader.set(1 if self.elector.is_leader else 0)

    async def _janitor_pass(self) -> PassReport | None:
        self.refresh_gauges()
        if self.elector.is_leader:
            self._led = True
            return await self.run_janitor_pass()
        if self._led:
            # The leader's gauges go with the lease: the new leader reports its own.
            self.metrics.drop_leaders_gauges()
            self._led = False
        # Every replica keeps its own workers' pins; the leader in its pass.
        await self.pins.reconcile()
        # Another replica runs the janitor now: its failures are no longer this one's.
        self.janitor.faults.clear()
        await self.pools.refresh()  # the leader's pass reloads them too: all serve the store
        return None

    async def _reaper_pass(self) -> PassReport:
        report = await self.reaper.run_pass()
        # Stamped only after a successful pass: a store outage shows as a stale gauge.
        self.metrics.reaper_last_success.set(self.clock.now())
        return report

    async def _heartbeat(self) -> None:
        """Stamp this replica's registration; what it finds says whether the store works."""
        try:
            alive = await self.store.heartbeat_instance(self.instance_id, now=self.clock.now())
        except StoreError as exc:
            if self.store_error is None:
                logs.event("store_unavailable", error=str(exc), level=logs.ERROR)
            self.store_error = str(exc)
            raise
        if self.store_error is not None:
            logs.event("store_recovered", after=self.store_error)
            self.store_error = None
        if not alive:
            if not self.expired:
                logs.event(
                    "instance_expired_while_alive", instance=self.instance_id, level=logs.ERROR
                )
            self.expired = True

    async def run_janitor_pass(self) -> PassReport:
        """One janitor pass now (tests and tools), with this replica's pins first: they
        need no store, so a pass that fails on the store still keeps them."""
        await self.pins.reconcile()
        report = await self.janitor.run_pass()
        self.metrics.janitor_last_success.set(self.clock.now())
        return report

    async def sample_pools(self) -> None:
        """Add one sample of every pool to `history` (the dashboard's chart)."""
        counted = await self.store.count_workers()
        statuses = await self.pool_status(counted)
        revisions = revision_samples(counted, self.catalog)
        add_samples(self.history, statuses, self.clock.now(), revisions)

    async def run_reaper_pass(self) -> PassReport:
        """One fallback-reaper pass now (tests and tools)."""
        return await self._reaper_pass()

    # -- the claim API ----------------------------------------------------------------------

    def _check_running(self) -> None:
        if not self.started:
            raise Unavailable("control plane is not running")

    async def check_store(self) -> None:
        """One heartbeat now (tests and tools): sets or clears `store_error`."""
        with contextlib.suppress(StoreError):
            await self._heartbeat()

    async def claim(self, req: ClaimRequest) -> Claim:
        """Claim a worker (see `Claims.claim`; with an idempotency key, `claim_once`)."""
        claim, _ = await self.claim_once(req)
        return claim

    async def claim_once(self, req: ClaimRequest) -> tuple[Claim, bool]:
        """Claim a worker, or get the claim an earlier request with the same idempotency
        key made (then True: a replay). See `IdempotentClaims.claim`."""
        self._check_running()
        if self.store_error is not None:
            raise StoreError(f"the store is failing: {self.store_error}")
        try:
            with self.tracer.span("stoker.claim", pool=req.pool, org=req.org) as span:
                claim, replayed = await self.idempotent.claim(req)
                span.set("stoker.claim.id", claim.id)
                span.set("stoker.claim.source", claim.source.value)
                span.set("stoker.claim.replayed", replayed)
                return claim, replayed
        except OrgCapError as exc:
            # When to retry follows from what the org holds (`control.holdings`).
            exc.retry_after = await org_cap_retry_after(
                self.store,
                pool=req.pool,
                org=req.org,
                now=self.clock.now(),
                longest=exc.retry_after,
            )
            raise

    async def release(self, claim_id: str) -> Claim:
        """Release a claim's worker."""
        self._check_running()
        return await self.sessions.release(claim_id)

    async def renew(self, claim_id: str, lease_s: float | None = None) -> Claim:
        """Extend a claim's lease."""
        self._check_running()
        return await self.sessions.renew(claim_id, lease_s)

    async def get_claim(self, claim_id: str) -> Claim:
        """A claim by id."""
        self._check_running()
        return await self.sessions.get_claim(claim_id)

    def degraded(self) -> list[PoolProblem]:
        """The pools this replica sees in trouble (`/readyz`): those whose janitor or reaper
        passes failed `FAILING_AFTER` times in a row here, and the pool revisions whose
        spawns failed as often since they last worked (as their status shows them)."""
        problems = self.janitor.faults.problems() + self.reaper.faults.problems()
        for (pool, revision), trouble in sorted(self.spawner.failing_revisions().items()):
            if trouble.failures >= FAILING_AFTER:
                problems.append(
                    PoolProblem(
                        pool, "spawn_failing", trouble.failures, trouble.last_error, revision
                    )
                )
        return problems

    async def pool_status(self, counted: Sequence[StateCount] | None = None) -> list[PoolStatus]:
        """Targets, demand and counts by state of every pool (`counted`: the store's
        `count_workers`, when the caller read it for more than this)."""
        self._check_running()
        return await pool_statuses(
            self.store,
            self.catalog,
            self.spawner,
            now=self.clock.now(),
            janitor_interval_s=self.settings.janitor_interval_s,
            reaper_interval_s=self.settings.reaper_interval_s,
            counted=counted,
            instance=self.instance_id,
            slots=self.runtime.start_slots() if isinstance(self.runtime, StartGated) else None,
        )
