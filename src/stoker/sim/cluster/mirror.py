"""The working state of every pod, kept in step with the API servers' change streams.

One rule keeps the simulated cluster consistent: what a pod *is* (bound where, Running,
Ready, terminating, labelled how) is learned only from the API server's change stream.
The scheduler, kubelet and controllers write to the API server; `PodMirror`, its
listener, reflects every change into the working state (`SimPod`, `SimNode`, budgets,
totals) and tells the parts that act on it (scheduler, kubelet, workload controller,
consolidator). Tests and scenarios may therefore also drive pods by hand
(`api.set_pod_status`) and the model follows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from stoker.ports.cluster import Pod, PodPhase, PodSpec, WatchEventType
from stoker.sim.cluster.apiserver import FakeApiServer
from stoker.sim.cluster.autoscaler import Consolidator
from stoker.sim.cluster.changes import PodChange
from stoker.sim.cluster.disruption import DisruptionBudgets
from stoker.sim.cluster.kubelet import Kubelet
from stoker.sim.cluster.model import NodePool, NodeState, SimPod, blocks_disruption
from stoker.sim.cluster.nodes import NodeFleet
from stoker.sim.cluster.resources import cpu_millis, memory_bytes
from stoker.sim.cluster.scheduler import Scheduler
from stoker.sim.cluster.timeline import Timeline
from stoker.sim.cluster.workloads import WorkloadController

_FINISHED = frozenset({PodPhase.FAILED, PodPhase.SUCCEEDED})


def _active(pod: SimPod) -> bool:
    """Counts as a replica of its workload: not terminating, not finished."""
    return not pod.terminating and pod.phase not in _FINISHED


class Totals:
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


class PodMirror:
    """Every pod's `SimPod` per namespace, and the counts the snapshot reports."""

    def __init__(
        self,
        *,
        namespaces: tuple[str, ...],
        background: FakeApiServer,
        priorities: Mapping[str, int],
        pools: tuple[NodePool, ...],
        track_labels: tuple[str, ...],
        timeline: Timeline,
        fleet: NodeFleet,
        budgets: DisruptionBudgets,
        scheduler: Scheduler,
        kubelet: Kubelet,
        controller: WorkloadController,
        consolidator: Consolidator,
    ) -> None:
        #: Namespace -> pod name -> its working state.
        self.pods: dict[str, dict[str, SimPod]] = {}
        for namespace in namespaces:
            self.pods.setdefault(namespace, {})
        self._background = background
        self._priorities = priorities
        self._pools = pools
        self.timeline = timeline
        self.fleet = fleet
        self.budgets = budgets
        self.scheduler = scheduler
        self.kubelet = kubelet
        self.controller = controller
        self.consolidator = consolidator
        self._requests: dict[tuple[tuple[str, str], ...], tuple[int, int]] = {}
        self._eligibility: dict[
            tuple[object, ...], tuple[tuple[NodePool, ...], tuple[tuple[str, str], ...]]
        ] = {}
        self._seq = 0
        self.phases: Counter[str] = Counter()
        self.terminating = 0
        self.starting = 0
        #: Per namespace: pods that count as replicas (not terminating, not finished).
        self.active: Counter[str] = Counter()
        self.totals = Totals(track_labels)

    def changed(self, server: FakeApiServer, change: PodChange) -> None:
        """One change of `server`'s pods: follow it in the working state and tell the parts."""
        pods = self.pods[server.namespace]
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
        workload = self.controller.owner_of(pod.labels) if server is self._background else None
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
            preferred=_preferred(spec),
        )
        pods[pod.name] = sim
        self.phases[sim.phase] += 1
        self.active[server.namespace] += 1
        self.budgets.pod_added(sim)
        if workload is not None:
            self.controller.pod_added(sim)
        self.scheduler.enqueue(sim)

    def _modified(self, sim: SimPod, before: Pod, after: Pod) -> None:
        if after.labels is not before.labels:
            if sim.node is not None:
                self.totals.add(sim, -1)
            sim.labels = after.labels
            if sim.node is not None:
                self.totals.add(sim, +1)
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
            self.phases[old_phase] -= 1
            self.phases[after.phase] += 1
            if sim.node_name is not None and old_phase == PodPhase.PENDING:
                self.starting -= 1
            sim.phase = after.phase
        sim.ready = after.ready
        began_terminating = after.deletion_timestamp is not None and not was_terminating
        if began_terminating:
            sim.terminating = True
            self.terminating += 1
        if _active(sim) != was_active:
            self.active[sim.namespace] += 1 if not was_active else -1
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
            self.starting += 1
        self.scheduler.forget(sim)
        node = self.fleet.by_name.get(pod.node_name or "")
        if node is None:
            return  # a node the model does not know (a test binding by hand): no accounting
        sim.node = node
        node.pool.bind(node, sim)
        node.last_pod_event = now
        self.totals.add(sim, +1)
        if pod.phase == PodPhase.PENDING:
            self.kubelet.pod_bound(sim, node)

    def _deleted(self, sim: SimPod) -> None:
        sim.gone = True
        self.phases[sim.phase] -= 1
        if sim.terminating:
            self.terminating -= 1
        if sim.node_name is not None and sim.phase == PodPhase.PENDING:
            self.starting -= 1
        if _active(sim):
            self.active[sim.namespace] -= 1
        self.scheduler.forget(sim)
        self.budgets.pod_removed(sim)
        node = sim.node
        if node is not None:
            node.pool.unbind(node, sim)
            node.last_pod_event = self.timeline.now()
            self.totals.add(sim, -1)
            if node.state is NodeState.READY:
                self.scheduler.capacity_freed(node)
            elif node.state is NodeState.DRAINING and not node.pods:
                self.consolidator.node_emptied(node)
        if sim.workload is not None:
            self.controller.pod_gone(sim)

    def deletion_began(self, server: FakeApiServer, pod: Pod, grace_s: float) -> None:
        """A graceful deletion began: the kubelet stops the containers."""
        sim = self.pods[server.namespace].get(pod.name)
        if sim is not None:
            self.kubelet.pod_terminating(sim, grace_s)

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
            for pool in self._pools:
                node_filter = pool.admits(spec.node_selector, spec.tolerations)
                if node_filter is not None:
                    admitted.append(pool)
                    residual = node_filter
            known = (tuple(admitted), residual)
            self._eligibility[key] = known
        return known


def _preferred(spec: PodSpec) -> dict[str, int]:
    """Hostname -> the summed weights of the preferred node affinity's terms naming it."""
    preferred: dict[str, int] = {}
    for term in spec.preferred_nodes:
        for hostname in term.hostnames:
            preferred[hostname] = preferred.get(hostname, 0) + term.weight
    return preferred
