"""The simulated cluster's working state: pods, nodes, node pools, budgets, workloads.

The API server holds the pods as the port's frozen `Pod` objects; this module holds what
the cluster's controllers need to decide fast: a `SimPod` per pod (requests in integer
millicores and bytes, priority, where it runs), a `SimNode` per node (free capacity, its
pods, pulled images), a `NodePool` per pool (its nodes and free-capacity index), a
`PodDisruptionBudget`'s live counts and a background `Workload`'s pods. `SimCluster`
keeps them in step with the API server from its change listener, so there is one source
of truth for each fact. They refer to each other, so they live together here, below every
part that acts on them (`nodes`, `scheduler`, `kubelet`, `autoscaler`, `disruption`,
`workloads`), above the API server they write pods to.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, field
from enum import StrEnum

from stoker.ports.cluster import LABEL_HOSTNAME, Container, PodPhase, PodSpec, Toleration
from stoker.sim.cluster.apiserver import FakeApiServer
from stoker.sim.cluster.freeindex import Capacity, FreeIndex
from stoker.sim.cluster.resources import Allocatable, InstanceType, cpu_millis, memory_bytes
from stoker.sim.cluster.specs import (
    Archetype,
    NodePoolConfig,
    PdbSpec,
    Shape,
    WorkloadKind,
    budget_of,
    scaled,
    tolerates,
)

#: Karpenter does not disrupt a node while one of its pods carries this annotation.
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
#: The label that ties a background pod to its workload (Deployment or StatefulSet).
WORKLOAD_LABEL = "sim.stoker.dev/workload"
#: Well-known node labels.
LABEL_INSTANCE_TYPE = "node.kubernetes.io/instance-type"
LABEL_NODEPOOL = "karpenter.sh/nodepool"
#: Reason written on a pod that fits no node (the PodScheduled condition's reason).
UNSCHEDULABLE = "Unschedulable"


def blocks_disruption(annotations: Mapping[str, str]) -> bool:
    """Whether the pod's `karpenter.sh/do-not-disrupt` annotation pins its node.

    Karpenter accepts "true" or a duration; any value but "false" or empty pins here.
    """
    value = annotations.get(DO_NOT_DISRUPT)
    return value is not None and value not in ("", "false")


class NodeState(StrEnum):
    """Where a node is in its life."""

    LAUNCHING = "launching"  # instance requested, not Ready yet
    READY = "ready"  # schedulable
    DRAINING = "draining"  # cordoned, pods being evicted
    TERMINATED = "terminated"  # gone


@dataclass(slots=True, eq=False, repr=False, kw_only=True)
class SimPod:
    """One pod as the cluster's controllers track it (the API server holds the `Pod`).

    Compared and hashed by identity: a pod is a key of its node's and budgets' maps."""

    server: FakeApiServer
    name: str
    seq: int
    cpu: int
    mem: int
    priority: int
    priority_class: str
    images: tuple[str, ...]
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    #: Node pools whose labels and taints admit the pod, and the node-level labels
    #: (instance type, hostname) it still requires of a node.
    pools: tuple[NodePool, ...]
    node_filter: tuple[tuple[str, str], ...]
    workload: Workload | None
    created_t: float
    #: Its preferred node affinity: hostname (a node's name here) -> the weights of the
    #: terms naming it.
    preferred: Mapping[str, int] = field(default_factory=dict)
    namespace: str = field(init=False)
    #: Whether the pod pins its node (`blocks_disruption`).
    dnd: bool = field(init=False)
    phase: str = PodPhase.PENDING
    ready: bool = False
    terminating: bool = False
    gone: bool = False
    #: The node it is bound to (None before binding, or on a node the model does not know).
    node: SimNode | None = None
    node_name: str | None = None
    bound_at: float | None = None
    #: Scheduler bookkeeping: its live queue entry, its unschedulable group, the node
    #: a preemption reserved for it, whether it was ever marked Unschedulable.
    entry: int | None = None
    group: object | None = None
    nominated: SimNode | None = None
    unschedulable: bool = False
    pdbs: list[PodDisruptionBudget] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.namespace = self.server.namespace
        self.dnd = blocks_disruption(self.annotations)

    def __repr__(self) -> str:
        return f"SimPod({self.namespace}/{self.name})"


class SimNode(Capacity):
    """One node: its capacity, what is bound to it, and its place in the indices."""

    __slots__ = (
        "dnd_pods",
        "draining_since",
        "images",
        "index",
        "instance_type",
        "ip_next",
        "labels",
        "last_pod_event",
        "launched_at",
        "name",
        "nominated",
        "pods",
        "pool",
        "prio_counts",
        "pull_free_at",
        "ready_at",
        "seq",
        "state",
        "terminated_at",
    )

    def __init__(
        self,
        *,
        name: str,
        seq: int,
        pool: NodePool,
        instance_type: InstanceType,
        allocatable: Allocatable,
        labels: Mapping[str, str],
        launched_at: float,
    ) -> None:
        self.name = name
        self.seq = seq
        self.pool = pool
        self.instance_type = instance_type
        self.labels = dict(labels)
        super().__init__(allocatable)
        self.state = NodeState.LAUNCHING
        self.launched_at = launched_at
        self.ready_at: float | None = None
        self.draining_since: float | None = None
        self.terminated_at: float | None = None
        #: Consolidation waits `consolidate_after` past the last pod bound or removed.
        self.last_pod_event = launched_at
        self.pods: dict[SimPod, None] = {}
        #: Pods a preemption nominated here: their requests are held for them.
        self.nominated: dict[SimPod, None] = {}
        self.dnd_pods = 0
        #: How many pods of each priority run here (for preemption's candidate search).
        self.prio_counts: dict[int, int] = {}
        #: Image -> time it is (or will be) present; pulls are serial by default.
        self.images: dict[str, float] = {}
        self.pull_free_at = launched_at
        self.ip_next = 2
        #: The FreeIndex holding the node while it is schedulable (its bucket there is
        #: `bucket`).
        self.index: FreeIndex[SimNode] | None = None

    @property
    def used_cpu(self) -> int:
        """Millicores requested by the pods bound here."""
        return sum(pod.cpu for pod in self.pods)

    @property
    def used_mem(self) -> int:
        """Bytes requested by the pods bound here."""
        return sum(pod.mem for pod in self.pods)

    def place(self, pod: SimPod) -> None:
        """Account for `pod` bound here."""
        self.pods[pod] = None
        self.take(pod.cpu, pod.mem, 1)
        self.prio_counts[pod.priority] = self.prio_counts.get(pod.priority, 0) + 1
        if pod.dnd:
            self.dnd_pods += 1

    def release(self, pod: SimPod) -> None:
        """Forget `pod` (it was deleted): its requests are free again."""
        del self.pods[pod]
        self.take(-pod.cpu, -pod.mem, -1)
        left = self.prio_counts[pod.priority] - 1
        if left:
            self.prio_counts[pod.priority] = left
        else:
            del self.prio_counts[pod.priority]
        if pod.dnd:
            self.dnd_pods -= 1

    def reserve(self, pod: SimPod) -> None:
        """Hold capacity for a pod that preempted others here."""
        self.nominated[pod] = None
        self.take(pod.cpu, pod.mem, 1)

    def unreserve(self, pod: SimPod) -> None:
        """Give back what `reserve` held (no-op if nothing is held for `pod`)."""
        if pod in self.nominated:
            del self.nominated[pod]
            self.take(-pod.cpu, -pod.mem, -1)

    def next_pod_ip(self) -> str:
        """An address from the node's /24 (10.<seq/256>.<seq%256>.x), reused cyclically."""
        host = self.ip_next
        self.ip_next = host + 1 if host < 254 else 2
        return f"10.{(self.seq >> 8) & 255}.{self.seq & 255}.{host}"

    def take(self, cpu: int, mem: int, pods: int) -> None:
        """Lower the free capacity (negative values give it back) and re-bucket the node."""
        self.free_cpu -= cpu
        self.free_mem -= mem
        self.free_pods -= pods
        if self.index is not None:
            self.index.update(self)

    def __repr__(self) -> str:
        return f"SimNode({self.name}, {self.instance_type.name}, {self.state})"


#: Node labels that differ between nodes of one pool: matched node by node.
NODE_LEVEL_LABELS = frozenset({LABEL_INSTANCE_TYPE, LABEL_HOSTNAME})
#: Labels every background pod carries besides `WORKLOAD_LABEL`.
ARCHETYPE_LABEL = "sim.stoker.dev/archetype"
_FINISHED = frozenset({PodPhase.FAILED, PodPhase.SUCCEEDED})


class NodePool:
    """A pool's live state: its nodes, the free-capacity index, what priorities run where."""

    def __init__(self, config: NodePoolConfig) -> None:
        self.config = config
        self.name = config.name
        self.labels: dict[str, str] = {
            **config.labels,
            LABEL_NODEPOOL: config.name,
            "karpenter.sh/capacity-type": "on-demand",
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
        }
        daemon_cpu = cpu_millis(config.daemon_cpu)
        daemon_mem = memory_bytes(config.daemon_memory)
        self.allocatable: dict[str, Allocatable] = {
            itype.name: itype.allocatable(
                vm_memory_overhead=config.vm_memory_overhead,
                daemon_cpu_m=daemon_cpu,
                daemon_memory_b=daemon_mem,
            )
            for itype in config.instance_types
        }
        self.types_by_name = {itype.name: itype for itype in config.instance_types}
        #: Ready nodes, bucketed by free CPU: what the scheduler searches.
        self.index: FreeIndex[SimNode] = FreeIndex()
        #: Every node not yet terminated, in launch order.
        self.nodes: dict[SimNode, None] = {}
        #: priority -> nodes running at least one pod of that priority.
        self.prio_nodes: dict[int, dict[SimNode, None]] = {}
        #: Ready nodes without a pod, in the order they became empty.
        self.empty: dict[SimNode, None] = {}
        self.draining = 0

    def admits(
        self, node_selector: Mapping[str, str], tolerations: tuple[Toleration, ...]
    ) -> tuple[tuple[str, str], ...] | None:
        """None if no node of this pool can host such a pod, else the node-level filter.

        Pool-wide labels are decided here; instance type and hostname remain to be
        matched node by node.
        """
        residual: list[tuple[str, str]] = []
        for key, value in sorted(node_selector.items()):
            if key in NODE_LEVEL_LABELS:
                if key == LABEL_INSTANCE_TYPE and value not in self.types_by_name:
                    return None
                residual.append((key, value))
            elif self.labels.get(key) != value:
                return None
        for taint in self.config.taints:
            if taint.effect in ("NoSchedule", "NoExecute") and not tolerates(tolerations, taint):
                return None
        return tuple(residual)

    def bind(self, node: SimNode, pod: SimPod) -> None:
        """Account `pod` on `node` (a node of this pool)."""
        node.place(pod)
        self.empty.pop(node, None)
        if node.prio_counts[pod.priority] == 1:
            self.prio_nodes.setdefault(pod.priority, {})[node] = None

    def unbind(self, node: SimNode, pod: SimPod) -> None:
        """Forget `pod` on `node`."""
        node.release(pod)
        if not node.pods and node.state is NodeState.READY:
            self.empty[node] = None
        if pod.priority not in node.prio_counts:
            holders = self.prio_nodes.get(pod.priority)
            if holders is not None:
                holders.pop(node, None)
                if not holders:
                    del self.prio_nodes[pod.priority]

    def launched_cpu(self) -> float:
        """Cores of every node not terminated (what `limit_cpu` caps)."""
        return sum(node.instance_type.cpu for node in self.nodes)

    def disruptions_allowed(self) -> int:
        """Nodes the budget lets consolidation start draining now."""
        return budget_of(self.config.budget_nodes, len(self.nodes)) - self.draining


class PodDisruptionBudget:
    """A budget's live counts: its pods, how many are healthy."""

    def __init__(
        self, spec: PdbSpec, namespace: str, expected: Callable[[], int] | None = None
    ) -> None:
        self.spec = spec
        self.namespace = namespace
        self._expected = expected
        self.members: dict[SimPod, None] = {}
        self.healthy = 0
        self.terminating = 0

    @property
    def name(self) -> str:
        """The budget's name."""
        return self.spec.name

    def expected(self) -> int:
        """The controller's replicas if known, else the matching pods not terminating."""
        if self._expected is not None:
            return self._expected()
        return len(self.members) - self.terminating

    def desired_healthy(self) -> int:
        """How many pods must stay healthy."""
        expected = self.expected()
        if self.spec.min_available is not None:
            return scaled(self.spec.min_available, expected)
        assert self.spec.max_unavailable is not None
        return max(0, expected - scaled(self.spec.max_unavailable, expected))

    def disruptions_allowed(self) -> int:
        """How many healthy pods may be evicted now."""
        return max(0, self.healthy - self.desired_healthy())

    def matches(self, pod: SimPod) -> bool:
        """Whether the budget selects `pod`."""
        return pod.namespace == self.namespace and all(
            pod.labels.get(key) == value for key, value in self.spec.selector.items()
        )


def is_healthy(pod: SimPod) -> bool:
    """Counts towards a budget's healthy pods: Ready and not terminating."""
    return pod.ready and not pod.terminating


@dataclass(slots=True, eq=False, repr=False, kw_only=True)
class Workload:
    """One Deployment or StatefulSet (or, with `bare`, a group of uncontrolled pods).

    Compared and hashed by identity; `shape` gives its pods' requests."""

    name: str
    archetype: Archetype
    shape: InitVar[Shape]
    replicas: int
    bare: bool
    started_at: float
    ends_at: float
    hash: str
    kind: WorkloadKind = field(init=False)
    cpu_m: int = field(init=False)
    labels: dict[str, str] = field(init=False)
    #: One spec object shared by every pod of the workload (frozen, so safe to share).
    spec: PodSpec = field(init=False)
    pods: dict[str, SimPod] = field(default_factory=dict)
    #: Pod creations queued at the rate limiter: a count (Deployment) or names.
    requested: dict[str, None] = field(default_factory=dict)
    #: Pods the owner itself deleted (end of life, churn): not destroyed demand.
    expected_gone: dict[str, None] = field(default_factory=dict)
    ended: bool = False
    #: Pods created so far; beyond `replicas` every creation replaces a lost pod.
    created: int = 0
    pdb: PodDisruptionBudget | None = None
    slot: int = -1

    def __post_init__(self, shape: Shape) -> None:
        archetype = self.archetype
        self.kind = archetype.kind
        self.cpu_m = cpu_millis(shape.cpu)
        self.labels = {
            "app.kubernetes.io/name": self.name,
            WORKLOAD_LABEL: self.name,
            ARCHETYPE_LABEL: archetype.name,
        }
        self.spec = PodSpec(
            containers=(
                Container(
                    name="main", image=archetype.pod_image, cpu=shape.cpu, memory=shape.memory
                ),
            ),
            priority_class_name=archetype.priority_class,
            restart_policy="Always",
            termination_grace_period_s=archetype.grace_s,
        )

    def active_pods(self) -> int:
        """Pods that count as replicas: not terminating, not finished."""
        return sum(
            1 for pod in self.pods.values() if not pod.terminating and pod.phase not in _FINISHED
        )
