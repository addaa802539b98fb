"""The policies stoker is compared with: historical failures, re-enacted with stoker's parts.

Each baseline is the same replicas (`replicas.build_replicas`) changed only by the wrappers
and settings here:

- **static-target** (duckgres #597): a demand source that always says 0 (the pool only
  refills to its static target, one spawn per worker taken), a runtime whose `spawn`
  holds one of 3 permits until the pod is ready or gone, and whose `derived_cap` is a
  memory budget divided by a worker's memory;
- **run-once-elector** (duckgres #820): an elector whose `run()` returns once its first
  term ends, and no fallback reaper (its interval pushed beyond any run);
- **percent-headroom** (duckgres #757/#894): a runtime whose `reconcile_headroom` keeps
  ceil(percent x live workers, idle ones included) worker-sized placeholders;
- **static-target-uncapped**: static-target's demand source (0) on stoker's own runtime,
  without the memory cap and the spawn semaphore: beside `static-target`, it tells the
  demand logic apart from the cap;
- **knative-kpa**: Knative's Pod Autoscaler as the demand source (`stoker.sim.kpa`);
- **canary-pool-default** (picchu #602): a rollout plan whose ramp is sized from the
  pool's default target alone (`pool_default_plan`, `stoker.sim.rollout`);
- **canary-others-capacity** (stoker before #25, picchu's rule): a rollout plan whose ramp
  is sized from the other revisions' busy and warm workers times its share
  (`others_capacity_plan`): sessions never move, so it holds a second fleet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from stoker.adapters.elector_k8s import KubernetesLeaseElector
from stoker.adapters.runtime_kubernetes import KubernetesRuntime
from stoker.control.rollouts import Planner
from stoker.control.scaler import DemandSource
from stoker.domain.records import Worker
from stoker.domain.specs import PlaneSettings, PodTemplate, PoolSpec
from stoker.policy.rollout import (
    PoolDemand,
    RevisionCounts,
    RolloutPlan,
    rollout_plan,
)
from stoker.policy.scaling import desired_warm
from stoker.ports.clock import Clock
from stoker.sim.cluster.resources import memory_bytes
from stoker.sim.observed import ObservedRuntime
from stoker.sim.scenario import (
    PercentHeadroomParams,
    PolicyEntry,
    Scenario,
    StaticTargetParams,
)

#: An interval no run reaches: how a loop is switched off through settings alone.
NEVER_S = 1e12


def runtime_for(entry: PolicyEntry, inner: KubernetesRuntime, *, clock: Clock) -> ObservedRuntime:
    """The replica's runtime under the policy: stoker's own, or a baseline's."""
    params = entry.typed_params()
    if isinstance(params, StaticTargetParams):
        return StaticTargetRuntime(inner, clock=clock, params=params)
    if isinstance(params, PercentHeadroomParams):
        return PercentHeadroomRuntime(inner, clock=clock, params=params)
    return ObservedRuntime(inner, clock=clock)


def settings_for(entry: PolicyEntry, settings: PlaneSettings) -> PlaneSettings:
    """The replicas' settings under the policy (run-once-elector has no fallback reaper:
    nothing reaps while no janitor runs)."""
    if entry.policy == "run-once-elector":
        return dataclasses.replace(settings, reaper_interval_s=NEVER_S)
    return settings


def demand_for(entry: PolicyEntry) -> DemandSource | None:
    """The janitor's demand source under the policy (None: stoker's own; the KPA's is
    built with the replicas, as it reads the store)."""
    return no_demand if entry.policy in STATIC_DEMAND else None


#: Policies whose warm pool only refills to the static target.
STATIC_DEMAND = ("static-target", "static-target-uncapped")


async def no_demand(pool: str, now: float) -> int:
    """The static-target demand source: misses never raise the target."""
    return 0


def derived_cap(entry: PolicyEntry, scenario: Scenario) -> int:
    """The runtime's derived pool cap under the policy (0 = unbounded)."""
    params = entry.typed_params()
    if isinstance(params, StaticTargetParams):
        return max(1, params.memory_budget_mib // max(1, scenario.pool.memory_mib))
    return 0


class StaticTargetRuntime(ObservedRuntime):
    """duckgres #597's runtime: `spawn_concurrency` spawns at a time, each permit held
    until the pod is ready or gone, and a pool cap derived from a memory budget."""

    def __init__(
        self, inner: KubernetesRuntime, *, clock: Clock, params: StaticTargetParams
    ) -> None:
        super().__init__(inner, clock=clock)
        self._permits = asyncio.Semaphore(params.spawn_concurrency)
        self._budget_mib = params.memory_budget_mib
        self._holding: set[str] = set()

    def derived_cap(self, pool: PoolSpec) -> int:
        """The memory budget divided by one worker's memory (never 0: that is unbounded)."""
        template = pool.template
        per_worker = 1
        if isinstance(template, PodTemplate):
            per_worker = max(1, memory_bytes(template.memory) // (1 << 20))
        return max(1, self._budget_mib // per_worker)

    async def spawn(self, worker: Worker, pool: PoolSpec) -> Mapping[str, Any]:
        """Wait for a permit, create the pod, and keep the permit until it is ready."""
        await self._permits.acquire()
        self._holding.add(worker.id)
        try:
            return await super().spawn(worker, pool)
        except BaseException:
            self._settled(worker.id)
            raise

    def _settled(self, worker_id: str) -> None:
        if worker_id in self._holding:
            self._holding.discard(worker_id)
            self._permits.release()


class PercentHeadroomRuntime(ObservedRuntime):
    """duckgres #757/#894's headroom: placeholders for `percent` of the live worker pods,
    idle ones included, so idle capacity buys more idle capacity."""

    def __init__(
        self, inner: KubernetesRuntime, *, clock: Clock, params: PercentHeadroomParams
    ) -> None:
        super().__init__(inner, clock=clock)
        self._share = params.percent / 100

    async def reconcile_headroom(self, pools: Sequence[PoolSpec]) -> None:
        """Size each pool's placeholders from its live worker pods, then reconcile them."""
        live: dict[str, int] = {}
        for obj in await self.inner.list_objects():
            if obj.alive:
                live[obj.pool] = live.get(obj.pool, 0) + 1
        sized = [
            dataclasses.replace(
                pool, headroom_nodes=math.ceil(self._share * live.get(pool.name, 0))
            )
            for pool in pools
        ]
        await self.inner.reconcile_headroom(sized)


class RunOnceElector:
    """duckgres #820's elector: one `run()` that returns when its first term ends, so a
    single renewal blip takes the replica out of the election for good."""

    def __init__(self, make: Callable[[Callable[[], None]], KubernetesLeaseElector]) -> None:
        self._term_over = asyncio.Event()
        self.inner = make(self._term_over.set)

    @property
    def is_leader(self) -> bool:
        """As the wrapped elector's."""
        return self.inner.is_leader

    @property
    def epoch(self) -> int:
        """As the wrapped elector's."""
        return self.inner.epoch

    async def run(self) -> None:
        """Contend and lead until the first term ends, then stop contending."""
        task = asyncio.ensure_future(self.inner.run())
        over = asyncio.ensure_future(self._term_over.wait())
        try:
            await asyncio.wait((task, over), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pending in (task, over):
                pending.cancel()
            await asyncio.gather(task, over, return_exceptions=True)

    async def resign(self) -> None:
        """As the wrapped elector's."""
        await self.inner.resign()


# -- rollouts ------------------------------------------------------------------------------


def planner_for(entry: PolicyEntry) -> Planner | None:
    """The rollout plan under the policy (None: stoker's own)."""
    planners: dict[str, Planner] = {
        "canary-pool-default": pool_default_plan,
        "canary-others-capacity": others_capacity_plan,
    }
    return planners.get(entry.policy)


def pool_default_plan(**inputs: Any) -> RolloutPlan:
    """stoker's plan (`rollout_plan`, same arguments), but the ramping revision's warm
    target is the pool's default target times its share: neither the other revisions'
    load nor the demand counts."""
    plan = rollout_plan(**inputs)
    pool: PoolDemand = inputs["pool"]
    ramping = plan.ramping
    if ramping is None:
        return plan
    part = plan.part(ramping)
    default = dataclasses.replace(part, warm_target=math.ceil(pool.warm_target * part.share))
    return dataclasses.replace(plan, revisions={**plan.revisions, ramping: default})


def others_capacity_plan(**inputs: Any) -> RolloutPlan:
    """stoker's plan (`rollout_plan`, same arguments), but the ramping revision's warm
    target is sized as stoker did before #25: the other revisions' busy and warm workers
    times the share it is sized for (its step's, or the next one's while it grows), never
    its own, within the cap's room (else the others' capacity plus the pool's target)."""
    plan = rollout_plan(**inputs)
    ramping = plan.ramping
    if ramping is None:
        return plan
    counts: Mapping[str, RevisionCounts] = inputs["counts"]
    pool: PoolDemand = inputs["pool"]
    own = counts.get(ramping, RevisionCounts())
    others = [c for revision, c in counts.items() if revision != ramping]
    capacity = sum(c.busy + c.warm for c in others)
    whole = desired_warm(pool.warm_target, pool.demand, pool.cap)
    room = pool.cap - sum(c.live for c in others) if pool.cap > 0 else capacity + whole
    part = plan.part(ramping)
    # The share stoker's plan sized the ramp for (its step's or, growing, the next one's).
    sized_for = part.warm_target / whole if whole else part.share
    wanted = max(math.ceil(capacity * sized_for), own.busy + math.ceil(whole * part.share))
    target = max(0, min(max(0, room), wanted) - own.busy)
    sized = dataclasses.replace(part, warm_target=target)
    return dataclasses.replace(plan, revisions={**plan.revisions, ramping: sized})
