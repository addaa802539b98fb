"""A node autoscaler modelled on Karpenter: provisioning and consolidation.

Provisioning batches the pods the scheduler marked Unschedulable: a batch closes
`batch_idle_s` after the last new pod or `batch_max_s` after the first (Karpenter's
`BATCH_IDLE_DURATION` 1 s and `BATCH_MAX_DURATION` 10 s). Like Karpenter's scheduling
simulation, the plan first counts room left on Ready nodes (the scheduler, bound by its
bind rate, may just not have reached those pods yet) and on nodes still launching
(in-flight NodeClaims); what is left goes, largest shapes first, into new nodes of the
largest instance type that fits, each then shrunk to the cheapest type that holds what
was packed into it, within the pool's CPU limit. A node becomes Ready after the pool's
provisioning delay; the scheduler, not the plan, decides where pods go.

Consolidation polls every `consolidation_interval_s` (Karpenter's disruption controller
polls every 10 s). Per pool it takes nodes whose last pod was bound or removed at least
`consolidate_after` ago and that hold no `karpenter.sh/do-not-disrupt` pod, no pod whose
PodDisruptionBudget allows no eviction, and no capacity held for a preemptor. A poll
makes one command per pool: its empty candidates if there are any, else (with
`WhenEmptyOrUnderutilized`) the under-used nodes whose pods all fit on the other Ready
nodes (a scheduling simulation; candidates come from the nodes with the most free CPU
and are tried fewest pods first, at most `max_underutilized_candidates` of them and
`max_simulated_pods` pods per poll). The pool's budget (`nodes: 10%` by default, minus
nodes already draining) caps the command. As in Karpenter, a command is held for
`validation_s` (its `consolidationTTL`, 15 s) and re-checked — a node that got or lost
a pod meanwhile, or got a do-not-disrupt pod, is spared — and the disruption loop waits
for it: the next poll comes `consolidation_interval_s` after it ran.

A chosen node is cordoned and drained through the Eviction API: a 429 from a budget is
retried every `eviction_retry_s` (2 s, as bigfleet's drain does), do-not-disrupt pods
that appear during the drain are waited for, and the node is terminated when its last
pod is gone. Karpenter's replacement consolidation (a cheaper node instead of a
deletion), drift and expiry are not modelled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from stoker.ports.cluster import LABEL_HOSTNAME
from stoker.sim.cluster.freeindex import Capacity, FreeIndex, best_fit
from stoker.sim.cluster.model import (
    LABEL_INSTANCE_TYPE,
    NodePool,
    NodeState,
    PodDisruptionBudget,
    SimNode,
    SimPod,
)
from stoker.sim.cluster.nodes import NodeFleet
from stoker.sim.cluster.resources import Allocatable, InstanceType
from stoker.sim.cluster.scheduler import Scheduler
from stoker.sim.cluster.specs import ConsolidationPolicy
from stoker.sim.cluster.timeline import Timeline, Trigger

_EMPTY = "empty"
_UNDERUTILIZED = "underutilized"

#: Node-level label constraints of a pod (instance type, hostname).
NodeFilter = tuple[tuple[str, str], ...]
#: Pods of one shape: (cpu millicores, memory bytes, the pods).
Shape = tuple[int, int, list[SimPod]]


@dataclass(frozen=True, slots=True)
class AutoscalerConfig:
    """Switches and timings (sources in the module docstring); per-pool settings such as
    `consolidate_after_s` and the node budget live in `NodePoolConfig`."""

    provisioning: bool = True
    consolidation: bool = True
    batch_idle_s: float = 1.0
    batch_max_s: float = 10.0
    consolidation_interval_s: float = 10.0
    validation_s: float = 15.0
    eviction_retry_s: float = 2.0
    max_underutilized_candidates: int = 20
    #: Pods one poll may simulate moving (Karpenter bounds its consolidation searches by
    #: time; a bound on work keeps a large simulated cluster cheap and deterministic).
    max_simulated_pods: int = 400


@dataclass(slots=True)
class AutoscalerCounters:
    """What the autoscaler did, for the cluster snapshot."""

    provisioning_passes: int = 0
    unprovisionable_pods: int = 0
    consolidated_empty: int = 0
    consolidated_underutilized: int = 0


class _Bin(Capacity):
    """A node in a provisioning plan: a launching node, or a new one not yet typed."""

    __slots__ = ("instance_type", "labels", "members")

    def __init__(self, instance_type: InstanceType, allocatable: Allocatable) -> None:
        self.instance_type = instance_type
        self.members: list[SimPod] = []
        super().__init__(allocatable)
        self.labels: dict[str, str] = {}

    def hold(self, pods: Sequence[SimPod], cpu: int, mem: int) -> None:
        """Plan `pods`, each requesting cpu and mem, onto this node."""
        self.members.extend(pods)
        self.free_cpu -= cpu * len(pods)
        self.free_mem -= mem * len(pods)
        self.free_pods -= len(pods)

    def used(self) -> tuple[int, int, int]:
        """Millicores, bytes and pods planned onto this node."""
        return (
            self.alloc_cpu - self.free_cpu,
            self.alloc_mem - self.free_mem,
            self.alloc_pods - self.free_pods,
        )


@dataclass(frozen=True, slots=True)
class AutoscalerParts:
    """What provisioning and consolidation both act with: the fleet they grow or shrink,
    the scheduler whose placements they plan around, the timeline and the counters."""

    config: AutoscalerConfig
    fleet: NodeFleet
    scheduler: Scheduler
    timeline: Timeline
    counters: AutoscalerCounters = field(default_factory=AutoscalerCounters)


class _NodeAutoscaler:
    """The parts, as the provisioner and the consolidator read them."""

    def __init__(self, parts: AutoscalerParts) -> None:
        self._config = parts.config
        self._fleet = parts.fleet
        self._scheduler = parts.scheduler
        self._timeline = parts.timeline
        self._counters = parts.counters


class Provisioner(_NodeAutoscaler):
    """Launches nodes for Unschedulable pods; see the module docstring."""

    def __init__(self, parts: AutoscalerParts) -> None:
        super().__init__(parts)
        self._batch_start: float | None = None
        self._batch_last = 0.0
        self._trigger = Trigger(parts.timeline, self._close_batch)

    def pod_unschedulable(self, pod: SimPod) -> None:
        """A pod was marked Unschedulable: open or extend the batch window."""
        if not self._config.provisioning:
            return
        now = self._timeline.now()
        if self._batch_start is None:
            self._batch_start = now
        self._batch_last = now
        self._trigger.at(
            min(self._batch_start + self._config.batch_max_s, now + self._config.batch_idle_s)
        )

    def node_ready(self, node: SimNode) -> None:
        """A planned node arrived: pods that did not get onto it need another look."""
        if self._config.provisioning and self._scheduler.unschedulable_count:
            # After the scheduler's next pass, not before it: the pass may place them.
            self._trigger.at(self._timeline.now() + self._config.batch_idle_s)

    def _close_batch(self) -> None:
        now = self._timeline.now()
        start = self._batch_start if self._batch_start is not None else now
        closes = min(start + self._config.batch_max_s, self._batch_last + self._config.batch_idle_s)
        if now + 1e-9 < closes:
            self._trigger.at(closes)
            return
        self._batch_start = None
        self.provision()

    def provision(self) -> list[SimNode]:
        """Plan and launch nodes for every Unschedulable pod now; returns the new nodes."""
        self._counters.provisioning_passes += 1
        launched: list[SimNode] = []
        groups = self._scheduler.unschedulable_groups()
        for pool, node_filter, shapes in self.partition_shapes(groups):
            limit = pool.config.limit_cpu
            committed = pool.launched_cpu()
            for itype, _ in self.plan_nodes(pool, node_filter, shapes, in_flight=True):
                if limit is not None and committed + itype.cpu > limit:
                    continue  # the NodePool's limit: these pods stay pending
                committed += itype.cpu
                launched.append(self._fleet.launch(pool, itype))
        return launched

    def partition(self, pods: Iterable[SimPod]) -> list[tuple[NodePool, NodeFilter, list[Shape]]]:
        """`partition_shapes` for loose pods (grouped by shape and eligibility first)."""
        groups: dict[tuple[int, int, tuple[NodePool, ...], NodeFilter], list[SimPod]] = {}
        for pod in pods:
            if not pod.gone:
                key = (pod.cpu, pod.mem, pod.pools, pod.node_filter)
                groups.setdefault(key, []).append(pod)
        return self.partition_shapes((*key, members) for key, members in groups.items())

    def partition_shapes(
        self, groups: Iterable[tuple[int, int, tuple[NodePool, ...], NodeFilter, list[SimPod]]]
    ) -> list[tuple[NodePool, NodeFilter, list[Shape]]]:
        """Pods of each shape under the pool that would host them (the heaviest-weighted
        that admits them) and their node-level constraints, largest shapes first."""
        plans: dict[tuple[NodePool, NodeFilter], list[Shape]] = {}
        for cpu, mem, pools, node_filter, members in groups:
            if not pools or any(key == LABEL_HOSTNAME for key, _ in node_filter):
                self._counters.unprovisionable_pods += len(members)
                continue
            plans.setdefault((pools[0], node_filter), []).append((cpu, mem, members))
        for shapes in plans.values():
            # First-fit decreasing: big pods first, so small ones fill the gaps.
            shapes.sort(key=lambda shape: (-shape[0], -shape[1]))
        return [(pool, node_filter, shapes) for (pool, node_filter), shapes in plans.items()]

    def plan_nodes(
        self, pool: NodePool, node_filter: NodeFilter, shapes: Sequence[Shape], *, in_flight: bool
    ) -> list[tuple[InstanceType, list[SimPod]]]:
        """New nodes (the cheapest type for what each holds) for pods of these shapes.

        With `in_flight`, room left on Ready nodes and nodes still launching take pods
        first. Pods of one shape are packed in bulk: as many as fit go into the
        best-fitting node at once.
        """
        wanted_type = dict(node_filter).get(LABEL_INSTANCE_TYPE)
        types = [
            itype
            for itype in pool.config.instance_types
            if wanted_type is None or itype.name == wanted_type
        ]
        bins: FreeIndex[_Bin] = FreeIndex()
        if in_flight and not node_filter:
            for node in pool.nodes:
                if node.state is NodeState.LAUNCHING:
                    bins.add(_Bin(node.instance_type, pool.allocatable[node.instance_type.name]))
        new_bins: list[_Bin] = []
        held: list[tuple[SimNode, int, int, int]] = []
        try:
            for cpu, mem, pods in shapes:
                placed = 0
                if in_flight:
                    # Room left on Ready nodes comes first: the scheduler may simply not
                    # have reached these pods yet (its bind rate), as Karpenter's
                    # simulation counts existing nodes before it launches any.
                    while placed < len(pods):
                        ready = best_fit(
                            pool.index, cpu, mem, candidates=4, node_filter=node_filter
                        )
                        if ready is None:
                            break
                        count = _fitting(ready, cpu, mem, len(pods) - placed)
                        ready.take(cpu * count, mem * count, count)
                        held.append((ready, cpu * count, mem * count, count))
                        placed += count
                while placed < len(pods):
                    slot = best_fit(bins, cpu, mem, candidates=4)
                    if slot is None:
                        itype = _largest_fitting(pool, types, cpu, mem)
                        if itype is None:
                            self._counters.unprovisionable_pods += len(pods) - placed
                            break
                        slot = _Bin(itype, pool.allocatable[itype.name])
                        new_bins.append(slot)
                        bins.add(slot)
                    count = _fitting(slot, cpu, mem, len(pods) - placed)
                    slot.hold(pods[placed : placed + count], cpu, mem)
                    bins.update(slot)
                    placed += count
        finally:
            for node, cpu_held, mem_held, count in held:
                node.take(-cpu_held, -mem_held, -count)
        return [(_cheapest_holding(pool, types, *b.used()), b.members) for b in new_bins]


def _fitting(slot: SimNode | _Bin, cpu: int, mem: int, wanted: int) -> int:
    """How many of `wanted` pods of this shape fit in the slot's free capacity."""
    count = min(wanted, slot.free_pods)
    if cpu:
        count = min(count, slot.free_cpu // cpu)
    if mem:
        count = min(count, slot.free_mem // mem)
    return count


def _largest_fitting(
    pool: NodePool, types: Sequence[InstanceType], cpu: int, mem: int
) -> InstanceType | None:
    best: InstanceType | None = None
    best_size = (-1, -1)
    for itype in types:
        alloc = pool.allocatable[itype.name]
        if alloc.cpu_m >= cpu and alloc.memory_b >= mem and alloc.pods >= 1:
            size = (alloc.cpu_m, alloc.memory_b)
            if size > best_size:
                best, best_size = itype, size
    return best


def _cheapest_holding(
    pool: NodePool, types: Sequence[InstanceType], cpu: int, mem: int, pods: int
) -> InstanceType:
    fitting = [
        itype
        for itype in types
        if pool.allocatable[itype.name].cpu_m >= cpu
        and pool.allocatable[itype.name].memory_b >= mem
        and pool.allocatable[itype.name].pods >= pods
    ]
    # The planned bin was a fitting type, so the list is never empty.
    return min(fitting, key=lambda itype: (itype.price_per_hour, itype.cpu, itype.name))


class Consolidator(_NodeAutoscaler):
    """Removes empty and under-used nodes; see the module docstring.

    `evict(pod)` is the Eviction API (True when the eviction was accepted).
    """

    def __init__(self, parts: AutoscalerParts, *, evict: Callable[[SimPod], bool]) -> None:
        super().__init__(parts)
        self._evict = evict
        self._trigger = Trigger(parts.timeline, self._pass)

    def start(self) -> None:
        """Begin the periodic passes."""
        if self._config.consolidation:
            self._trigger.at(self._timeline.now() + self._config.consolidation_interval_s)

    def node_emptied(self, node: SimNode) -> None:
        """The last pod left a node: a draining node can go now."""
        if node.state is NodeState.DRAINING:
            self._fleet.terminate(node)

    def disrupt(self, node: SimNode) -> None:
        """Cordon and drain `node` now, whatever the policy (a manual disruption)."""
        self._fleet.cordon(node)
        self._drain(node)

    def _pass(self) -> None:
        now = self._timeline.now()
        commands = [
            (kind, nodes)
            for pool in self._fleet.pools.values()
            for kind, nodes in [self._choose(pool)]
            if nodes
        ]
        if not commands:
            self._trigger.at(now + self._config.consolidation_interval_s)
        elif self._config.validation_s > 0:
            # Karpenter holds a decision for its consolidation TTL and re-checks it; the
            # disruption loop waits meanwhile, so one command runs per cycle.
            self._timeline.after(self._config.validation_s, lambda: self._execute(commands, now))
        else:
            self._execute(commands, now)

    def _execute(self, commands: list[tuple[str, list[SimNode]]], decided: float) -> None:
        """Disrupt the nodes of each command that are still candidates, then wait a cycle."""
        for kind, nodes in commands:
            valid = [
                node
                for node in nodes
                if node.state is NodeState.READY
                and node.last_pod_event <= decided
                and not node.dnd_pods
                and not node.nominated
            ]
            if kind == _EMPTY:
                valid = [node for node in valid if not node.pods]
                self._counters.consolidated_empty += len(valid)
            else:
                valid = self._simulate(valid, len(valid), leaving=[])
                self._counters.consolidated_underutilized += len(valid)
            for node in valid:
                self.disrupt(node)
        self._trigger.at(self._timeline.now() + self._config.consolidation_interval_s)

    def _choose(self, pool: NodePool) -> tuple[str, list[SimNode]]:
        """One command for the pool: its empty candidates, else under-used ones that can go."""
        after = pool.config.consolidate_after_s
        allowed = pool.disruptions_allowed()
        if after is None or allowed <= 0:
            return _EMPTY, []
        now = self._timeline.now()

        def eligible(node: SimNode) -> bool:
            """Not pinned, nothing reserved on it, quiet for `consolidate_after`."""
            return not node.dnd_pods and not node.nominated and now - node.last_pod_event >= after

        empty: list[SimNode] = []
        for node in pool.empty:
            if len(empty) >= allowed:
                break
            if eligible(node):
                empty.append(node)
        if empty:
            return _EMPTY, empty
        if pool.config.consolidation_policy is not ConsolidationPolicy.WHEN_EMPTY_OR_UNDERUTILIZED:
            return _EMPTY, []
        # Candidates come from the emptiest nodes (most free CPU), the likeliest to fit
        # elsewhere, and are tried fewest pods first (Karpenter's disruption cost counts
        # pods). The scan is bounded so that a full cluster costs little.
        wanted = self._config.max_underutilized_candidates
        candidates: list[SimNode] = []
        for scanned, node in enumerate(pool.index.descending()):
            if scanned >= 4 * wanted or len(candidates) >= wanted:
                break
            if node.pods and eligible(node):
                candidates.append(node)
        candidates.sort(key=lambda node: (len(node.pods), node.seq))
        return _UNDERUTILIZED, self._simulate(candidates, allowed, leaving=[])

    def _simulate(
        self, candidates: list[SimNode], allowed: int, *, leaving: list[SimNode]
    ) -> list[SimNode]:
        """Candidates whose pods all fit on other Ready nodes, up to `allowed` of them.

        Nodes in `leaving` (chosen already) are no targets. Placements are held on the
        target nodes while the pass lasts (so two candidates cannot count on the same
        free space) and all given back at the end.
        """
        held: list[tuple[SimNode, SimPod]] = []
        removed: list[SimNode] = []
        for node in leaving:
            node.pool.index.discard(node)
            node.index = None
            removed.append(node)
        targets: dict[SimNode, None] = {}
        budget_left: dict[PodDisruptionBudget, int] = {}
        chosen: list[SimNode] = []
        # Shapes that found no room: capacity only shrinks during the pass, so a pod at
        # least as large (with the same eligibility) finds none either.
        hopeless: list[tuple[int, int, tuple[NodePool, ...], NodeFilter]] = []
        simulated = 0
        try:
            for node in candidates:
                if len(chosen) >= allowed or simulated >= self._config.max_simulated_pods:
                    break
                if node in targets or not self._evictable(node, budget_left):
                    continue
                node.pool.index.discard(node)
                node.index = None
                removed.append(node)
                mark = len(held)
                fits = True
                for pod in sorted(node.pods, key=lambda p: (-p.cpu, -p.mem, p.seq)):
                    if pod.terminating:
                        continue
                    simulated += 1
                    if any(
                        pod.cpu >= cpu
                        and pod.mem >= mem
                        and pod.pools == pools
                        and pod.node_filter == node_filter
                        for cpu, mem, pools, node_filter in hopeless
                    ):
                        fits = False
                        break
                    target = self._scheduler.find_node(pod)
                    if target is None:
                        hopeless.append((pod.cpu, pod.mem, pod.pools, pod.node_filter))
                        fits = False
                        break
                    target.take(pod.cpu, pod.mem, 1)
                    held.append((target, pod))
                if fits:
                    chosen.append(node)
                    self._spend(node, budget_left)
                    for target, _ in held[mark:]:
                        targets[target] = None
                else:
                    for target, pod in held[mark:]:
                        target.take(-pod.cpu, -pod.mem, -1)
                    del held[mark:]
                    removed.pop()
                    node.index = node.pool.index
                    node.pool.index.add(node)
        finally:
            for target, pod in held:
                target.take(-pod.cpu, -pod.mem, -1)
            for node in removed:
                node.index = node.pool.index
                node.pool.index.add(node)
        return chosen

    def _evictable(self, node: SimNode, budget_left: dict[PodDisruptionBudget, int]) -> bool:
        """Every pod can be evicted under its budget, counting evictions planned this pass."""
        wanted: dict[PodDisruptionBudget, int] = {}
        for pod in node.pods:
            budgets = pod.pdbs
            if not budgets or pod.terminating:
                continue
            if len(budgets) > 1:
                return False  # the Eviction API answers 500 for such a pod
            if pod.ready:
                wanted[budgets[0]] = wanted.get(budgets[0], 0) + 1
        for budget, count in wanted.items():
            left = budget_left.get(budget, budget.disruptions_allowed())
            if count > left:
                return False
        return True

    def _spend(self, node: SimNode, budget_left: dict[PodDisruptionBudget, int]) -> None:
        for pod in node.pods:
            if pod.pdbs and pod.ready and not pod.terminating:
                budget = pod.pdbs[0]
                budget_left[budget] = budget_left.get(budget, budget.disruptions_allowed()) - 1

    def _drain(self, node: SimNode) -> None:
        if node.state is not NodeState.DRAINING:
            return
        waiting = False
        for pod in list(node.pods):
            if pod.terminating:
                continue
            if pod.dnd or not self._evict(pod):
                waiting = True
        if not node.pods:
            self._fleet.terminate(node)
        elif waiting:
            self._timeline.after(self._config.eviction_retry_s, lambda: self._drain(node))
