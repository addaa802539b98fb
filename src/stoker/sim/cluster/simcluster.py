"""`SimCluster`: a simulated Kubernetes cluster behind the ClusterAPI port.

It composes an API server (`FakeApiServer`, one per namespace: the workers' and the
background's), a scheduler, kubelets, a Karpenter-like node autoscaler, workload
controllers and a background load, all driven by one `Timeline` on the injected clock.
The real control plane talks to it through `client(name, ...)` views, each with its own
QPS budget, latency and scheduled faults, exactly as it would talk to a cluster.

One rule keeps the model consistent: what a pod *is* (bound where, Running, Ready,
terminating, labelled how) is learned only from the API server's change stream. The
scheduler, kubelet and controllers write to the API server; `SimCluster`'s listener
reflects every change into the working state (`SimPod`, `SimNode`, budgets, totals).
Tests and scenarios may therefore also drive pods by hand (`api.set_pod_status`) and
the model follows.

Everything is deterministic for a given seed: one `random.Random`, insertion-ordered
containers only, no wall clock. Use `LoopClock(epoch=...)` for reproducible timestamps.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from stoker.domain.errors import ConfigError
from stoker.ports.clock import Clock
from stoker.ports.cluster import ObjectNotFound, Pod, PodPhase, PodSpec, WatchEventType
from stoker.sim.cluster.apiserver import FakeApiServer, PodChange
from stoker.sim.cluster.autoscaler import AutoscalerCounters, Consolidator, Provisioner
from stoker.sim.cluster.client import ClientStats, FaultKind, FaultSchedule, SimClient
from stoker.sim.cluster.config import SimClusterConfig
from stoker.sim.cluster.disruption import DisruptionBudgets, EvictionVerdict
from stoker.sim.cluster.distributions import Distribution
from stoker.sim.cluster.kubelet import Kubelet
from stoker.sim.cluster.model import (
    NodePool,
    NodeState,
    PodDisruptionBudget,
    SimNode,
    SimPod,
    blocks_disruption,
)
from stoker.sim.cluster.nodes import NodeFleet
from stoker.sim.cluster.resources import GIB, cpu_millis, memory_bytes
from stoker.sim.cluster.scheduler import Scheduler
from stoker.sim.cluster.specs import Archetype, PdbSpec, Shape
from stoker.sim.cluster.timeline import Timeline
from stoker.sim.cluster.workloads import BackgroundLoad, ConstantProfile, WorkloadController

logger = logging.getLogger("stoker.sim.cluster")

_FINISHED = frozenset({PodPhase.FAILED, PodPhase.SUCCEEDED})


@dataclass(frozen=True, slots=True)
class Resources:
    """An amount of resources: cores, GiB, pods."""

    cpu: float
    memory_gib: float
    pods: int

    @classmethod
    def of(cls, cpu_m: int, mem_b: int, pods: int) -> Resources:
        """From millicores and bytes."""
        return cls(cpu=cpu_m / 1000, memory_gib=mem_b / GIB, pods=pods)


@dataclass(frozen=True, slots=True)
class ClientSnapshot:
    """One client's API usage so far."""

    calls: Mapping[str, int]
    throttled_calls: int
    throttle_wait_s: float
    faults_injected: int


@dataclass(frozen=True, slots=True)
class BackgroundSnapshot:
    """The background load: its target and how much of its demand is live."""

    target_cpu: float
    desired_cpu: float
    workloads_active: int
    desired_pods: int
    live_pods: int
    workloads_started: int
    workloads_ended: int
    pods_created: int
    pods_replaced: int
    pods_destroyed: int
    pods_churned: int


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """The cluster at one moment: what the report plots. `as_dict` is JSON-ready.

    Pod counts span both namespaces (workers and background); `requested` counts pods
    bound to a node (terminating ones included, as their node still holds them);
    `allocatable` counts Ready and draining nodes, `allocatable_launching` the nodes
    not Ready yet. Totals (`*_total`) count since the cluster started.
    """

    t: float
    nodes_by_state: Mapping[str, int]
    nodes_by_instance_type: Mapping[str, int]
    nodes_by_pool: Mapping[str, int]
    nodes_launched_total: int
    nodes_terminated_total: int
    node_cost_usd: float
    node_cost_usd_per_hour: float
    pods_by_phase: Mapping[str, int]
    pods_by_namespace: Mapping[str, int]
    pods_terminating: int
    pods_queued: int
    pods_unschedulable: int
    pods_nominated: int
    pods_starting: int
    binds_total: int
    image_pulls_total: int
    unschedulable_marks_total: int
    preemptions_total: int
    preemptors_total: int
    evictions_total: int
    eviction_refusals_total: int
    consolidated_empty_total: int
    consolidated_underutilized_total: int
    provisioning_passes_total: int
    allocatable: Resources
    allocatable_launching: Resources
    requested: Resources
    requested_by_priority_class: Mapping[str, Resources]
    requested_by_label: Mapping[str, Mapping[str, Resources]]
    background: BackgroundSnapshot
    api: Mapping[str, ClientSnapshot]

    def as_dict(self) -> dict[str, Any]:
        """Plain dicts and numbers, keys sorted: stable to serialise and compare."""
        result: dict[str, Any] = _sorted(dataclasses.asdict(self))
        return result


def _active(pod: SimPod) -> bool:
    return not pod.terminating and pod.phase not in _FINISHED


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(key): _sorted(value[key]) for key in sorted(value, key=str)}
    if isinstance(value, list | tuple):
        return [_sorted(item) for item in value]
    if isinstance(value, float):
        return round(value, 9)
    return value


@dataclass(frozen=True, slots=True)
class PodUsage:
    """One pod's requests and whereabouts, for callers that classify pods themselves."""

    namespace: str
    name: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    node: str | None
    phase: str
    ready: bool
    terminating: bool
    priority: int
    priority_class: str
    cpu: float
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node as the report sees it."""

    name: str
    pool: str
    instance_type: str
    state: str
    allocatable: Resources
    requested: Resources
    do_not_disrupt_pods: int
    launched_at: float
    ready_at: float | None
    price_per_hour: float


class _Totals:
    """Requested resources of bound pods, overall and by class and tracked label."""

    def __init__(self, track_labels: tuple[str, ...]) -> None:
        self.cpu = 0
        self.mem = 0
        self.pods = 0
        self.by_class: dict[str, list[int]] = {}
        self.track = track_labels
        self.by_label: dict[str, dict[str, list[int]]] = {key: {} for key in track_labels}

    def add(self, pod: SimPod, sign: int) -> None:
        """Count `pod` in (sign +1) or out (sign -1)."""
        self.cpu += sign * pod.cpu
        self.mem += sign * pod.mem
        self.pods += sign
        _bump(self.by_class, pod.priority_class, pod, sign)
        for key in self.track:
            value = pod.labels.get(key)
            if value is not None:
                _bump(self.by_label[key], value, pod, sign)


def _bump(table: dict[str, list[int]], key: str, pod: SimPod, sign: int) -> None:
    row = table.get(key)
    if row is None:
        row = table[key] = [0, 0, 0]
    row[0] += sign * pod.cpu
    row[1] += sign * pod.mem
    row[2] += sign
    if row[2] == 0:
        del table[key]


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
        self._priorities = config.priorities()
        self._t0: float | None = None
        self._started = False
        #: The workers' namespace: what `api` and `client()` views act in.
        self.api = self._new_server(config.namespace)
        if config.background.namespace == config.namespace:
            self.background_api = self.api
        else:
            self.background_api = self._new_server(config.background.namespace)
        self._pods: dict[str, dict[str, SimPod]] = {config.namespace: {}}
        self._pods.setdefault(config.background.namespace, {})
        pools = sorted(config.node_pools, key=lambda pool: -pool.weight)
        self.pools: tuple[NodePool, ...] = tuple(NodePool(pool) for pool in pools)
        self.fleet = NodeFleet(
            pools=self.pools,
            timeline=self.timeline,
            rng=rng,
            on_ready=self._node_ready,
            on_cordoned=self._node_cordoned,
            on_terminated=self._node_terminated,
        )
        self.budgets = DisruptionBudgets()
        self.scheduler = Scheduler(
            config=config.scheduler, timeline=self.timeline, on_unschedulable=self._unschedulable
        )
        self.kubelet = Kubelet(config=config.kubelet, timeline=self.timeline, rng=rng)
        self._autoscaler_counters = AutoscalerCounters()
        self.provisioner = Provisioner(
            config=config.autoscaler,
            fleet=self.fleet,
            scheduler=self.scheduler,
            timeline=self.timeline,
            counters=self._autoscaler_counters,
        )
        self.consolidator = Consolidator(
            config=config.autoscaler,
            fleet=self.fleet,
            scheduler=self.scheduler,
            evict=self._evict,
            timeline=self.timeline,
            counters=self._autoscaler_counters,
        )
        self.controller = WorkloadController(
            server=self.background_api,
            timeline=self.timeline,
            rng=rng,
            config=config.controllers,
            budgets=self.budgets,
        )
        self.background = BackgroundLoad(
            config=config.background,
            controller=self.controller,
            timeline=self.timeline,
            rng=rng,
            place_now=self._place_now,
        )
        self._faults = FaultSchedule(config.faults)
        self._client_stats: dict[str, ClientStats] = {}
        self._requests: dict[tuple[tuple[str, str], ...], tuple[int, int]] = {}
        self._eligibility: dict[
            tuple[object, ...], tuple[tuple[NodePool, ...], tuple[tuple[str, str], ...]]
        ] = {}
        self._seq = 0
        self._phases: Counter[str] = Counter()
        self._terminating = 0
        self._starting = 0
        #: Per namespace: pods that count as replicas (not terminating, not finished).
        self._active: Counter[str] = Counter()
        self._evictions = 0
        self._eviction_refusals = 0
        self._totals = _Totals(config.track_labels)

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
        self.budgets.add(budget, self._pods.get(ns, {}).values())

    def delete_pdb(self, name: str, *, namespace: str | None = None) -> None:
        """Delete a PodDisruptionBudget."""
        self.budgets.remove(namespace or self.config.namespace, name)

    def evict(self, name: str, *, namespace: str | None = None) -> EvictionVerdict:
        """The Eviction API: evict the pod unless a budget forbids it (429) or is ambiguous."""
        pod = self._pods.get(namespace or self.config.namespace, {}).get(name)
        if pod is None:
            raise ObjectNotFound(f'pods "{name}" not found', status=404)
        verdict = self.budgets.verdict(pod)
        self._apply_eviction(pod, verdict)
        return verdict

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
        return [self._view(node) for node in self.fleet]

    def node(self, name: str) -> NodeView | None:
        """One node, or None."""
        node = self.fleet.by_name.get(name)
        return None if node is None else self._view(node)

    def pod_usage(self, namespace: str | None = None) -> Iterator[PodUsage]:
        """Every pod (of one namespace, or all) with its requests and node."""
        spaces = [namespace] if namespace is not None else list(self._pods)
        for ns in spaces:
            for pod in self._pods.get(ns, {}).values():
                yield PodUsage(
                    namespace=ns,
                    name=pod.name,
                    labels=pod.labels,
                    annotations=pod.annotations,
                    node=pod.node_name,
                    phase=pod.phase,
                    ready=pod.ready,
                    terminating=pod.terminating,
                    priority=pod.priority,
                    priority_class=pod.priority_class,
                    cpu=pod.cpu / 1000,
                    memory_bytes=pod.mem,
                )

    def snapshot(self) -> ClusterSnapshot:
        """The cluster now; raises if a controller failed."""
        self.timeline.raise_if_failed()
        alloc = [0, 0, 0]
        launching = [0, 0, 0]
        by_pool: dict[str, int] = {}
        for node in self.fleet:
            row = launching if node.state is NodeState.LAUNCHING else alloc
            row[0] += node.alloc_cpu
            row[1] += node.alloc_mem
            row[2] += node.alloc_pods
            by_pool[node.pool.name] = by_pool.get(node.pool.name, 0) + 1
        sched = self.scheduler.counters
        auto = self._autoscaler_counters
        work = self.controller.counters
        totals = self._totals
        return ClusterSnapshot(
            t=self.now(),
            nodes_by_state={state.value: n for state, n in self.fleet.by_state.items()},
            nodes_by_instance_type=dict(self.fleet.by_type),
            nodes_by_pool=by_pool,
            nodes_launched_total=self.fleet.launched_total,
            nodes_terminated_total=self.fleet.terminated_total,
            node_cost_usd=self.fleet.cost_usd(),
            node_cost_usd_per_hour=self.fleet.cost_rate_usd_per_h(),
            pods_by_phase={phase: n for phase, n in self._phases.items() if n},
            pods_by_namespace={ns: len(pods) for ns, pods in self._pods.items()},
            pods_terminating=self._terminating,
            pods_queued=self.scheduler.queued,
            pods_unschedulable=self.scheduler.unschedulable_count,
            pods_nominated=self.scheduler.nominated_count,
            pods_starting=self._starting,
            binds_total=sched.binds,
            image_pulls_total=self.kubelet.counters.image_pulls,
            unschedulable_marks_total=sched.unschedulable_marks,
            preemptions_total=sched.preemptions,
            preemptors_total=sched.preemptors,
            evictions_total=self._evictions,
            eviction_refusals_total=self._eviction_refusals,
            consolidated_empty_total=auto.consolidated_empty,
            consolidated_underutilized_total=auto.consolidated_underutilized,
            provisioning_passes_total=auto.provisioning_passes,
            allocatable=Resources.of(*alloc),
            allocatable_launching=Resources.of(*launching),
            requested=Resources.of(totals.cpu, totals.mem, totals.pods),
            requested_by_priority_class={
                name: Resources.of(*row) for name, row in totals.by_class.items()
            },
            requested_by_label={
                key: {value: Resources.of(*row) for value, row in values.items()}
                for key, values in totals.by_label.items()
            },
            background=BackgroundSnapshot(
                target_cpu=self.background.target_cpu_m / 1000,
                desired_cpu=self.background.desired_cpu_m / 1000,
                workloads_active=self.background.active_workloads,
                desired_pods=self.background.desired_pods,
                live_pods=self._active[self.background_api.namespace],
                workloads_started=work.workloads_started,
                workloads_ended=work.workloads_ended,
                pods_created=work.pods_created,
                pods_replaced=work.pods_replaced,
                pods_destroyed=work.pods_destroyed,
                pods_churned=work.churned,
            ),
            api={
                name: ClientSnapshot(
                    calls=dict(sorted(stats.calls.items())),
                    throttled_calls=stats.throttled_calls,
                    throttle_wait_s=stats.throttle_wait_s,
                    faults_injected=stats.faults_injected,
                )
                for name, stats in self._client_stats.items()
            },
        )

    # -- the change listener: the one place the working state follows the API server ------

    def _new_server(self, namespace: str) -> FakeApiServer:
        server = FakeApiServer(
            clock=self._clock,
            namespace=namespace,
            history_size=self.config.api.history_size,
            default_grace_s=self.config.api.default_grace_s,
            on_terminating=lambda pod, grace: self._terminating_hook(server, pod, grace),
        )
        server.add_listener(lambda change: self._on_change(server, change))
        return server

    def _on_change(self, server: FakeApiServer, change: PodChange) -> None:
        pods = self._pods[server.namespace]
        if change.type is WatchEventType.ADDED:
            self._added(server, pods, change.after)
        elif change.type is WatchEventType.DELETED:
            pod = pods.pop(change.after.name, None)
            if pod is not None:
                self._deleted(pod)
        else:
            pod = pods.get(change.after.name)
            if pod is not None and change.before is not None:
                self._modified(pod, change.before, change.after)

    def _added(self, server: FakeApiServer, pods: dict[str, SimPod], pod: Pod) -> None:
        spec = pod.spec
        cpu, mem = self._requests_of(spec)
        pools, node_filter = self._eligibility_of(spec)
        workload = self.controller.owner_of(pod.labels) if server is self.background_api else None
        self._seq += 1
        sim = SimPod(
            server=server,
            name=pod.name,
            seq=self._seq,
            cpu=cpu,
            mem=mem,
            priority=self._priorities.get(spec.priority_class_name or "", 0),
            priority_class=spec.priority_class_name or "",
            images=tuple(dict.fromkeys(container.image for container in spec.containers)),
            labels=pod.labels,
            annotations=pod.annotations,
            pools=pools,
            node_filter=node_filter,
            workload=workload,
            created_t=self.timeline.now(),
        )
        pods[pod.name] = sim
        self._phases[sim.phase] += 1
        self._active[server.namespace] += 1
        self.budgets.pod_added(sim)
        if workload is not None:
            self.controller.pod_added(sim)
        self.scheduler.enqueue(sim)

    def _modified(self, sim: SimPod, before: Pod, after: Pod) -> None:
        if after.labels is not before.labels:
            if sim.node is not None:
                self._totals.add(sim, -1)
            sim.labels = after.labels
            if sim.node is not None:
                self._totals.add(sim, +1)
            self.budgets.pod_relabelled(sim)
        if after.annotations is not before.annotations:
            sim.annotations = after.annotations
            dnd = blocks_disruption(after.annotations)
            if dnd != sim.dnd:
                sim.dnd = dnd
                if sim.node is not None:
                    sim.node.dnd_pods += 1 if dnd else -1
        if after.node_name is not None and sim.node_name is None:
            self._bound(sim, after)
        was_ready, was_terminating, old_phase = sim.ready, sim.terminating, sim.phase
        was_active = _active(sim)
        if after.phase != old_phase:
            self._phases[old_phase] -= 1
            self._phases[after.phase] += 1
            if sim.node_name is not None and old_phase == PodPhase.PENDING:
                self._starting -= 1
            sim.phase = after.phase
        sim.ready = after.ready
        began_terminating = after.deletion_timestamp is not None and not was_terminating
        if began_terminating:
            sim.terminating = True
            self._terminating += 1
        if _active(sim) != was_active:
            self._active[sim.namespace] += 1 if not was_active else -1
        if sim.ready != was_ready or began_terminating:
            self.budgets.pod_changed(
                sim, was_healthy=was_ready and not was_terminating, was_terminating=was_terminating
            )
        if sim.workload is not None and (
            began_terminating or (sim.ready and not was_ready) or after.phase != old_phase
        ):
            self.controller.pod_changed(
                sim, became_ready=sim.ready and not was_ready, began_terminating=began_terminating
            )

    def _bound(self, sim: SimPod, pod: Pod) -> None:
        now = self.timeline.now()
        sim.node_name = pod.node_name
        sim.bound_at = now
        if sim.phase == PodPhase.PENDING:
            self._starting += 1
        self.scheduler.forget(sim)
        node = self.fleet.by_name.get(pod.node_name or "")
        if node is None:
            return  # a node the model does not know (a test binding by hand): no accounting
        sim.node = node
        node.pool.bind(node, sim)
        node.last_pod_event = now
        self._totals.add(sim, +1)
        if pod.phase == PodPhase.PENDING:
            self.kubelet.pod_bound(sim, node)

    def _deleted(self, sim: SimPod) -> None:
        sim.gone = True
        self._phases[sim.phase] -= 1
        if sim.terminating:
            self._terminating -= 1
        if sim.node_name is not None and sim.phase == PodPhase.PENDING:
            self._starting -= 1
        if _active(sim):
            self._active[sim.namespace] -= 1
        self.scheduler.forget(sim)
        self.budgets.pod_removed(sim)
        node = sim.node
        if node is not None:
            node.pool.unbind(node, sim)
            node.last_pod_event = self.timeline.now()
            self._totals.add(sim, -1)
            if node.state is NodeState.READY:
                self.scheduler.capacity_freed(node)
            elif node.state is NodeState.DRAINING and not node.pods:
                self.consolidator.node_emptied(node)
        if sim.workload is not None:
            self.controller.pod_gone(sim)

    def _terminating_hook(self, server: FakeApiServer, pod: Pod, grace_s: float) -> None:
        sim = self._pods[server.namespace].get(pod.name)
        if sim is not None:
            self.kubelet.pod_terminating(sim, grace_s)

    # -- callbacks from the parts ----------------------------------------------------------

    def _unschedulable(self, pod: SimPod) -> None:
        self.provisioner.pod_unschedulable(pod)

    def _node_ready(self, node: SimNode) -> None:
        self.scheduler.capacity_freed(node)
        self.provisioner.node_ready(node)

    def _node_cordoned(self, node: SimNode) -> None:
        self.scheduler.node_cordoned(node)

    def _node_terminated(self, node: SimNode) -> None:
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
        verdict = self.budgets.verdict(pod)
        self._apply_eviction(pod, verdict)
        return verdict is EvictionVerdict.ALLOWED

    def _apply_eviction(self, pod: SimPod, verdict: EvictionVerdict) -> None:
        if verdict is EvictionVerdict.ALLOWED:
            self._evictions += 1
            pod.server.evict(pod.name, delete=True)
        else:
            self._eviction_refusals += 1

    def _place_now(self, pods: list[Pod]) -> None:
        """Bind freshly created pods at once onto new Ready nodes (a pre-bound seed)."""
        now = self.timeline.now()
        sims = [self._pods[p.namespace][p.name] for p in pods if p.name in self._pods[p.namespace]]
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

    def _requests_of(self, spec: PodSpec) -> tuple[int, int]:
        key = tuple((container.cpu, container.memory) for container in spec.containers)
        known = self._requests.get(key)
        if known is None:
            known = (
                sum(cpu_millis(cpu) for cpu, _ in key),
                sum(memory_bytes(memory) for _, memory in key),
            )
            self._requests[key] = known
        return known

    def _eligibility_of(
        self, spec: PodSpec
    ) -> tuple[tuple[NodePool, ...], tuple[tuple[str, str], ...]]:
        key = (tuple(sorted(spec.node_selector.items())), spec.tolerations)
        known = self._eligibility.get(key)
        if known is None:
            admitted: list[NodePool] = []
            residual: tuple[tuple[str, str], ...] = ()
            for pool in self.pools:
                node_filter = pool.admits(spec.node_selector, spec.tolerations)
                if node_filter is not None:
                    admitted.append(pool)
                    residual = node_filter
            known = (tuple(admitted), residual)
            self._eligibility[key] = known
        return known

    def _pool(self, name: str | None) -> NodePool:
        if name is None:
            return self.pools[0]
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise ConfigError(f"no node pool {name!r}")

    def _view(self, node: SimNode) -> NodeView:
        return NodeView(
            name=node.name,
            pool=node.pool.name,
            instance_type=node.instance_type.name,
            state=node.state.value,
            allocatable=Resources.of(node.alloc_cpu, node.alloc_mem, node.alloc_pods),
            requested=Resources.of(node.used_cpu, node.used_mem, len(node.pods)),
            do_not_disrupt_pods=node.dnd_pods,
            launched_at=node.launched_at - (self._t0 or 0.0),
            ready_at=None if node.ready_at is None else node.ready_at - (self._t0 or 0.0),
            price_per_hour=node.instance_type.price_per_hour,
        )
