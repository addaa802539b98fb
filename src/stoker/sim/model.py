"""The simulated cluster's working state: pods and nodes as the scheduler sees them.

The API server holds the pods as the port's frozen `Pod` objects; this module holds what
the cluster's controllers need to decide fast: a `SimPod` per pod (requests in integer
millicores and bytes, priority, where it runs) and a `SimNode` per node (free capacity,
its pods, pulled images). `SimCluster` keeps both in step with the API server from its
change listener, so there is one source of truth for each fact.

`FreeIndex` buckets nodes (or the autoscaler's imaginary bins) by free CPU, with a bit
mask of non-empty buckets: finding a node that fits a pod starts at the first bucket
with enough CPU instead of scanning every node, which is what keeps scheduling cheap at
thousands of nodes. Iteration follows insertion order inside a bucket, never hashing, so
the same inputs give the same placements.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from stoker.ports.cluster import PodPhase
from stoker.sim.resources import Allocatable, InstanceType

if TYPE_CHECKING:
    from stoker.sim.apiserver import FakeApiServer
    from stoker.sim.disruption import PodDisruptionBudget
    from stoker.sim.nodes import NodePool
    from stoker.sim.workloads import Workload

#: Karpenter does not disrupt a node while one of its pods carries this annotation.
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
#: The label that ties a background pod to its workload (Deployment or StatefulSet).
WORKLOAD_LABEL = "sim.stoker.dev/workload"
#: Well-known node labels.
LABEL_INSTANCE_TYPE = "node.kubernetes.io/instance-type"
LABEL_HOSTNAME = "kubernetes.io/hostname"
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


class SimPod:
    """One pod as the cluster's controllers track it (the API server holds the `Pod`)."""

    __slots__ = (
        "annotations",
        "bound_at",
        "cpu",
        "created_t",
        "dnd",
        "entry",
        "gone",
        "group",
        "images",
        "labels",
        "mem",
        "name",
        "namespace",
        "node",
        "node_filter",
        "node_name",
        "nominated",
        "pdbs",
        "phase",
        "pools",
        "priority",
        "priority_class",
        "ready",
        "seq",
        "server",
        "terminating",
        "unschedulable",
        "workload",
    )

    def __init__(
        self,
        *,
        server: FakeApiServer,
        name: str,
        seq: int,
        cpu: int,
        mem: int,
        priority: int,
        priority_class: str,
        images: tuple[str, ...],
        labels: Mapping[str, str],
        annotations: Mapping[str, str],
        pools: tuple[NodePool, ...],
        node_filter: tuple[tuple[str, str], ...],
        workload: Workload | None,
        created_t: float,
    ) -> None:
        self.server = server
        self.namespace = server.namespace
        self.name = name
        self.seq = seq
        self.cpu = cpu
        self.mem = mem
        self.priority = priority
        self.priority_class = priority_class
        self.images = images
        self.labels = labels
        self.annotations = annotations
        self.dnd = blocks_disruption(annotations)
        #: Node pools whose labels and taints admit the pod, and the node-level labels
        #: (instance type, hostname) it still requires of a node.
        self.pools = pools
        self.node_filter = node_filter
        self.workload = workload
        self.created_t = created_t
        self.phase: str = PodPhase.PENDING
        self.ready = False
        self.terminating = False
        self.gone = False
        #: The node it is bound to (None before binding, or on a node the model does not know).
        self.node: SimNode | None = None
        self.node_name: str | None = None
        self.bound_at: float | None = None
        #: Scheduler bookkeeping: its live queue entry, its unschedulable group, the node
        #: a preemption reserved for it, whether it was ever marked Unschedulable.
        self.entry: int | None = None
        self.group: object | None = None
        self.nominated: SimNode | None = None
        self.unschedulable = False
        self.pdbs: list[PodDisruptionBudget] = []

    def __repr__(self) -> str:
        return f"SimPod({self.namespace}/{self.name})"


class SimNode:
    """One node: its capacity, what is bound to it, and its place in the indices."""

    __slots__ = (
        "alloc_cpu",
        "alloc_mem",
        "alloc_pods",
        "bucket",
        "dnd_pods",
        "draining_since",
        "free_cpu",
        "free_mem",
        "free_pods",
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
        self.alloc_cpu = allocatable.cpu_m
        self.alloc_mem = allocatable.memory_b
        self.alloc_pods = allocatable.pods
        self.free_cpu = allocatable.cpu_m
        self.free_mem = allocatable.memory_b
        self.free_pods = allocatable.pods
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
        #: The FreeIndex holding the node while it is schedulable, and its bucket there.
        self.index: FreeIndex[SimNode] | None = None
        self.bucket = -1

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


class FreeSlot(Protocol):
    """Anything with free capacity the index can bucket: a node or a planned node."""

    alloc_cpu: int
    alloc_mem: int
    free_cpu: int
    free_mem: int
    free_pods: int
    bucket: int

    @property
    def labels(self) -> Mapping[str, str]:
        """The slot's node labels (empty for a planned node)."""
        ...


SlotT = TypeVar("SlotT", bound=FreeSlot)


class FreeIndex(Generic[SlotT]):
    """Slots bucketed by free CPU (`granularity_m` millicores wide), fullest first.

    `candidates(cpu)` yields slots from the bucket holding `cpu` upwards: every slot
    with at least that much free CPU, tightest first, plus a few in the first bucket
    that the caller must still check. A bit mask of non-empty buckets skips empty
    ranges in one integer operation.
    """

    def __init__(self, granularity_m: int = 100) -> None:
        if granularity_m < 1:
            raise ValueError("granularity_m must be >= 1")
        self._granularity = granularity_m
        self._buckets: dict[int, dict[SlotT, None]] = {}
        self._mask = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, slot: SlotT) -> bool:
        bucket = self._buckets.get(slot.bucket)
        return bucket is not None and slot in bucket

    def add(self, slot: SlotT) -> None:
        """Index `slot` under its current free CPU."""
        number = max(slot.free_cpu, 0) // self._granularity
        bucket = self._buckets.get(number)
        if bucket is None:
            bucket = self._buckets[number] = {}
            self._mask |= 1 << number
        bucket[slot] = None
        slot.bucket = number
        self._size += 1

    def discard(self, slot: SlotT) -> None:
        """Stop indexing `slot` (no-op if it is not indexed)."""
        bucket = self._buckets.get(slot.bucket)
        if bucket is None or slot not in bucket:
            return
        del bucket[slot]
        if not bucket:
            del self._buckets[slot.bucket]
            self._mask &= ~(1 << slot.bucket)
        slot.bucket = -1
        self._size -= 1

    def update(self, slot: SlotT) -> None:
        """Move `slot` to the bucket of its new free CPU."""
        number = max(slot.free_cpu, 0) // self._granularity
        if number != slot.bucket:
            self.discard(slot)
            self.add(slot)

    def candidates(self, cpu_m: int) -> Iterator[SlotT]:
        """Slots that may have `cpu_m` free, in ascending free-CPU buckets.

        The caller must not add, move or discard slots while iterating.
        """
        number = max(cpu_m, 0) // self._granularity
        mask = self._mask >> number
        while mask:
            skip = (mask & -mask).bit_length() - 1
            number += skip
            yield from self._buckets[number]
            mask >>= skip + 1
            number += 1

    def __iter__(self) -> Iterator[SlotT]:
        return self.candidates(0)

    def descending(self) -> Iterator[SlotT]:
        """Slots from the most free CPU down (the emptiest first).

        The caller must not add, move or discard slots while iterating.
        """
        mask = self._mask
        while mask:
            top = mask.bit_length() - 1
            yield from self._buckets[top]
            mask &= ~(1 << top)


def most_allocated(slot: FreeSlot, cpu: int, mem: int) -> float:
    """kube-scheduler's MostAllocated score (equal weights) after placing cpu/mem here."""
    used_cpu = slot.alloc_cpu - slot.free_cpu + cpu
    used_mem = slot.alloc_mem - slot.free_mem + mem
    return used_cpu / max(slot.alloc_cpu, 1) + used_mem / max(slot.alloc_mem, 1)


def best_fit(
    index: FreeIndex[SlotT],
    cpu: int,
    mem: int,
    *,
    candidates: int,
    node_filter: tuple[tuple[str, str], ...] = (),
) -> SlotT | None:
    """The most allocated of the first `candidates` slots that fit cpu, mem and one pod.

    Like kube-scheduler on a large cluster, it scores a sample of the feasible nodes
    (the tightest in CPU, which are also the likeliest winners) instead of all of them.
    """
    best: SlotT | None = None
    best_score = -1.0
    found = 0
    for slot in index.candidates(cpu):
        if slot.free_cpu < cpu or slot.free_mem < mem or slot.free_pods < 1:
            continue
        if node_filter and not all(slot.labels.get(k) == v for k, v in node_filter):
            continue
        score = most_allocated(slot, cpu, mem)
        if score > best_score:
            best, best_score = slot, score
        found += 1
        if found >= candidates:
            break
    return best
