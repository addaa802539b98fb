"""How each policy assembles its control-plane replicas on the simulated cluster.

**stoker**, the policy under test, is exactly what `stoker serve` runs in a cluster, one
`ControlPlane` per replica:

- a `KubernetesRuntime` on `SimCluster.client(f"cp-{i}", qps, burst, latency)`, its own
  API budget, with a simulated activator (`SimActivator`: a latency, an optional failure
  rate and the worker-side fence of DESIGN.md §7, no HTTP);
- a `KubernetesLeaseElector` on the same client view (a `lease_blip` fault on `cp-i`
  hits its renewals);
- one shared `SqliteStore(":memory:")`, one database for all replicas, each wrapped by
  `ObservedStore` (open once, closed by the runner; every successful write reported to
  the invariant checker);
- the run's `LoopClock` and seeded `Ids`, so a seed replays the run exactly.

The **baselines** re-enact historical failures with the same parts, changed only by
wrappers and settings that live here, in the simulator:

- **static-target** (duckgres #597): a demand source that always says 0 (the pool only
  refills to its static target, one spawn per worker taken), a runtime whose `spawn`
  holds one of 3 permits until the pod is ready or gone, and whose `derived_cap` is a
  memory budget divided by a worker's memory;
- **run-once-elector** (duckgres #820): an elector whose `run()` returns once its first
  term ends, and no fallback reaper (its interval pushed beyond any run);
- **percent-headroom** (duckgres #757/#894): a runtime whose `reconcile_headroom` keeps
  ceil(percent x live workers, idle ones included) worker-sized placeholders.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from stoker.adapters.elector_k8s import KubernetesLeaseElector
from stoker.adapters.runtime_kubernetes import KubernetesRuntime
from stoker.adapters.store_sqlite import SqliteStore
from stoker.control.ids import Ids
from stoker.control.plane import ControlPlane
from stoker.domain.errors import ActivationRejected, RuntimeFailure
from stoker.domain.records import Claim, DemandRecord, Instance, LeaseRecord, Worker
from stoker.domain.specs import (
    Activation,
    OrgSpec,
    PlaneSettings,
    PodTemplate,
    PoolSpec,
    Timeouts,
)
from stoker.domain.states import ClaimState, WorkerState
from stoker.ports.clock import Clock
from stoker.ports.elector import Elector
from stoker.ports.runtime import ActivationPayload, RuntimeListener, RuntimeObject
from stoker.ports.store import ReserveResult, SpawnRequest, SpawnResult, StateCount
from stoker.sim.cluster.client import SimClient
from stoker.sim.cluster.resources import memory_bytes
from stoker.sim.cluster.simcluster import SimCluster
from stoker.sim.scenario import (
    PLACEHOLDER_PRIORITY_CLASS,
    WORKER_PRIORITY_CLASS,
    ActivatorConfig,
    ControlPlaneConfig,
    PercentHeadroomParams,
    PolicyEntry,
    Scenario,
    StaticTargetParams,
)

#: An interval no run reaches: how a loop is switched off through settings alone.
NEVER_S = 1e12


class Observer(Protocol):
    """What the policies' wrappers report to (the invariant checker)."""

    def worker_written(self, replica: int, before: WorkerState | None, worker: Worker) -> None:
        """A write of a worker row succeeded."""
        ...

    def spawn_reserved(self, replica: int, req: SpawnRequest, reserved: int) -> None:
        """Spawn slots were reserved."""
        ...

    def activation(self, worker_id: str, org: str, epoch: int) -> None:
        """A worker received an activation."""
        ...

    def leader_changed(self, replica: int, leading: bool) -> None:
        """A replica started or stopped leading."""
        ...


# -- the specs every policy shares ---------------------------------------------------------


def pool_spec(scenario: Scenario) -> PoolSpec:
    """The scenario's pool as stoker's `PoolSpec` (a pod template on the simulated cluster)."""
    pool = scenario.pool
    return PoolSpec(
        name=pool.name,
        template=PodTemplate(
            image=pool.image,
            cpu=pool.cpu,
            memory=pool.memory,
            node_selector=dict(pool.node_selector),
            tolerations=tuple(dict(t) for t in pool.tolerations),
            priority_class=WORKER_PRIORITY_CLASS,
        ),
        warm_target=pool.warm_target,
        max_workers=pool.max_workers,
        max_workers_per_org=pool.max_workers_per_org,
        hot_idle_ttl=pool.hot_idle_ttl_s,
        max_ttl=pool.max_ttl_s,
        min_hot_idle=pool.min_hot_idle,
        reuse=pool.reuse,
        activation=Activation.HTTP,
        scale_down_delay=pool.scale_down_delay_s,
        lease_s=pool.lease_s,
        claim_timeout_s=pool.claim_timeout_s,
        timeouts=Timeouts(
            spawn_s=pool.spawn_timeout_s,
            reserve_s=pool.reserve_timeout_s,
            activation_s=pool.activation_timeout_s,
            drain_s=pool.drain_timeout_s,
            stop_grace_s=pool.stop_grace_s,
        ),
        headroom_nodes=pool.headroom_nodes,
    )


def org_specs(scenario: Scenario) -> list[OrgSpec]:
    """Per-org overrides of the tenants that set any."""
    specs = []
    for group in scenario.tenants:
        if (
            group.max_workers is None
            and group.hot_idle_ttl_s is None
            and group.min_hot_idle is None
        ):
            continue
        for org in group.org_names():
            specs.append(
                OrgSpec(
                    name=org,
                    hot_idle_ttl=group.hot_idle_ttl_s,
                    min_hot_idle=group.min_hot_idle,
                    max_workers=group.max_workers,
                )
            )
    return specs


def plane_settings(scenario: Scenario) -> PlaneSettings:
    """The replicas' intervals and budgets, from the scenario (realistic, not test, values)."""
    cp = scenario.control_plane
    return PlaneSettings(
        janitor_interval_s=cp.janitor_interval_s,
        reaper_interval_s=cp.reaper_interval_s,
        instance_heartbeat_s=cp.instance_heartbeat_s,
        instance_expiry_s=cp.instance_expiry_s,
        stranded_grace_s=cp.stranded_grace_s,
        spawn_rate=cp.spawn_rate,
        spawn_burst=cp.spawn_burst,
    )


def derived_cap(entry: PolicyEntry, scenario: Scenario) -> int:
    """The runtime's derived pool cap under the policy (0 = unbounded)."""
    params = entry.typed_params()
    if isinstance(params, StaticTargetParams):
        return max(1, params.memory_budget_mib // max(1, scenario.pool.memory_mib))
    return 0


# -- the shared store, one wrapper per replica ---------------------------------------------


class ObservedStore:
    """One replica's handle on the shared store: every call goes to `inner`; `open` opens
    it once for all, `close` leaves it to the runner; successful writes are reported."""

    def __init__(self, inner: SqliteStore, *, replica: int, observer: Observer) -> None:
        self.inner = inner
        self.replica = replica
        self._observer = observer

    async def open(self) -> None:
        """Open the shared database (a no-op once open)."""
        await self.inner.open()

    async def close(self) -> None:
        """Nothing: the database outlives every replica; the runner closes it."""

    async def schema_version(self) -> int:
        """As `Store.schema_version`."""
        return await self.inner.schema_version()

    def _written(self, before: WorkerState | None, worker: Worker | None) -> None:
        if worker is not None:
            self._observer.worker_written(self.replica, before, worker)

    async def reserve_spawn_slots(
        self, req: SpawnRequest, ids: Sequence[str], now: float
    ) -> SpawnResult:
        """As `Store.reserve_spawn_slots`, reported."""
        result = await self.inner.reserve_spawn_slots(req, ids, now)
        for worker in result.workers:
            self._written(None, worker)
        self._observer.spawn_reserved(self.replica, req, len(result.workers))
        return result

    async def transition(
        self,
        worker_id: str,
        *,
        expect: WorkerState,
        epoch: int,
        to: WorkerState,
        now: float,
        bump_epoch: bool = False,
        changes: Mapping[str, Any] | None = None,
    ) -> Worker | None:
        """As `Store.transition`, reported."""
        worker = await self.inner.transition(
            worker_id,
            expect=expect,
            epoch=epoch,
            to=to,
            now=now,
            bump_epoch=bump_epoch,
            changes=changes,
        )
        if to is not expect:
            self._written(expect, worker)
        return worker

    async def reserve(
        self,
        worker_id: str,
        *,
        expect: WorkerState,
        epoch: int,
        org: str,
        org_cap: int,
        owner: str,
        now: float,
        activate: bool = False,
    ) -> ReserveResult:
        """As `Store.reserve`, reported."""
        result = await self.inner.reserve(
            worker_id,
            expect=expect,
            epoch=epoch,
            org=org,
            org_cap=org_cap,
            owner=owner,
            now=now,
            activate=activate,
        )
        self._written(expect, result.worker)
        return result

    async def reserve_any(
        self,
        pool: str,
        revision: str,
        *,
        expect: WorkerState,
        org: str,
        org_cap: int,
        owner: str,
        now: float,
        activate: bool = False,
    ) -> ReserveResult:
        """As `Store.reserve_any`, reported."""
        result = await self.inner.reserve_any(
            pool,
            revision,
            expect=expect,
            org=org,
            org_cap=org_cap,
            owner=owner,
            now=now,
            activate=activate,
        )
        self._written(expect, result.worker)
        return result

    async def get_worker(self, worker_id: str) -> Worker | None:
        """As `Store.get_worker`."""
        return await self.inner.get_worker(worker_id)

    async def list_workers(
        self,
        *,
        pool: str | None = None,
        states: Collection[WorkerState] | None = None,
        org: str | None = None,
        owner: str | None = None,
        not_owners: Collection[str] | None = None,
        limit: int | None = None,
    ) -> list[Worker]:
        """As `Store.list_workers`."""
        return await self.inner.list_workers(
            pool=pool, states=states, org=org, owner=owner, not_owners=not_owners, limit=limit
        )

    async def count_workers(self) -> list[StateCount]:
        """As `Store.count_workers`."""
        return await self.inner.count_workers()

    async def bind(self, worker_id: str, *, epoch: int, claim: Claim, now: float) -> Worker | None:
        """As `Store.bind`, reported."""
        worker = await self.inner.bind(worker_id, epoch=epoch, claim=claim, now=now)
        self._written(WorkerState.ACTIVATING, worker)
        return worker

    async def end_claim(
        self,
        claim_id: str,
        *,
        state: ClaimState,
        worker_to: WorkerState,
        now: float,
        reason: str | None = None,
        worker_changes: Mapping[str, Any] | None = None,
    ) -> tuple[Claim, Worker] | None:
        """As `Store.end_claim`, reported."""
        result = await self.inner.end_claim(
            claim_id,
            state=state,
            worker_to=worker_to,
            now=now,
            reason=reason,
            worker_changes=worker_changes,
        )
        if result is not None:
            self._written(WorkerState.HOT, result[1])
        return result

    async def fail_claim(self, claim_id: str, *, now: float, reason: str) -> Claim | None:
        """As `Store.fail_claim`."""
        return await self.inner.fail_claim(claim_id, now=now, reason=reason)

    async def renew_claim(self, claim_id: str, *, expires_at: float, now: float) -> Claim | None:
        """As `Store.renew_claim`."""
        return await self.inner.renew_claim(claim_id, expires_at=expires_at, now=now)

    async def get_claim(self, claim_id: str) -> Claim | None:
        """As `Store.get_claim`."""
        return await self.inner.get_claim(claim_id)

    async def list_claims(
        self,
        *,
        states: Collection[ClaimState] | None = None,
        expires_before: float | None = None,
        owner: str | None = None,
        limit: int | None = None,
    ) -> list[Claim]:
        """As `Store.list_claims`."""
        return await self.inner.list_claims(
            states=states, expires_before=expires_before, owner=owner, limit=limit
        )

    async def register_instance(
        self, instance_id: str, *, now: float, meta: Mapping[str, Any]
    ) -> None:
        """As `Store.register_instance`."""
        await self.inner.register_instance(instance_id, now=now, meta=meta)

    async def heartbeat_instance(self, instance_id: str, *, now: float) -> bool:
        """As `Store.heartbeat_instance`."""
        return await self.inner.heartbeat_instance(instance_id, now=now)

    async def expire_instances(
        self, *, before: float, now: float, keep: str | None = None
    ) -> list[str]:
        """As `Store.expire_instances`."""
        return await self.inner.expire_instances(before=before, now=now, keep=keep)

    async def stop_instance(self, instance_id: str, *, now: float) -> None:
        """As `Store.stop_instance`."""
        await self.inner.stop_instance(instance_id, now=now)

    async def list_instances(self) -> list[Instance]:
        """As `Store.list_instances`."""
        return await self.inner.list_instances()

    async def acquire_lease(
        self, name: str, *, holder: str, now: float, duration_s: float
    ) -> LeaseRecord | None:
        """As `Store.acquire_lease`."""
        return await self.inner.acquire_lease(name, holder=holder, now=now, duration_s=duration_s)

    async def release_lease(self, name: str, *, holder: str, now: float) -> bool:
        """As `Store.release_lease`."""
        return await self.inner.release_lease(name, holder=holder, now=now)

    async def get_lease(self, name: str) -> LeaseRecord | None:
        """As `Store.get_lease`."""
        return await self.inner.get_lease(name)

    async def record_demand(
        self, instance_id: str, demand: Mapping[str, tuple[int, int]], *, now: float
    ) -> None:
        """As `Store.record_demand`."""
        await self.inner.record_demand(instance_id, demand, now=now)

    async def read_demand(self) -> list[DemandRecord]:
        """As `Store.read_demand`."""
        return await self.inner.read_demand()

    async def purge(self, *, before: float) -> int:
        """As `Store.purge`."""
        return await self.inner.purge(before=before)


# -- runtimes ----------------------------------------------------------------------------


class ObservedRuntime:
    """The Kubernetes runtime with every call passed through; it also measures pod starts
    (spawn requested to ready) of the workers this replica spawned. Policies subclass it
    to change one behaviour."""

    kind = "kubernetes"

    def __init__(self, inner: KubernetesRuntime, *, clock: Clock) -> None:
        self.inner = inner
        self._clock = clock
        self._listener: RuntimeListener | None = None
        self._spawned_at: dict[str, float] = {}
        #: Seconds from `spawn` to readiness, of every worker this replica spawned.
        self.pod_starts: list[float] = []

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

    def worker_lost(self, worker_id: str, reason: str) -> None:
        """Tell the pool manager."""
        self._spawned_at.pop(worker_id, None)
        self._settled(worker_id)
        if self._listener is not None:
            self._listener.worker_lost(worker_id, reason)

    def _settled(self, worker_id: str) -> None:
        """Hook: the worker's spawn is over (ready, gone or stopped)."""

    async def start(self) -> None:
        """As `Runtime.start`."""
        await self.inner.start()

    async def close(self) -> None:
        """As `Runtime.close`."""
        await self.inner.close()

    def derived_cap(self, pool: PoolSpec) -> int:
        """As `Runtime.derived_cap` (0 in cluster mode)."""
        return self.inner.derived_cap(pool)

    async def spawn(self, worker: Worker, pool: PoolSpec) -> Mapping[str, Any]:
        """As `Runtime.spawn`, timed."""
        self._spawned_at[worker.id] = self._clock.monotonic()
        try:
            return await self.inner.spawn(worker, pool)
        except BaseException:
            self._spawned_at.pop(worker.id, None)
            raise

    async def activate(self, worker: Worker, payload: ActivationPayload, timeout: float) -> None:
        """As `Runtime.activate`."""
        await self.inner.activate(worker, payload, timeout)

    async def stop(self, worker: Worker, grace_s: float) -> None:
        """As `Runtime.stop`."""
        self._spawned_at.pop(worker.id, None)
        self._settled(worker.id)
        await self.inner.stop(worker, grace_s)

    async def adopt(self, worker: Worker) -> bool:
        """As `Runtime.adopt`."""
        return await self.inner.adopt(worker)

    async def list_objects(self) -> list[RuntimeObject]:
        """As `Runtime.list_objects`."""
        return await self.inner.list_objects()

    async def set_busy(self, worker: Worker, busy: bool) -> None:
        """As `Runtime.set_busy`."""
        await self.inner.set_busy(worker, busy)

    async def reconcile_headroom(self, pools: Sequence[PoolSpec]) -> None:
        """As `Runtime.reconcile_headroom`."""
        await self.inner.reconcile_headroom(pools)


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


# -- electors ----------------------------------------------------------------------------


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


# -- the worker side of activation -----------------------------------------------------------


class SimActivator:
    """The workers' `/activate`, simulated: a latency, an optional failure, and the
    worker-side fence (a second org or an epoch not newer than the last is refused).

    One instance serves every replica: the workers are the same pods whoever activates.
    """

    def __init__(
        self, *, config: ActivatorConfig, rng: random.Random, clock: Clock, observer: Observer
    ) -> None:
        self._latency = config.latency
        self._failure_rate = config.failure_rate
        self._rng = rng
        self._clock = clock
        self._observer = observer
        self._held: dict[str, tuple[str, int]] = {}
        self.activations = 0
        self.rejections = 0
        self.failures = 0

    async def __call__(self, worker: Worker, payload: ActivationPayload, timeout: float) -> None:
        """Activate `worker` for `payload.org` (see the class docstring)."""
        delay = self._latency.sample(self._rng) if self._latency is not None else 0.0
        if delay > timeout:
            await self._clock.sleep(timeout)
            self.failures += 1
            raise RuntimeFailure(f"activation of worker {worker.id} timed out after {timeout:g}s")
        if delay > 0:
            await self._clock.sleep(delay)
        self._observer.activation(worker.id, payload.org, payload.epoch)
        held = self._held.get(worker.id)
        if payload.worker_id != worker.id or (
            held is not None and (held[0] != payload.org or payload.epoch <= held[1])
        ):
            self.rejections += 1
            raise ActivationRejected(
                f"worker {worker.id} refused org {payload.org} at epoch {payload.epoch}"
            )
        if self._failure_rate and self._rng.random() < self._failure_rate:
            self.failures += 1
            raise RuntimeFailure(f"worker {worker.id} answered 500 to activation")
        self._held[worker.id] = (payload.org, payload.epoch)
        self.activations += 1


# -- assembling the replicas --------------------------------------------------------------


async def _no_demand(pool: str, now: float) -> int:
    """The static-target demand source: misses never raise the target."""
    return 0


@dataclass
class Replica:
    """One control-plane replica and the parts the runner reads."""

    index: int
    plane: ControlPlane
    runtime: ObservedRuntime
    elector: Elector


@dataclass
class Fleet:
    """A policy's replicas, sharing one store, one activator and one cluster."""

    policy: PolicyEntry
    pool: PoolSpec
    replicas: list[Replica]
    activator: SimActivator
    #: Indexes of the replicas leading now (from the electors' callbacks).
    leaders: set[int] = field(default_factory=set)

    def leader(self) -> Replica | None:
        """The replica leading now (the lowest index if, for a moment, two believe so)."""
        for replica in self.replicas:
            if replica.index in self.leaders and replica.elector.is_leader:
                return replica
        return None

    def pod_starts(self) -> list[float]:
        """Pod start times measured by every replica."""
        return [s for replica in self.replicas for s in replica.runtime.pod_starts]


def build_fleet(
    *,
    scenario: Scenario,
    cluster: SimCluster,
    store: SqliteStore,
    clock: Clock,
    observer: Observer,
) -> Fleet:
    """Assemble the replicas of the scenario's (single) policy; see the module docstring.

    `scenario` is the policy's view (`Scenario.for_policy`). Nothing is started.
    """
    entry = scenario.policies[0]
    params = entry.typed_params()
    cp = scenario.control_plane
    pool = pool_spec(scenario)
    orgs = org_specs(scenario)
    settings = plane_settings(scenario)
    if entry.policy == "run-once-elector":
        # No fallback reaper: nothing reaps while no janitor runs.
        settings = dataclasses.replace(settings, reaper_interval_s=NEVER_S)
    activator = SimActivator(
        config=scenario.activator,
        rng=random.Random(f"{scenario.seed}/activator"),
        clock=clock,
        observer=observer,
    )
    fleet = Fleet(policy=entry, pool=pool, replicas=[], activator=activator)
    placeholder_size = None
    if scenario.pool.placeholder_cpu is not None and scenario.pool.placeholder_memory is not None:
        placeholder_size = (scenario.pool.placeholder_cpu, scenario.pool.placeholder_memory)
    if entry.policy == "percent-headroom":
        # duckgres sizes a slot as the largest worker, not as a node.
        placeholder_size = None
    for index in range(cp.replicas):
        ids = Ids(scenario.seed * 1000 + index)
        instance = ids.instance()
        client = cluster.client(
            f"cp-{index}", qps=cp.client_qps, burst=cp.client_burst, latency=cp.client_latency
        )
        inner = KubernetesRuntime(
            cluster=client,
            clock=clock,
            fleet=cp.fleet,
            instance_id=instance,
            activator=activator,
            resync_s=cp.resync_s,
            placeholder_priority_class=PLACEHOLDER_PRIORITY_CLASS,
            placeholder_size=placeholder_size,
        )
        runtime: ObservedRuntime
        if isinstance(params, StaticTargetParams):
            runtime = StaticTargetRuntime(inner, clock=clock, params=params)
        elif isinstance(params, PercentHeadroomParams):
            runtime = PercentHeadroomRuntime(inner, clock=clock, params=params)
        else:
            runtime = ObservedRuntime(inner, clock=clock)
        elector = _elector(
            entry,
            fleet,
            observer,
            client=client,
            clock=clock,
            cp=cp,
            index=index,
            identity=instance,
        )
        plane = ControlPlane(
            store=ObservedStore(store, replica=index, observer=observer),
            runtime=runtime,
            pools=[pool],
            orgs=orgs,
            settings=settings,
            clock=clock,
            elector=elector,
            ids=ids,
            instance_id=instance,
            demand=_no_demand if entry.policy == "static-target" else None,
        )
        fleet.replicas.append(Replica(index=index, plane=plane, runtime=runtime, elector=elector))
    return fleet


def _elector(
    entry: PolicyEntry,
    fleet: Fleet,
    observer: Observer,
    *,
    client: SimClient,
    clock: Clock,
    cp: ControlPlaneConfig,
    index: int,
    identity: str,
) -> Elector:
    """The replica's elector on its client view; it tells the fleet and the observer
    when it starts and stops leading (run-once for the `run-once-elector` policy)."""

    def started(_epoch: int) -> None:
        fleet.leaders.add(index)
        observer.leader_changed(index, True)

    def stopped() -> None:
        fleet.leaders.discard(index)
        observer.leader_changed(index, False)

    def make(also_stopped: Callable[[], None] | None = None) -> KubernetesLeaseElector:
        def on_stopped() -> None:
            stopped()
            if also_stopped is not None:
                also_stopped()

        return KubernetesLeaseElector(
            cluster=client,
            clock=clock,
            identity=identity,
            lease_duration_s=cp.lease_duration_s,
            renew_deadline_s=cp.renew_deadline_s,
            retry_period_s=cp.retry_period_s,
            on_started_leading=started,
            on_stopped_leading=on_stopped,
        )

    if entry.policy == "run-once-elector":
        return RunOnceElector(make)
    return make()
