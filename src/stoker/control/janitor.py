"""Reconcile, reap and sweep: the janitor (fleet-wide, leader only) and the fallback reaper
(every replica, its own workers).

Each pass is a passive *sync* that reads the world into a `World` snapshot, followed by an
active *step* that decides from that snapshot and acts. The step acts pool by pool (and
worker by worker): what fails for one pool is noted in `faults` (`control.faults`) and the
other pools go on. Every action is a fenced write
through the lifecycle (spawns, retirements, adoptions, expiries), so two janitors at once
are harmless (I7): the second one's CAS misses, spawn slots are reserved against the
target inside the store, and scale-down picks its victims deterministically.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable

from stoker.control import logs
from stoker.control.demand import DemandPublisher
from stoker.control.events import RuntimeEvents
from stoker.control.faults import PassFaults, describe
from stoker.control.outcomes import OutcomeCounts
from stoker.control.pins import Pins
from stoker.control.published_sizing import publish, sizing_record
from stoker.control.retiring import Retirer, ghost
from stoker.control.scaler import DemandSource, PassReport, Scaler
from stoker.control.sessions import Sessions
from stoker.control.shared import Shared
from stoker.control.sizing import PoolSizer, Sizing
from stoker.control.spawning import Spawner
from stoker.control.stored_pools import StoredPools
from stoker.control.world import Reach, World, WorldReader
from stoker.domain.errors import RuntimeFailure, StoreError
from stoker.domain.records import Worker
from stoker.domain.specs import PoolSpec
from stoker.domain.states import LIVE, RetireReason, WorkerState
from stoker.policy.reaping import (
    expired_claims,
    hot_idle_to_reap,
    session_left,
    stuck_workers,
)
from stoker.ports.runtime import Runtime, RuntimeObject
from stoker.ports.store import ReplicaStore


class Janitor:
    """The active step of a pass: `Reach.FLEET` for the leader, `Reach.OWN` for the
    fallback reaper."""

    def __init__(
        self,
        shared: Shared,
        *,
        world: WorldReader,
        store: ReplicaStore,
        runtime: Runtime,
        retirer: Retirer,
        spawner: Spawner,
        sessions: Sessions,
        events: RuntimeEvents,
        publisher: DemandPublisher,
        pins: Pins | None = None,
        demand: DemandSource | None = None,
        pools: StoredPools | None = None,
    ) -> None:
        """`demand` replaces the demand rate and forecast read from the store with a count
        added to the static target (the simulator's baselines);
        `pools` reloads the catalog when the stored pools changed, before each pass."""
        self.reach = world.reach
        self._world, self._store, self._runtime = world, store, runtime
        self._book, self._lifecycle = shared.book, shared.lifecycle
        self._catalog, self._metrics, self._settings = (
            shared.catalog,
            shared.metrics,
            shared.settings,
        )
        self._retirer, self._spawner, self._sessions = retirer, spawner, sessions
        self._events, self._publisher = events, publisher
        self._pins = pins
        self._rollouts = shared.rollouts
        self._ledger = shared.ledger
        self._baseline = demand is not None
        self._views = shared.views
        # A fallback reaper retires a gone replica's parked workers and ends its sessions
        # without adopting them; the fleet's janitor adopts those first (`_adopt_orphans`).
        self._orphans_ledger = self._ledger if self.reach is Reach.OWN else None
        #: The pools whose step of this pass failed, pass after pass (`/readyz`).
        self.faults = PassFaults(
            "janitor" if self.reach is Reach.FLEET else "reaper", shared.metrics, shared.journal
        )
        self.sizer = PoolSizer(
            shared, store=store, runtime=runtime, spawner=spawner, publisher=publisher
        )
        self._pools = pools
        #: Each pool given the forecast's headroom, by name: (the catalog's spec, the
        #: headroom, the spec with it), made again only when either changes.
        self._with_headroom: dict[str, tuple[PoolSpec, int, PoolSpec]] = {}
        #: This replica's outcome counts of rollouts, written every pass.
        self._outcomes = OutcomeCounts(shared, store=store)
        self._scaler = Scaler(
            shared,
            store=store,
            retirer=retirer,
            spawner=spawner,
            sizer=None if self._baseline else self.sizer,
            outcomes=self._outcomes,
            faults=self.faults,
            demand=demand,
        )
        self._last_purge: float | None = None
        #: Stop stranded objects of replicas the store has no record of (the operator's
        #: confirmation, `stoker serve --stop-stranded`); else they are reported and kept.
        self.stop_unseen = False
        #: Unseen objects reported already (reported once each while they run).
        self._unseen: set[str] = set()

    @property
    def desired(self) -> dict[str, int]:
        """Desired warm per pool, as this replica's last pass decided it (published after
        the pass for every replica's `GET /v1/pools`)."""
        return self._scaler.desired

    @property
    def demand(self) -> dict[str, int]:
        """Demand per pool, as the last pass read it."""
        return self._scaler.demand

    def sizing(self, pool: str) -> Sizing | None:
        """The last pass's sizing of `pool` (None before one, or under a baseline)."""
        return None if self._baseline else self.sizer.last.get(pool)

    # -- the pass ---------------------------------------------------------------------------

    async def run_pass(self) -> PassReport:
        """Sync then step. Raises StoreError when the world could not be read; a failure
        of one pool's step is noted in `faults` and the pass goes on."""
        self.faults.begin()
        if self._pools is not None:
            await self._pools.refresh()
            for pool, why in self._pools.broken.items():
                self.faults.failed(pool, "load", why)
        world = await self.sync()
        report = PassReport()
        await self.step(world, report)
        self.faults.end()
        return report

    async def sync(self) -> World:
        """Passive: read the world (store rows, replicas, runtime objects)."""
        return await self._world.read()

    async def step(self, world: World, report: PassReport) -> None:
        """Active: decide from the snapshot and act through fenced writes."""
        await self._settle_pending()
        if self.reach is Reach.FLEET:
            await self._adopt_orphans(world, report)
            await self._scaler.scale(world, report)
            await self._retire_poolless(world, report)
            if self._views:
                await self._publish_sizing(world.now)
            await self._sweep_stuck(world, report)
            if self._pins is not None:
                # Busy workers' pins are each replica's (`Pins.reconcile`); a neutral
                # worker's stray pin is the leader's, from the store's warm rows.
                await self._pins.unpin_neutral(world.warm)
            if world.objects is not None:
                await self._stop_stranded(world, report)
            await self._headroom()
            await self._purge(world.now)
            self._gauges(world)
        else:
            # Every replica's claim counter reaches the leader's demand rate, and its
            # outcome counts the leader's verdict on a rollout.
            await self._publisher.publish()
            await self._outcomes.publish()
            if self._ledger is not None:
                await self._ledger.flush(self._store)
            self._rollouts.show_stored()
        await self._reap_hot_idle(world, report)
        await self._expire_leases(world, report)

    # -- steps ------------------------------------------------------------------------------

    async def _settle_pending(self) -> None:
        """Retry runtime facts whose write failed earlier (persist before mutate)."""
        await self._events.settle_pending()
        await self._retirer.settle_pending()

    async def _adopt_orphans(self, world: World, report: PassReport) -> None:
        """Workers of expired replicas: keep serving ones, retire in-flight ones."""
        for worker in world.orphans:
            with self.faults.step(worker.pool, "adopt"):
                await self._adopt_orphan(worker, report)

    async def _adopt_orphan(self, worker: Worker, report: PassReport) -> None:
        if worker.state in (WorkerState.WARM, WorkerState.HOT, WorkerState.HOT_IDLE):
            adopted = await self._lifecycle.adopt(worker, self._book.instance_id)
            if adopted is None:
                return
            if not await self._runtime.adopt(adopted):
                await self._lost_on_adopt(adopted, report)
                return
            self._book.load([adopted])
            report.adopted += 1
            logs.worker_event("worker_adopted", adopted, previous_owner=worker.owner)
            return
        if self._ledger is not None:
            # Its time since its owner's last ledger write is counted up to the retirement.
            self._ledger.orphaned(worker)
        if worker.state is WorkerState.DRAINING:
            await self._retirer.retire(worker, RetireReason.ORPHANED)
        elif await self._retirer.retire(worker, RetireReason.ORPHANED):
            report.count(RetireReason.ORPHANED)

    async def _lost_on_adopt(self, worker: Worker, report: PassReport) -> None:
        if worker.state is WorkerState.HOT and worker.claim_id:
            done = await self._retirer.fail_session(worker, RetireReason.LOST)
        else:
            done = await self._retirer.retire(worker, RetireReason.LOST, stop=False)
        if done:
            report.count(RetireReason.LOST)

    async def _reap_hot_idle(self, world: World, report: PassReport) -> None:
        """hot_idle past its TTL (keeping the org floor), and stale revisions."""
        candidates = [w for w in world.hot_idle if self._acts_for(w.owner, world)]
        if (ledger := self._orphans_ledger) is not None:
            for w in candidates:
                if w.owner not in world.live_instances:
                    # Reaped here, not adopted: counted from its owner's last ledger write.
                    ledger.orphaned(w)
        gone: set[str] = set()
        if self.reach is Reach.FLEET:
            # A parked worker of a failed revision is never reused (older ones expire).
            for w in candidates:
                with self.faults.step(w.pool, "reap stale revision"):
                    if w.pool in self._catalog.pools and w.revision not in (
                        self._rollouts.reusable(w.pool)
                    ):
                        gone.add(w.id)
                        reason = self._rollouts.retire_reason(w.pool, w.revision)
                        if await self._retirer.retire(w, reason):
                            report.count(reason)
        for pool, parked in by_pool(w for w in candidates if w.id not in gone).items():
            with self.faults.step(pool, "reap hot_idle"):
                for w in hot_idle_to_reap(parked, world.now, self._catalog.min_hot_idle):
                    if await self._retirer.retire(w, RetireReason.TTL):
                        report.count(RetireReason.TTL)

    def _acts_for(self, owner: str, world: World) -> bool:
        """Whether this pass acts for what `owner` holds: the fleet's janitor for anyone; a
        fallback reaper for this replica and for replicas that are gone."""
        return (
            self.reach is Reach.FLEET
            or owner == self._book.instance_id
            or owner not in world.live_instances
        )

    async def _expire_leases(self, world: World, report: PassReport) -> None:
        claims = [c for c in world.expired if self._acts_for(c.owner, world)]
        if (ledger := self._orphans_ledger) is not None:
            for c in claims:
                if c.owner not in world.live_instances and c.worker_id:
                    # Its worker is ended here, not adopted: counted from its owner's last
                    # ledger write (the row as last written: the claim's end is its move).
                    worker = await self._store.get_worker(c.worker_id)
                    if worker is not None:
                        ledger.orphaned(worker)
        for claim in expired_claims(claims, world.now):
            with self.faults.step(claim.pool, "expire lease"):
                left = session_left(
                    claim.created_at, self._catalog.max_claim_s(claim.pool, claim.org), world.now
                )
                why = RetireReason.MAX_CLAIM if left == 0 else RetireReason.LEASE_EXPIRED
                if await self._sessions.expire(claim, why):
                    report.expired_claims += 1
                    report.count(why)

    async def _retire_poolless(self, world: World, report: PassReport) -> None:
        """Warm and parked workers of a pool the store no longer holds: a replica that had
        not read the pool's drain yet may spawn and serve for it until a moment after its
        deletion, and no pool's scale-down (nor, under an org's `min_hot_idle`, its TTL)
        would ever retire them; no claim can take them any more."""
        if self._pools is None:
            return
        served = self._catalog.pools
        unknown = {w.pool for w in world.warm if w.pool not in served}
        unknown.update(w.pool for w in world.hot_idle if w.pool not in served)
        if not unknown:
            return  # every pass but the rare one
        gone = set()
        for pool in sorted(unknown - set(self._pools.broken)):
            with self.faults.step(pool, "retire workers of a deleted pool"):
                # Read again: a pool created since this pass loaded the catalog is kept.
                if await self._store.get_pool(pool) is None:
                    gone.add(pool)
        busy = self._book.in_flight()
        for w in [*world.warm, *world.hot_idle]:
            if w.pool in gone and w.id not in busy:
                with self.faults.step(w.pool, "retire workers of a deleted pool"):
                    if await self._retirer.retire(w, RetireReason.POOL_REMOVED):
                        report.count(RetireReason.POOL_REMOVED)
                        logs.worker_event("worker_of_deleted_pool", w, level=logs.WARNING)

    async def _sweep_stuck(self, world: World, report: PassReport) -> None:
        """In-flight rows past their timeout are retired (I4); draining rows retried."""
        timeouts = {name: pool.timeouts for name, pool in self._catalog.pools.items()}
        busy = self._book.in_flight()
        # A pod that waits on the cluster (a node, an image) gets the longer pending_s.
        progress = {
            w.id: seen
            for w in world.in_flight
            if w.state is WorkerState.SPAWNING and (seen := self._runtime.progress(w))
        }
        for pool, in_flight in by_pool(world.in_flight).items():
            with self.faults.step(pool, "sweep stuck"):
                for w in stuck_workers(in_flight, world.now, timeouts, progress):
                    if w.id in busy or w.owner not in world.live_instances:
                        continue
                    if w.state is WorkerState.DRAINING:
                        await self._retirer.retire(w, RetireReason.STUCK)
                    elif await self._retirer.retire(w, RetireReason.STUCK):
                        report.count(RetireReason.STUCK)
                        logs.worker_event("worker_stuck", w, level=logs.WARNING)

    async def _stop_stranded(self, world: World, report: PassReport) -> None:
        """Runtime objects with stoker's labels but no live row, older than the grace."""
        grace = self._settings.stranded_grace_s
        old = [obj for obj in world.objects or [] if world.now - obj.created_at >= grace]
        if not old:
            self._unseen.clear()
            return
        # One read of the live rows, not one per object: an object past the grace was
        # created after its row was inserted (persist before mutate), so a row missing
        # here is retired or gone.
        try:
            live = {w.id for w in await self._store.list_workers(states=LIVE)}
        except StoreError:
            return
        unseen = [
            o
            for o in old
            if o.worker_id not in live and o.instance and o.instance not in world.known_instances
        ]
        self._report_unseen(unseen)
        kept = set() if self.stop_unseen else {o.worker_id for o in unseen}
        doomed = [o for o in old if o.worker_id not in live and o.worker_id not in kept]
        if doomed:
            # The objects were read before this pass retired workers (whose stops are under
            # way): stop only what still runs and is not being stopped.
            # Each running object once: an early read may have met a worker id twice (a
            # launcher that forks before it execs the worker carries its labels too).
            ids = {o.worker_id for o in doomed}
            try:
                doomed = [o for o in await self._runtime.list_objects() if o.worker_id in ids]
            except RuntimeFailure:
                return
        for obj in doomed:
            if obj.stopping:
                continue
            with self.faults.step(obj.pool, "stop stranded"):
                try:
                    await self._runtime.stop(ghost(obj), 0.0)
                except RuntimeFailure as exc:
                    logs.event("stranded_stop_failed", worker=obj.worker_id, error=str(exc))
                    continue
                report.stranded_stopped += 1
                logs.event("stranded_stopped", worker=obj.worker_id, pool=obj.pool)

    def _report_unseen(self, unseen: list[RuntimeObject]) -> None:
        """Say, once per object, that stranded objects of a replica the store never heard
        of run (the database was replaced or lost?): they may be sessions in use, so they
        are kept unless the operator confirmed with `--stop-stranded`."""
        new = [o for o in unseen if o.worker_id not in self._unseen]
        self._unseen = {o.worker_id for o in unseen}
        for obj in new:
            logs.event(
                "stranded_unseen",
                worker=obj.worker_id,
                pool=obj.pool,
                instance=obj.instance,
                pid=obj.ref.get("pid"),
                endpoint=obj.endpoint,
                action="stop" if self.stop_unseen else "keep (stoker serve --stop-stranded)",
                level=logs.WARNING,
            )

    async def _publish_sizing(self, now: float) -> None:
        """What this pass decided of each pool, in one write, for every replica's pool
        listing (`control.published_sizing`), with the spawn trouble of its current
        revision as this replica shows it (the warm spawns are the leader's: another
        replica's spawner hears nothing of their failures); a pool whose step failed before
        it was sized keeps its older row, which ages."""
        scaler = self._scaler
        records = [
            sizing_record(
                name,
                instance=self._book.instance_id,
                sized_at=now,
                desired_warm=scaler.desired[name],
                demand=scaler.demand.get(name, 0),
                sized=self.sizing(name),
                rollout_waits=self._rollout_waits(name),
                revision=spec.revision,
                failing=self._spawner.failing(spec),
            )
            for name, spec in self._catalog.pools.items()
            if scaler.decided_at.get(name) == now
        ]
        if records:
            await publish(self._store, records)

    def _rollout_waits(self, pool: str) -> str | None:
        """Why the pool's active rollout waits, as this pass planned it ("": it does not);
        None without one."""
        plan = self._rollouts.plans.get(pool)
        ramp = self._catalog.rollout(pool)
        if plan is None or plan.ramp is None or ramp is None or not ramp.active:
            return None
        return plan.waits

    async def _purge(self, now: float) -> None:
        """Delete old history now and then, so the store stays small over months."""
        settings = self._settings
        if self._last_purge is not None and now - self._last_purge < settings.purge_interval_s:
            return
        self._last_purge = now
        try:
            deleted = await self._store.purge(before=now - settings.history_retention_s)
        except StoreError as exc:
            logs.event("purge_failed", error=str(exc), level=logs.WARNING)
            return
        if deleted:
            logs.event("history_purged", rows=deleted)
        await self._purge_ledger(now)

    async def _purge_ledger(self, now: float) -> None:
        """The ledger's and the claim log's rows past their retention, a bounded batch per
        purge (docs/warmth.md)."""
        settings = self._settings
        try:
            deleted = await self._store.purge_ledger(
                before=now - settings.ledger_retention_s, limit=settings.ledger_purge_batch
            )
        except StoreError as exc:
            logs.event("ledger_purge_failed", error=str(exc), level=logs.WARNING)
            return
        if deleted:
            logs.event("ledger_purged", rows=deleted)

    async def _headroom(self) -> None:
        """Each pool's placeholders: the forecast's where it has one, else the constant."""
        pools = []
        for name, pool in self._catalog.pools.items():
            sizing = self.sizing(name)
            if sizing is not None and sizing.headroom is not None:
                pool = self._pool_with_headroom(pool, sizing.headroom)
            pools.append(pool)
        if self._ledger is not None:
            for pool in pools:
                slots = pool.headroom_nodes * self._runtime.placeholder_slots(pool)
                cpus, gib = self._runtime.placeholder_requests(pool)
                self._ledger.placeholders(
                    pool.name,
                    pool.revision,
                    float(slots),
                    requests=(pool.headroom_nodes * cpus, pool.headroom_nodes * gib),
                )
        try:
            await self._runtime.reconcile_headroom(pools)
        except RuntimeFailure as exc:
            logs.event("headroom_failed", error=str(exc), level=logs.WARNING)
        except Exception as exc:
            # One call places every pool's placeholders: which pool broke it is unknown,
            # and the rest of the pass goes on.
            logs.event("headroom_failed", error=describe(exc), level=logs.ERROR)

    def _pool_with_headroom(self, pool: PoolSpec, headroom: int) -> PoolSpec:
        """`pool` with `headroom_nodes` = `headroom` (the same spec as last pass when
        neither changed: a spec is immutable, and checked again when made)."""
        kept = self._with_headroom.get(pool.name)
        if kept is not None and kept[0] is pool and kept[1] == headroom:
            return kept[2]
        with_headroom = dataclasses.replace(pool, headroom_nodes=headroom)
        self._with_headroom[pool.name] = (pool, headroom, with_headroom)
        return with_headroom

    def _gauges(self, world: World) -> None:
        by: dict[tuple[str, str], int] = defaultdict(int)
        for c in world.counts:
            by[(c.pool, c.state.value)] += c.count
        for name in self._catalog.pools:
            for state in LIVE:
                self._metrics.workers.labels(name, state.value).set(by.get((name, state.value), 0))


def by_pool(workers: Iterable[Worker]) -> dict[str, list[Worker]]:
    """Workers grouped by pool, each pool's in the order given (a pool's step at a time)."""
    grouped: dict[str, list[Worker]] = defaultdict(list)
    for w in workers:
        grouped[w.pool].append(w)
    return grouped
