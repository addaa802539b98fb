"""What the simulated cluster reports: its snapshot, its nodes and its pods.

The dataclasses are the report's vocabulary (`as_dict` forms are JSON-ready and
sorted); `ClusterReport` reads them off the cluster's parts on demand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from stoker.sim.cluster.autoscaler import AutoscalerCounters
from stoker.sim.cluster.client import ClientStats
from stoker.sim.cluster.disruption import DisruptionBudgets
from stoker.sim.cluster.kubelet import Kubelet
from stoker.sim.cluster.mirror import PodMirror
from stoker.sim.cluster.model import NodeState, SimNode
from stoker.sim.cluster.nodes import NodeFleet
from stoker.sim.cluster.resources import GIB
from stoker.sim.cluster.scheduler import Scheduler
from stoker.sim.cluster.workloads import BackgroundLoad, WorkloadController


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


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterReport:
    """Reads the report's views off the cluster's parts (nothing is copied meanwhile)."""

    mirror: PodMirror
    fleet: NodeFleet
    scheduler: Scheduler
    kubelet: Kubelet
    autoscaler: AutoscalerCounters
    controller: WorkloadController
    background: BackgroundLoad
    background_namespace: str
    budgets: DisruptionBudgets
    client_stats: Mapping[str, ClientStats]
    #: When the cluster started (clock time; None before): node times are relative.
    t0: Callable[[], float | None]

    def nodes(self) -> list[NodeView]:
        """Every node not terminated, in launch order."""
        return [self._view(node) for node in self.fleet]

    def node(self, name: str) -> NodeView | None:
        """One node, or None."""
        node = self.fleet.by_name.get(name)
        return None if node is None else self._view(node)

    def pod_usage(self, namespace: str | None = None) -> Iterator[PodUsage]:
        """Every pod (of one namespace, or all) with its requests and node."""
        spaces = [namespace] if namespace is not None else list(self.mirror.pods)
        for ns in spaces:
            for pod in self.mirror.pods.get(ns, {}).values():
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

    def snapshot(self, t: float) -> ClusterSnapshot:
        """The cluster at `t` (seconds since it started)."""
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
        auto = self.autoscaler
        work = self.controller.counters
        mirror = self.mirror
        totals = mirror.totals
        return ClusterSnapshot(
            t=t,
            nodes_by_state={state.value: n for state, n in self.fleet.by_state.items()},
            nodes_by_instance_type=dict(self.fleet.by_type),
            nodes_by_pool=by_pool,
            nodes_launched_total=self.fleet.launched_total,
            nodes_terminated_total=self.fleet.terminated_total,
            node_cost_usd=self.fleet.cost_usd(),
            node_cost_usd_per_hour=self.fleet.cost_rate_usd_per_h(),
            pods_by_phase={phase: n for phase, n in mirror.phases.items() if n},
            pods_by_namespace={ns: len(pods) for ns, pods in self.mirror.pods.items()},
            pods_terminating=mirror.terminating,
            pods_queued=self.scheduler.queued,
            pods_unschedulable=self.scheduler.unschedulable_count,
            pods_nominated=self.scheduler.nominated_count,
            pods_starting=mirror.starting,
            binds_total=sched.binds,
            image_pulls_total=self.kubelet.counters.image_pulls,
            unschedulable_marks_total=sched.unschedulable_marks,
            preemptions_total=sched.preemptions,
            preemptors_total=sched.preemptors,
            evictions_total=self.budgets.evictions,
            eviction_refusals_total=self.budgets.refusals,
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
                live_pods=mirror.active[self.background_namespace],
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
                for name, stats in self.client_stats.items()
            },
        )

    def _view(self, node: SimNode) -> NodeView:
        return NodeView(
            name=node.name,
            pool=node.pool.name,
            instance_type=node.instance_type.name,
            state=node.state.value,
            allocatable=Resources.of(node.alloc_cpu, node.alloc_mem, node.alloc_pods),
            requested=Resources.of(node.used_cpu, node.used_mem, len(node.pods)),
            do_not_disrupt_pods=node.dnd_pods,
            launched_at=node.launched_at - (self.t0() or 0.0),
            ready_at=None if node.ready_at is None else node.ready_at - (self.t0() or 0.0),
            price_per_hour=node.instance_type.price_per_hour,
        )
