"""Node pools and the fleet of simulated nodes: launch, Ready, cordon, terminate, cost.

A `NodePoolConfig` is a Karpenter NodePool in miniature: the instance types it may
launch, the labels and taints its nodes carry, a CPU limit, how long a node takes to
become Ready, and its disruption settings (consolidation policy, `consolidate_after`,
the node budget). `NodeFleet` owns every node's life; the scheduler, kubelet and
autoscaler act on nodes only through it, and it keeps the totals the report needs
(launched, terminated, node-hours cost) in O(1) per change.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from stoker.domain.errors import ConfigError
from stoker.ports.cluster import Toleration
from stoker.sim.distributions import Distribution, LogNormal
from stoker.sim.model import (
    LABEL_HOSTNAME,
    LABEL_INSTANCE_TYPE,
    LABEL_NODEPOOL,
    FreeIndex,
    NodeState,
    SimNode,
    SimPod,
)
from stoker.sim.resources import (
    DEFAULT_INSTANCE_TYPES,
    Allocatable,
    InstanceType,
    cpu_millis,
    memory_bytes,
)
from stoker.sim.timeline import Timeline

#: Node labels that differ between nodes of one pool: matched node by node.
NODE_LEVEL_LABELS = frozenset({LABEL_INSTANCE_TYPE, LABEL_HOSTNAME})


class ConsolidationPolicy(StrEnum):
    """Karpenter's `spec.disruption.consolidationPolicy`."""

    WHEN_EMPTY = "WhenEmpty"
    WHEN_EMPTY_OR_UNDERUTILIZED = "WhenEmptyOrUnderutilized"


@dataclass(frozen=True, slots=True)
class Taint:
    """A node taint; pods without a matching toleration do not schedule there."""

    key: str
    value: str = ""
    effect: str = "NoSchedule"


def _default_provisioning() -> Distribution:
    return LogNormal(median=60.0, sigma=0.35, cap=600.0)


@dataclass(frozen=True)
class NodePoolConfig:
    """One node pool, modelled on a Karpenter NodePool.

    Defaults and where they come from:

    - `instance_types`: AWS m5/c5/r5 with list prices (`resources.DEFAULT_INSTANCE_TYPES`);
    - `provisioning`: launch to Ready, log-normal with a 60 s median (p99 about 135 s),
      between bigfleet's kwok-measured provisioning p50 of 36.7 s and the 2-3 minutes a
      large node took in duckgres #671;
    - `consolidation_policy`: Karpenter v1's default, `WhenEmptyOrUnderutilized`;
    - `consolidate_after_s`: 30 s (Karpenter's API default is 0 s, which consolidates on
      every pod exit; 30 s is a common production setting, e.g. convox's default);
      None means `Never`;
    - `budget_nodes`: Karpenter's default budget, `nodes: 10%` (a count like "5" works);
    - `daemon_cpu` 125m: the requests of kube-proxy (100m) and the VPC CNI (25m), the
      DaemonSets every EKS node runs, held as a per-node overhead instead of pods;
    - `vm_memory_overhead` 7.5 %: Karpenter's `VM_MEMORY_OVERHEAD_PERCENT` default.
    - `initial_nodes`: instance type name -> count of nodes Ready at start.
    """

    name: str = "default"
    instance_types: tuple[InstanceType, ...] = DEFAULT_INSTANCE_TYPES
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    weight: int = 0
    limit_cpu: float | None = None
    provisioning: Distribution = field(default_factory=_default_provisioning)
    consolidation_policy: ConsolidationPolicy = ConsolidationPolicy.WHEN_EMPTY_OR_UNDERUTILIZED
    consolidate_after_s: float | None = 30.0
    budget_nodes: str = "10%"
    daemon_cpu: str = "125m"
    daemon_memory: str = "0"
    vm_memory_overhead: float = 0.075
    initial_nodes: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.instance_types:
            raise ConfigError(f"node pool {self.name!r}: no instance types")
        names = [itype.name for itype in self.instance_types]
        if len(set(names)) != len(names):
            raise ConfigError(f"node pool {self.name!r}: duplicate instance types")
        unknown = set(self.initial_nodes) - set(names)
        if unknown:
            raise ConfigError(f"node pool {self.name!r}: unknown initial types {sorted(unknown)}")
        budget_of(self.budget_nodes, 10)  # validates the form
        if self.consolidate_after_s is not None and self.consolidate_after_s < 0:
            raise ConfigError(f"node pool {self.name!r}: consolidate_after_s must be >= 0")


def budget_of(budget: str, nodes: int) -> int:
    """How many of `nodes` a budget like "10%" or "5" allows; percentages round up."""
    text = budget.strip()
    try:
        if text.endswith("%"):
            percent = float(text[:-1])
            if percent < 0:
                raise ValueError
            return math.ceil(percent * nodes / 100 - 1e-9)
        count = int(text)
        if count < 0:
            raise ValueError
        return count
    except ValueError:
        raise ConfigError(
            f"invalid disruption budget {budget!r}: a count or a percentage"
        ) from None


def tolerates(tolerations: tuple[Toleration, ...], taint: Taint) -> bool:
    """Whether some toleration matches `taint`, with Kubernetes' matching rules."""
    for toleration in tolerations:
        if toleration.effect and toleration.effect != taint.effect:
            continue
        if toleration.operator == "Exists":
            if not toleration.key or toleration.key == taint.key:
                return True
        elif toleration.key == taint.key and (toleration.value or "") == taint.value:
            return True
    return False


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


class NodeFleet:
    """Every simulated node: launched, Ready, cordoned for a drain, terminated.

    `on_ready(node)` runs when a node becomes schedulable, `on_cordoned(node)` when it
    stops being schedulable, `on_terminated(node)` when it is gone.
    """

    def __init__(
        self,
        *,
        pools: tuple[NodePool, ...],
        timeline: Timeline,
        rng: random.Random,
        on_ready: Callable[[SimNode], None],
        on_cordoned: Callable[[SimNode], None],
        on_terminated: Callable[[SimNode], None],
    ) -> None:
        self.pools = {pool.name: pool for pool in pools}
        self._timeline = timeline
        self._rng = rng
        self._on_ready = on_ready
        self._on_cordoned = on_cordoned
        self._on_terminated = on_terminated
        self.by_name: dict[str, SimNode] = {}
        self._seq = 0
        self.launched_total = 0
        self.terminated_total = 0
        self.by_state: dict[NodeState, int] = dict.fromkeys(NodeState, 0)
        self.by_type: dict[str, int] = {}
        # Cost of live nodes is sum(price) * now - sum(price * launched_at): O(1) to read.
        self._cost_closed = 0.0
        self._price_sum = 0.0
        self._price_time_sum = 0.0

    def __iter__(self) -> Iterator[SimNode]:
        return iter(self.by_name.values())

    def launch(
        self, pool: NodePool, instance_type: InstanceType, *, delay_s: float | None = None
    ) -> SimNode:
        """Request a node; it becomes Ready after `delay_s` (drawn from the pool if None)."""
        now = self._timeline.now()
        self._seq += 1
        name = f"{pool.name}-{self._seq:05d}"
        node = SimNode(
            name=name,
            seq=self._seq,
            pool=pool,
            instance_type=instance_type,
            allocatable=pool.allocatable[instance_type.name],
            labels={
                **pool.labels,
                LABEL_INSTANCE_TYPE: instance_type.name,
                LABEL_HOSTNAME: name,
            },
            launched_at=now,
        )
        self.by_name[name] = node
        pool.nodes[node] = None
        self.launched_total += 1
        self.by_state[NodeState.LAUNCHING] += 1
        self.by_type[instance_type.name] = self.by_type.get(instance_type.name, 0) + 1
        self._price_sum += instance_type.price_per_hour
        self._price_time_sum += instance_type.price_per_hour * now
        delay = pool.config.provisioning.sample(self._rng) if delay_s is None else delay_s
        if delay <= 0:
            self._ready(node)
        else:
            self._timeline.after(delay, lambda: self._ready(node))
        return node

    def cordon(self, node: SimNode) -> None:
        """Mark a Ready node unschedulable and draining (consolidation chose it)."""
        if node.state is not NodeState.READY:
            return
        self._move(node, NodeState.DRAINING)
        node.draining_since = self._timeline.now()
        node.pool.draining += 1
        node.pool.empty.pop(node, None)
        node.pool.index.discard(node)
        node.index = None
        self._on_cordoned(node)

    def terminate(self, node: SimNode) -> None:
        """Remove the node for good (its pods must be gone already)."""
        if node.state is NodeState.TERMINATED:
            return
        if node.state is NodeState.DRAINING:
            node.pool.draining -= 1
        if node.index is not None:
            node.pool.index.discard(node)
            node.index = None
        node.pool.empty.pop(node, None)
        self._move(node, NodeState.TERMINATED)
        now = self._timeline.now()
        node.terminated_at = now
        price = node.instance_type.price_per_hour
        self._cost_closed += price * (now - node.launched_at) / 3600
        self._price_sum -= price
        self._price_time_sum -= price * node.launched_at
        del self.by_name[node.name]
        del node.pool.nodes[node]
        left = self.by_type[node.instance_type.name] - 1
        if left:
            self.by_type[node.instance_type.name] = left
        else:
            del self.by_type[node.instance_type.name]
        self.terminated_total += 1
        self._on_terminated(node)

    def cost_usd(self) -> float:
        """Node-hours times price, of every node ever launched, up to now."""
        live = self._price_sum * self._timeline.now() - self._price_time_sum
        return self._cost_closed + live / 3600

    def cost_rate_usd_per_h(self) -> float:
        """What the live nodes cost per hour."""
        return self._price_sum

    def _ready(self, node: SimNode) -> None:
        if node.state is not NodeState.LAUNCHING:
            return
        self._move(node, NodeState.READY)
        now = self._timeline.now()
        node.ready_at = now
        node.last_pod_event = now
        node.pull_free_at = now
        node.index = node.pool.index
        node.pool.index.add(node)
        if not node.pods:
            node.pool.empty[node] = None
        self._on_ready(node)

    def _move(self, node: SimNode, state: NodeState) -> None:
        self.by_state[node.state] -= 1
        self.by_state[state] += 1
        node.state = state
