"""The reconciler's step for each pool: spawn every revision towards its warm target and
retire what the rollout plan no longer wants.

The targets come from one `rollout_plan` per pool and pass (`stoker.control.rollouts`):
without a rollout that is the pool's desired warm (the larger of its static target, its
claim rate's and its forecast's, plus the claims queued, within the cap: `control.sizing`)
for its stable revision and nothing for older ones; during a ramp each revision gets
its part. Scale-down of a revision that serves waits `scale_down_delay`; a revision that
no longer serves retires its warm workers at once when its rollout failed, else a share
per pass. The leader writes what the plan decided (a step, a pause, a promotion, a
rollback) before it acts on it, judging the ramping revision from every replica's outcome
counts (`control.outcomes`). Each pool, and each revision of a pool, is a step of its
own: one that fails is noted in the pass's faults and the others go on.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from stoker.control import logs
from stoker.control.faults import PassFaults
from stoker.control.outcomes import OutcomeCounts
from stoker.control.retiring import Retirer
from stoker.control.shared import Shared
from stoker.control.sizing import PoolSizer
from stoker.control.spawning import Spawner
from stoker.control.world import World
from stoker.domain.errors import StokerError
from stoker.domain.records import Worker
from stoker.domain.specs import PoolSpec
from stoker.domain.states import RetireReason, WorkerState
from stoker.policy.reaping import hot_idle_to_free
from stoker.policy.rollout import (
    SERVING,
    Decision,
    PoolDemand,
    RevisionCounts,
    RevisionFailures,
    RevisionPlan,
    Role,
    RolloutPlan,
)
from stoker.policy.scaling import (
    PoolCounts,
    retirements_due,
    scale_down_budget,
    spawns_needed,
)
from stoker.ports.store import ReplicaStore

DemandSource = Callable[[str, float], Awaitable[int]]


@dataclass(slots=True)
class PassReport:
    """What one step did, for logs and tests."""

    spawned: dict[str, int] = field(default_factory=dict)
    #: Pools whose cap held spawning below desired warm in this pass.
    capped: set[str] = field(default_factory=set)
    retired: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    adopted: int = 0
    expired_claims: int = 0
    stranded_stopped: int = 0

    def count(self, reason: RetireReason) -> None:
        self.retired[reason.value] += 1


def revision_counts(world: World) -> dict[str, dict[str, RevisionCounts]]:
    """Live workers by pool and revision, as the rollout plan counts them."""
    busy: dict[tuple[str, str], int] = defaultdict(int)
    warm: dict[tuple[str, str], int] = defaultdict(int)
    spawning: dict[tuple[str, str], int] = defaultdict(int)
    for c in world.counts:
        key = (c.pool, c.revision)
        if c.state is WorkerState.WARM:
            warm[key] += c.count
        elif c.state is WorkerState.SPAWNING and not c.bound:
            spawning[key] += c.count
        elif c.state is not WorkerState.DRAINING:
            busy[key] += c.count
    out: dict[str, dict[str, RevisionCounts]] = defaultdict(dict)
    for pool, revision in sorted({*busy, *warm, *spawning}):
        key = (pool, revision)
        out[pool][revision] = RevisionCounts(busy=busy[key], warm=warm[key], spawning=spawning[key])
    return out


class Scaler:
    """Spawns and scale-down of every pool, revision by revision, by its rollout plan."""

    def __init__(
        self,
        shared: Shared,
        *,
        store: ReplicaStore,
        retirer: Retirer,
        spawner: Spawner,
        sizer: PoolSizer | None,
        outcomes: OutcomeCounts,
        faults: PassFaults,
        demand: DemandSource | None = None,
    ) -> None:
        """Sized by `sizer`, or by a baseline's `demand` added to the static target;
        rollouts judged from `outcomes`; what fails for one pool is noted in `faults`."""
        self._retirer, self._spawner = retirer, spawner
        self._outcomes = outcomes
        self._faults = faults
        self._sizer, self._demand = sizer, demand
        self._store = store
        self._book, self._catalog, self._metrics = shared.book, shared.catalog, shared.metrics
        self._rollouts = shared.rollouts
        self._excess_since: dict[tuple[str, str], float] = {}
        #: What the last pass decided per pool (the janitor publishes it for every
        #: replica's `GET /v1/pools`, `control.published_sizing`).
        self.desired: dict[str, int] = {}
        self.demand: dict[str, int] = {}
        #: When the pass that decided each pool's figures began (a pool whose step fails
        #: keeps its older figures, and their time).
        self.decided_at: dict[str, float] = {}

    async def scale(self, world: World, report: PassReport) -> None:
        """Spawn towards each revision's warm target; retire what the plan does not want."""
        counts = revision_counts(world)
        live: dict[str, int] = defaultdict(int)
        for c in world.counts:
            live[c.pool] += c.count
        warm: dict[tuple[str, str], list[Worker]] = defaultdict(list)
        busy = self._book.in_flight()
        for w in world.warm:
            if w.id not in busy:
                warm[(w.pool, w.revision)].append(w)
        if self._sizer is not None:
            await self._sizer.read(world.now)
        summed = await self._summed()
        for name, pool in list(self._catalog.pools.items()):
            ramp = self._catalog.rollout(name)
            failures = summed.get(ramp.id) if summed is not None and ramp is not None else None
            with self._faults.step(name, "scale"):
                await self._scale_pool(
                    pool, counts.get(name, {}), live, warm, world, report, failures
                )

    async def _scale_pool(
        self,
        pool: PoolSpec,
        counts: dict[str, RevisionCounts],
        live: dict[str, int],
        warm: dict[tuple[str, str], list[Worker]],
        world: World,
        report: PassReport,
        failures: RevisionFailures | None = None,
    ) -> None:
        """One pool's step: its plan (judging its rollout from `failures`, every replica's
        counts; None: this replica's), then each revision's spawns and scale-down."""
        name = pool.name
        cap = self._catalog.pool_cap(pool)
        sizing, demand = await self._wanted(pool, counts, live[name], cap, world)
        plan = self._rollouts.plan(pool, counts, sizing, world.now, failures=failures)
        if plan.decision is not Decision.HOLD and not await self._decided(pool, plan, world.now):
            # Unwritten, the decision does not hold: act on the stored rollout.
            plan = self._rollouts.plan(pool, counts, sizing, world.now, decide=False)
        desired = sum(p.warm_target for p in plan.revisions.values() if p.role in SERVING)
        self.desired[name], self.demand[name] = desired, demand
        self.decided_at[name] = world.now
        self._metrics.demand.labels(name).set(demand)
        self._metrics.warm_desired.labels(name).set(desired)
        self._metrics.pool_cap.labels(name).set(cap)
        for part in plan.revisions.values():
            # A revision whose template breaks its step leaves the others' alone.
            with self._faults.step(name, f"scale revision {part.revision}"):
                mine = counts.get(part.revision, RevisionCounts())
                held = PoolCounts(warm=mine.warm, spawning_neutral=mine.spawning, live=live[name])
                workers = warm[(name, part.revision)]
                if part.role in SERVING:
                    target = part.warm_target
                    if mine.warm >= target and not mine.spawning:
                        self._spawner.settled(name, part.revision)
                    live[name] += await self._spawn(name, part.revision, target, held, cap, report)
                    short = spawns_needed(target, held, 0) - spawns_needed(target, held, cap)
                    await self._free_parked(pool, short, world, report)
                    await self._scale_down(name, part, held, workers, world.now, report)
                elif workers:
                    await self._retire_stale(name, part.role, workers, live[name], report)

    async def _summed(self) -> dict[str, RevisionFailures] | None:
        """Write this replica's outcome counts, then read every replica's of the active
        rollouts (None when the store failed: each plan judges from this replica's)."""
        await self._outcomes.publish()
        active = [r.id for name in self._catalog.pools if (r := self._catalog.rollout(name))]
        return await self._outcomes.summed(active)

    async def _wanted(
        self,
        pool: PoolSpec,
        revisions: dict[str, RevisionCounts],
        live: int,
        cap: int,
        world: World,
    ) -> tuple[PoolDemand, int]:
        """The pool's sizing inputs for the rollout plan, and its demand (beyond the static
        target) as the pool listing shows it."""
        now = world.now
        if self._sizer is None:
            demand = await self._demand(pool.name, now) if self._demand else 0
            return PoolDemand(warm_target=pool.warm_target, demand=demand, cap=cap), demand
        held = PoolCounts(
            warm=sum(r.warm for r in revisions.values()),
            spawning_neutral=sum(r.spawning for r in revisions.values()),
            live=live,
            node_waits=self._sizer.node_waits(pool, world.in_flight),
        )
        sized = self._sizer.size(pool, held, cap=cap, now=now)
        wanted = PoolDemand(
            warm_target=sized.base, demand=sized.waiting, cap=cap, lead_s=sized.replace_s
        )
        return wanted, sized.demand

    async def _spawn(
        self, name: str, revision: str, target: int, held: PoolCounts, cap: int, report: PassReport
    ) -> int:
        need = spawns_needed(target, held, cap)
        if need < spawns_needed(target, held, 0):
            report.capped.add(name)
        spec = self._catalog.revision_spec(name, revision)
        if not need or spec is None:
            return 0
        spawned = await self._spawner.spawn_warm(spec, need, target=target)
        report.spawned[name] = report.spawned.get(name, 0) + spawned
        return spawned

    async def _free_parked(
        self, pool: PoolSpec, short: int, world: World, report: PassReport
    ) -> None:
        """At a full pool whose warm pool is `short` of its target: retire parked workers
        whose org is unlikely to claim again before their TTL runs out (its learned
        forecast; docs/scaling.md), so the warm pool refills before the next claim.
        Workers draining already count as room on its way."""
        sizer = self._sizer
        short -= sum(
            1 for w in world.in_flight if w.pool == pool.name and w.state is WorkerState.DRAINING
        )
        if sizer is None or short <= 0:
            return
        busy = self._book.in_flight()
        parked = [w for w in world.hot_idle if w.pool == pool.name and w.id not in busy]
        victims = hot_idle_to_free(
            parked,
            short,
            lambda w: sizer.orgs.chance(pool, w, world.now),
            self._catalog.min_hot_idle,
        )
        for w in victims:
            if await self._retirer.retire(w, RetireReason.RECLAIMED):
                report.count(RetireReason.RECLAIMED)
                logs.worker_event("hot_idle_freed", w, why="org_forecast")

    async def _scale_down(
        self,
        name: str,
        part: RevisionPlan,
        held: PoolCounts,
        workers: list[Worker],
        now: float,
        report: PassReport,
    ) -> None:
        key, target = (name, part.revision), part.warm_target
        if held.warm > target:
            self._excess_since.setdefault(key, now)
        else:
            self._excess_since.pop(key, None)
        pool = self._catalog.pool(name)
        due = retirements_due(
            target,
            held,
            excess_since=self._excess_since.get(key),
            now=now,
            scale_down_delay=pool.scale_down_delay,
        )
        if not due:
            return  # most passes: nothing to rank
        # Those on the nodes with the fewest sessions first, so that the cluster can give
        # back nodes that hold no session; then oldest first. Deterministic for a view of
        # the cluster, so two janitors acting on the same snapshot mostly pick the same
        # victims and the second CAS misses.
        book = self._book
        ranked = sorted(workers, key=lambda w: (book.sessions_beside(w), w.created_at, w.id))
        for w in ranked[:due]:
            if await self._retirer.retire(w, RetireReason.EXCESS):
                report.count(RetireReason.EXCESS)

    async def _retire_stale(
        self, name: str, role: Role, workers: list[Worker], live: int, report: PassReport
    ) -> None:
        """Warm workers of a revision that no longer serves: all at once when its rollout
        failed, else a share of the pool per pass."""
        due = len(workers) if role is Role.FAILED else scale_down_budget(live)
        reason = self._rollouts.retire_reason(name, workers[0].revision)
        for w in sorted(workers, key=lambda w: (w.created_at, w.id))[:due]:
            if await self._retirer.retire(w, reason):
                report.count(reason)

    async def _decided(self, pool: PoolSpec, plan: RolloutPlan, now: float) -> bool:
        """Write what the plan decided (a step, a promotion, a rollback) in one CAS on the
        pool's generation, then serve it; False when the write failed (the next pass
        decides again)."""
        written = plan.written
        if written is None:
            return False
        try:
            stored = await self._store.get_pool(pool.name)
            if stored is not None:
                await self._store.update_rollout(written, generation=stored.generation, now=now)
        except StokerError as exc:
            logs.event("rollout_write_failed", pool=pool.name, error=str(exc), level=logs.WARNING)
            return False
        self._rollouts.adopt(pool, written)
        self._rollouts.decided(plan)
        logs.event(
            "rollout_" + plan.decision.value,
            pool=pool.name,
            rollout=written.id,
            revision=written.revision,
            state=written.state.value,
            share=written.share,
            why=plan.why,
        )
        return True
