"""Each policy's control-plane replicas on the simulated cluster, built as `stoker serve`'s.

Every replica is built by `stoker.bootstrap.build_plane`, the builder `stoker serve`
uses, on the run's clock, cluster and store:

- a `KubernetesRuntime` on `SimCluster.client(f"cp-{i}", qps, burst, latency)`, its own
  API budget, inside an `ObservedRuntime`;
- one simulated activator shared by all replicas (`SimActivator`: a latency, an optional
  failure rate and the worker-side fence of docs/worker-protocol.md, no HTTP);
- a `KubernetesLeaseElector` on the same client view (a `lease_blip` fault on `cp-i`
  hits its renewals);
- the one store every replica shares, seen through an `ObservedStore` (open once, closed
  by the runner; every successful worker and claim write reported to the invariant
  checker);
- the run's `LoopClock` and seeded `Ids`, so a seed replays the run exactly.

**stoker**, the policy under test, is exactly that; the baselines (`baselines`) change
it only by the runtime, elector, settings and demand source they pick.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from stoker.adapters.elector_k8s import KubernetesLeaseElector
from stoker.adapters.runtime_kubernetes import KubernetesRuntime
from stoker.bootstrap import Closer, build_plane
from stoker.control.ids import Ids
from stoker.control.plane import ControlPlane
from stoker.domain.activation import ActivationKey
from stoker.domain.errors import ActivationRejected, RuntimeFailure
from stoker.domain.records import Worker
from stoker.domain.specs import PoolSpec
from stoker.ports.activator import ActivationPayload
from stoker.ports.clock import Clock
from stoker.ports.elector import Elector
from stoker.ports.store import Store
from stoker.sim.baselines import (
    RunOnceElector,
    demand_for,
    planner_for,
    runtime_for,
    settings_for,
)
from stoker.sim.cluster import SimClient, SimCluster
from stoker.sim.kpa import KnativeKpa
from stoker.sim.observed import ObservedRuntime, ObservedStore, Observer
from stoker.sim.plane_specs import org_specs, plane_settings, pool_spec
from stoker.sim.scenario import (
    PLACEHOLDER_PRIORITY_CLASS,
    ActivatorConfig,
    KnativeKpaParams,
    Scenario,
)

# -- the worker side of activation -----------------------------------------------------------

#: The simulated fleet's activation key: its pods carry derived secrets like real ones, and
#: a fixed key keeps a run reproducible from its seed.
SIM_ACTIVATION_KEY = ActivationKey(b"stoker-simulator-fleet-activation-key")


class SimActivator:
    """The workers' `/activate`, simulated: a latency, an optional failure, and the
    worker-side fence (a second org or an epoch not newer than the last is refused).
    Implements the `Activator` port. The call is in-process, so there is no request to
    sign: the signature is the HTTP activator's (`tests/adapters/test_activator_http.py`).

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
        #: Share of activations that fail, per revision (a bad image).
        self.revision_failure_rate: dict[str, float] = {}
        #: Whether those fail only when a replica that does not lead activates.
        self.followers_only = False
        self.activations = 0
        self.rejections = 0
        self.failures = 0

    async def activate(
        self,
        worker: Worker,
        payload: ActivationPayload,
        timeout: float,
        *,
        leading: bool = False,
    ) -> None:
        """Activate `worker` for `payload.org` (see the class docstring); `leading`: the
        activating replica leads."""
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
        rate = self.revision_failure_rate.get(worker.revision, self._failure_rate)
        if leading and self.followers_only:
            rate = self._failure_rate
        if rate and self._rng.random() < rate:
            self.failures += 1
            raise RuntimeFailure(f"worker {worker.id} answered 500 to activation")
        self._held[worker.id] = (payload.org, payload.epoch)
        self.activations += 1

    async def close(self) -> None:
        """Nothing to release: no connection is held."""
        return None


class ReplicaActivator:
    """Replica `index`'s door to the shared activator: it says whether the replica leads
    (a bad image may fail only for the replicas that do not)."""

    def __init__(self, shared: SimActivator, replicas: PolicyReplicas, index: int) -> None:
        self._shared, self._replicas, self._index = shared, replicas, index

    async def activate(self, worker: Worker, payload: ActivationPayload, timeout: float) -> None:
        """Activate through the shared activator."""
        leading = self._replicas.leader() == self._index
        await self._shared.activate(worker, payload, timeout, leading=leading)

    async def close(self) -> None:
        """Nothing to release."""
        return None


# -- assembling the replicas --------------------------------------------------------------


@dataclass
class PolicyReplicas:
    """A policy's replicas (`planes[i]` is replica i), sharing one store, one activator
    and one cluster, and what the runner reads of them."""

    pool: PoolSpec
    activator: SimActivator
    planes: list[ControlPlane] = field(default_factory=list)
    #: Replica i's runtime (its pod-start times) and elector, as built.
    runtimes: list[ObservedRuntime] = field(default_factory=list)
    electors: list[Elector] = field(default_factory=list)
    #: Indexes of the replicas leading now (from the electors' callbacks).
    leaders: set[int] = field(default_factory=set)
    #: The knative-kpa policy's autoscaler (the runner feeds it concurrency).
    kpa: KnativeKpa | None = None

    def leader(self) -> int | None:
        """The replica leading now (the lowest index if, for a moment, two believe so)."""
        for index, elector in enumerate(self.electors):
            if index in self.leaders and elector.is_leader:
                return index
        return None

    def pod_starts(self) -> list[float]:
        """Pod start times measured by every replica."""
        return [s for runtime in self.runtimes for s in runtime.pod_starts]


def build_replicas(
    *,
    scenario: Scenario,
    cluster: SimCluster,
    store: Store,
    clock: Clock,
    observer: Observer,
) -> PolicyReplicas:
    """Build the replicas of the scenario's (single) policy; see the module docstring.

    `scenario` is the policy's view (`Scenario.for_policy`). Nothing is started.
    """
    entry = scenario.policies[0]
    activator = SimActivator(
        config=scenario.activator,
        rng=random.Random(f"{scenario.seed}/activator"),
        clock=clock,
        observer=observer,
    )
    replicas = PolicyReplicas(pool=pool_spec(scenario), activator=activator)
    orgs = org_specs(scenario)
    settings = settings_for(entry, plane_settings(scenario))
    demand = demand_for(entry)
    write_latency: Callable[[], float] | None = None
    if (latency := scenario.control_plane.store_write_latency) is not None:
        write_latency = functools.partial(latency.sample, random.Random(f"{scenario.seed}/store"))
    params = entry.typed_params()
    if isinstance(params, KnativeKpaParams):
        replicas.kpa = KnativeKpa(params, store=store, warm_target=replicas.pool.warm_target)
        demand = replicas.kpa
    for index in range(scenario.control_plane.replicas):
        parts = _ReplicaParts(
            scenario, replicas, index, cluster=cluster, clock=clock, observer=observer
        )
        plane = build_plane(
            pools=[replicas.pool],
            orgs=orgs,
            settings=settings,
            clock=clock,
            ids=Ids(scenario.seed * 1000 + index),
            store=ObservedStore(
                store,
                replica=index,
                observer=observer,
                write_latency=write_latency,
                clock=clock,
            ),
            runtime=parts.runtime,
            activator=ReplicaActivator(activator, replicas, index),
            elector=parts.elector,
            demand=demand,
            planner=planner_for(entry),
            # Nobody reads a simulated replica's dashboard or pool listing; the runner
            # samples the fleet itself (`runner._sample`).
            views=False,
        )
        replicas.planes.append(plane)
    return replicas


class _ReplicaParts:
    """Builds replica `index`'s runtime and elector when `build_plane` asks, on one client
    view of the cluster, and adds them to `replicas`."""

    def __init__(
        self,
        scenario: Scenario,
        replicas: PolicyReplicas,
        index: int,
        *,
        cluster: SimCluster,
        clock: Clock,
        observer: Observer,
    ) -> None:
        cp = scenario.control_plane
        self._scenario = scenario
        self._replicas = replicas
        self._index = index
        self._clock = clock
        self._observer = observer
        self._client: SimClient = cluster.client(
            f"cp-{index}", qps=cp.client_qps, burst=cp.client_burst, latency=cp.client_latency
        )

    def runtime(self, instance_id: str, closers: list[Closer]) -> ObservedRuntime:
        """The Kubernetes runtime on the replica's client view, as the policy wraps it."""
        scenario = self._scenario
        pool = scenario.pool
        placeholder_size = None
        if pool.placeholder_cpu is not None and pool.placeholder_memory is not None:
            placeholder_size = (pool.placeholder_cpu, pool.placeholder_memory)
        entry = scenario.policies[0]
        if entry.policy == "percent-headroom":
            # duckgres sizes a slot as the largest worker, not as a node.
            placeholder_size = None
        inner = KubernetesRuntime(
            cluster=self._client,
            clock=self._clock,
            fleet=scenario.control_plane.fleet,
            instance_id=instance_id,
            activation_key=SIM_ACTIVATION_KEY,
            resync_s=scenario.control_plane.resync_s,
            placeholder_priority_class=PLACEHOLDER_PRIORITY_CLASS,
            placeholder_size=placeholder_size,
            prefer_session_nodes=scenario.control_plane.prefer_session_nodes,
        )
        runtime = runtime_for(entry, inner, clock=self._clock)
        self._replicas.runtimes.append(runtime)
        return runtime

    def elector(self, instance_id: str, closers: list[Closer]) -> Elector:
        """A lease elector on the replica's client view that tells `replicas` and the
        observer when it starts and stops leading (run-once for `run-once-elector`)."""
        index, replicas, observer = self._index, self._replicas, self._observer
        cp = self._scenario.control_plane

        def started(_epoch: int) -> None:
            replicas.leaders.add(index)
            observer.leader_changed(index, True)

        def stopped() -> None:
            replicas.leaders.discard(index)
            observer.leader_changed(index, False)

        def make(also_stopped: Callable[[], None] | None = None) -> KubernetesLeaseElector:
            def on_stopped() -> None:
                stopped()
                if also_stopped is not None:
                    also_stopped()

            return KubernetesLeaseElector(
                cluster=self._client,
                clock=self._clock,
                identity=instance_id,
                lease_duration_s=cp.lease_duration_s,
                renew_deadline_s=cp.renew_deadline_s,
                retry_period_s=cp.retry_period_s,
                on_started_leading=started,
                on_stopped_leading=on_stopped,
            )

        elector: Elector = (
            RunOnceElector(make)
            if self._scenario.policies[0].policy == "run-once-elector"
            else make()
        )
        replicas.electors.append(elector)
        return elector
