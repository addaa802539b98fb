"""`SimCluster`: a simulated Kubernetes cluster behind the ClusterAPI port.

It composes an API server (`FakeApiServer`, one per namespace: the workers' and the
background's), a scheduler, kubelets, a Karpenter-like node autoscaler, workload
controllers and a background load, all driven by one `Timeline` on the injected clock.
The real control plane talks to it through `client(name, ...)` views, each with its own
QPS budget, latency and scheduled faults, exactly as it would talk to a cluster.

One rule keeps the model consistent: what a pod *is* is learned only from the API
server's change stream, which `PodMirror` (`mirror`) follows into the working state; so
tests and scenarios may also drive pods by hand (`api.set_pod_status`). What the cluster
reports is read by `ClusterReport` (`snapshot`).

Everything is deterministic for a given seed: one `random.Random`, insertion-ordered
containers only, no wall clock. Use `LoopClock(epoch=...)` for reproducible timestamps.
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from functools import partial

from stoker.domain.errors import ConfigError
from stoker.ports.clock import Clock
from stoker.ports.cluster import ObjectNotFound, Pod, PodPhase
from stoker.sim.cluster.apiserver import FakeApiServer
from stoker.sim.cluster.autoscaler import (
    AutoscalerParts,
    Consolidator,
    Provisioner,
)
from stoker.sim.cluster.client import ClientStats, FaultKind, FaultSchedule, SimClient
from stoker.sim.cluster.config import SimClusterConfig
from stoker.sim.cluster.disruption import DisruptionBudgets, EvictionVerdict
from stoker.sim.cluster.distributions import Distribution
from stoker.sim.cluster.kubelet import Kubelet
from stoker.sim.cluster.mirror import PodMirror
from stoker.sim.cluster.model import (
    NodePool,
    PodDisruptionBudget,
    SimNode,
    SimPod,
)
from stoker.sim.cluster.nodes import NodeFleet
from stoker.sim.cluster.scheduler import Scheduler
from stoker.sim.cluster.snapshot import ClusterReport, ClusterSnapshot, NodeView, PodUsage
from stoker.sim.cluster.specs import Archetype, PdbSpec, Shape
from stoker.sim.cluster.timeline import Timeline
from stoker.sim.cluster.workloads import BackgroundLoad, ConstantProfile, WorkloadController

logger = logging.getLogger("stoker.sim.cluster")

_FINISHED = frozenset({PodPhase.FAILED, PodPhase.SUCCEEDED})


class SimCluster:
    """A simulated Kubernetes cluster; see the module docstring.

    `start()` begins the controllers; `stop()` ends them and re-raises an error any of
    them hit. Pods created before `start()` wait, Pending, for it.
    """

    def __init__(
        self,
        config: SimClusterConfig | None = None,
        *,
        clock: Clock,
        rng: random.Random,
    ) -> None:
        self.config = config = config or SimClusterConfig()
        self._clock = clock
        self._rng = rng
        self.timeline = Timeline(clock, config.tick_s)
        self._t0: float | None = None
        self._started = False
        #: The workers' namespace: what `api` and `client()` views act in.
        self.api = self._new_server(config.namespace)
        if config.background.namespace == config.namespace:
            self.background_api = self.api
        else:
            self.background_api = self._new_server(config.background.namespace)
        pools = sorted(config.node_pools, key=lambda pool: -pool.weight)
        self.pools: tuple[NodePool, ...] = tuple(NodePool(pool) for pool in pools)
        self.fleet = NodeFleet(
            pools=self.pools,
            timeline=self.timeline,
            rng=rng,
            listener=self,
        )
        self.budgets = DisruptionBudgets()
        self.scheduler = Scheduler(
            config=config.scheduler,
            timeline=self.timeline,
            on_unschedulable=self._unschedulable,
            nodes=self.fleet.by_name,
        )
        self.kubelet = Kubelet(config=config.kubelet, timeline=self.timeline, rng=rng)
        autoscaling = AutoscalerParts(config.autoscaler, self.fleet, self.scheduler, self.timeline)
        self._autoscaler_counters = autoscaling.counters
        self.provisioner = Provisioner(autoscaling)
        self.consolidator = Consolidator(autoscaling, evict=self._evict)
        self.controller = WorkloadController(
            server=self.background_api,
            timeline=self.timeline,
            rng=rng,
            config=config.controllers,
            budgets=self.budgets,
        )
        self.background = BackgroundLoad(
            config=config.background, controller=self.controller, place_now=self._place_now
        )
        self._faults = FaultSchedule(config.faults)
        self._client_stats: dict[str, ClientStats] = {}
        self.mirror = PodMirror(
            namespaces=(config.namespace, config.background.namespace),
            background=self.background_api,
            priorities=config.priorities(),
            pools=self.pools,
            track_labels=config.track_labels,
            timeline=self.timeline,
            fleet=self.fleet,
            budgets=self.budgets,
            scheduler=self.scheduler,
            kubelet=self.kubelet,
            controller=self.controller,
            consolidator=self.consolidator,
        )
        self.report = ClusterReport(
            mirror=self.mirror,
            fleet=self.fleet,
            scheduler=self.scheduler,
            kubelet=self.kubelet,
            autoscaler=self._autoscaler_counters,
            controller=self.controller,
            background=self.background,
            background_namespace=self.background_api.namespace,
            budgets=self.budgets,
            client_stats=self._client_stats,
            t0=lambda: self._t0,
        )
        # Before anyone else's: the working state follows a change before it is observed.
        for server in dict.fromkeys((self.api, self.background_api)):
            server.add_listener(partial(self.mirror.changed, server))

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Launch the initial nodes and start every controller (on the running loop)."""
        if self._started:
            return
        self._started = True
        self._t0 = self._clock.monotonic()
        self._faults.t0 = self._t0
        for pool in self.pools:
            for type_name, count in pool.config.initial_nodes.items():
                for _ in range(count):
                    self.fleet.launch(pool, pool.types_by_name[type_name], delay_s=0)
        self.timeline.start()
        for fault in self.config.faults:
            if fault.kind is FaultKind.WATCH_DROP:
                self.timeline.at(self._t0 + fault.at, self._dropper(fault.client))
        self.consolidator.start()
        target = self.config.background.target
        if not (isinstance(target, ConstantProfile) and target.cores == 0):
            self.background.start()

    async def stop(self) -> None:
        """Stop the controllers and the API servers; re-raise a controller's failure."""
        await self.timeline.stop()
        await self.api.close()
        if self.background_api is not self.api:
            await self.background_api.close()
        self.timeline.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Raise if a controller action failed (the model stopped then)."""
        self.timeline.raise_if_failed()

    def now(self) -> float:
        """Seconds since `start()` (0 before it)."""
        return 0.0 if self._t0 is None else self._clock.monotonic() - self._t0

    # -- the ClusterAPI handles ------------------------------------------------------------

    def client(
        self,
        name: str,
        *,
        qps: float | None = None,
        burst: int | None = None,
        latency: Distribution | None = None,
    ) -> SimClient:
        """A ClusterAPI view for one client (e.g. one control-plane replica).

        It has its own token bucket (`qps`/`burst`, the config's defaults if None) and
        latency (the config's `client_latency` if None); faults naming `name` hit it.
        Views of the same name share their statistics.
        """
        stats = self._client_stats.get(name)
        if stats is None:
            stats = self._client_stats[name] = ClientStats(calls=Counter())
        api = self.config.api
        return SimClient(
            name=name,
            server=self.api,
            clock=self._clock,
            rng=self._rng,
            qps=api.client_qps if qps is None else qps,
            burst=api.client_burst if burst is None else burst,
            latency=api.client_latency if latency is None else latency,
            faults=self._faults,
            stats=stats,
        )

    # -- what tests and scenarios may do to the cluster ------------------------------------

    def launch_node(
        self, instance_type: str, *, pool: str | None = None, delay_s: float | None = 0.0
    ) -> str:
        """Launch a node by hand (Ready after `delay_s`; None draws the pool's delay)."""
        target = self._pool(pool)
        itype = target.types_by_name.get(instance_type)
        if itype is None:
            raise ConfigError(f"pool {target.name!r} has no instance type {instance_type!r}")
        return self.fleet.launch(target, itype, delay_s=delay_s).name

    def disrupt_node(self, name: str) -> None:
        """Cordon and drain a node now, as a consolidation decision would."""
        node = self.fleet.by_name.get(name)
        if node is None:
            raise ConfigError(f"no node {name!r}")
        self.consolidator.disrupt(node)

    def create_pdb(
        self,
        name: str,
        selector: Mapping[str, str],
        *,
        min_available: int | str | None = None,
        max_unavailable: int | str | None = None,
        namespace: str | None = None,
    ) -> None:
        """Create a PodDisruptionBudget over the pods `selector` matches."""
        ns = namespace or self.config.namespace
        spec = PdbSpec(name, dict(selector), min_available, max_unavailable)
        budget = PodDisruptionBudget(spec, ns)
        self.budgets.add(budget, self.mirror.pods.get(ns, {}).values())

    def delete_pdb(self, name: str, *, namespace: str | None = None) -> None:
        """Delete a PodDisruptionBudget."""
        self.budgets.remove(namespace or self.config.namespace, name)

    def evict(self, name: str, *, namespace: str | None = None) -> EvictionVerdict:
        """The Eviction API: evict the pod unless a budget forbids it (429) or is ambiguous."""
        pod = self.mirror.pods.get(namespace or self.config.namespace, {}).get(name)
        if pod is None:
            raise ObjectNotFound(f'pods "{name}" not found', status=404)
        return self.budgets.evict(pod)

    def start_workload(
        self,
        archetype: Archetype,
        *,
        replicas: int,
        shape: Shape | None = None,
        lifetime_s: float = math.inf,
        bare: bool = False,
    ) -> str:
        """Start a background workload by hand (outside the load driver); its name."""
        workload = self.controller.start(
            archetype, shape or archetype.shapes[0], replicas, lifetime_s, bare=bare
        )
        self.controller.fill(workload)
        return workload.name

    def end_workload(self, name: str) -> None:
        """End a workload started by `start_workload`."""
        workload = self.controller.workloads.get(name)
        if workload is not None:
            self.controller.end(workload)

    def workload_pods(self, name: str) -> list[str]:
        """Names of the workload's pods (terminating ones included), sorted."""
        workload = self.controller.workloads.get(name)
        return [] if workload is None else sorted(workload.pods)

    # -- what the report reads -------------------------------------------------------------

    def nodes(self) -> list[NodeView]:
        """Every node not terminated, in launch order."""
        return self.report.nodes()

    def node(self, name: str) -> NodeView | None:
        """One node, or None."""
        return self.report.node(name)

    def pod_usage(self, namespace: str | None = None) -> Iterator[PodUsage]:
        """Every pod (of one namespace, or all) with its requests and node."""
        return self.report.pod_usage(namespace)

    def snapshot(self) -> ClusterSnapshot:
        """The cluster now; raises if a controller failed."""
        self.timeline.raise_if_failed()
        return self.report.snapshot(self.now())

    # -- the change listener: the one place the working state follows the API server ------

    def _new_server(self, namespace: str) -> FakeApiServer:
        server = FakeApiServer(
            clock=self._clock,
            namespace=namespace,
            history_size=self.config.api.history_size,
            default_grace_s=self.config.api.default_grace_s,
            watch_latency_s=self.config.api.watch_latency_s,
            on_terminating=lambda pod, grace: self.mirror.deletion_began(server, pod, grace),
        )
        return server

    # -- callbacks from the parts ----------------------------------------------------------

    def _unschedulable(self, pod: SimPod) -> None:
        self.provisioner.pod_unschedulable(pod)

    def node_ready(self, node: SimNode) -> None:
        """As `NodeListener`: place pending pods there; a provisioned node arrived."""
        self.scheduler.capacity_freed(node)
        self.provisioner.node_ready(node)

    def node_cordoned(self, node: SimNode) -> None:
        """As `NodeListener`: the scheduler stops placing pods there."""
        self.scheduler.node_cordoned(node)

    def node_terminated(self, node: SimNode) -> None:
        """As `NodeListener`: the pods bound there are collected."""
        # The pod garbage collector deletes pods bound to a node that no longer exists.
        for pod in list(node.pods):
            self.timeline.at(self.timeline.now(), self._collector(pod))

    def _collector(self, pod: SimPod) -> Callable[[], None]:
        def collect() -> None:
            """Force-delete the orphaned pod unless it went meanwhile."""
            if not pod.gone:
                pod.server.delete_pod_nowait(pod.name, 0)

        return collect

    def _evict(self, pod: SimPod) -> bool:
        return self.budgets.evict(pod) is EvictionVerdict.ALLOWED

    def _place_now(self, pods: list[Pod]) -> None:
        """Bind freshly created pods at once onto new Ready nodes (a pre-bound seed)."""
        now = self.timeline.now()
        sims = [
            self.mirror.pods[p.namespace][p.name]
            for p in pods
            if p.name in self.mirror.pods[p.namespace]
        ]
        for pool, node_filter, shapes in self.provisioner.partition(sims):
            for itype, placed in self.provisioner.plan_nodes(
                pool, node_filter, shapes, in_flight=False
            ):
                node = self.fleet.launch(pool, itype, delay_s=0)
                for sim in placed:
                    for image in sim.images:
                        node.images[image] = now
                    sim.server.set_pod_status(
                        sim.name,
                        node_name=node.name,
                        phase=PodPhase.RUNNING,
                        ready=True,
                        pod_ip=node.next_pod_ip(),
                    )

    def _dropper(self, owner: str | None) -> Callable[[], None]:
        return lambda: self.api.drop_watches(owner=owner)

    # -- helpers ---------------------------------------------------------------------------

    def _pool(self, name: str | None) -> NodePool:
        if name is None:
            return self.pools[0]
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise ConfigError(f"no node pool {name!r}")
