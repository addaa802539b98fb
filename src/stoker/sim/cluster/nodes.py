"""Node pools and the fleet of simulated nodes: launch, Ready, cordon, terminate, cost.

A `NodePoolConfig` is a Karpenter NodePool in miniature: the instance types it may
launch, the labels and taints its nodes carry, a CPU limit, how long a node takes to
become Ready, and its disruption settings (consolidation policy, `consolidate_after`,
the node budget). `NodeFleet` owns every node's life; the scheduler, kubelet and
autoscaler act on nodes only through it, and it keeps the totals the report needs
(launched, terminated, node-hours cost) in O(1) per change.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Protocol

from stoker.ports.cluster import LABEL_HOSTNAME
from stoker.sim.cluster.model import (
    LABEL_INSTANCE_TYPE,
    NodePool,
    NodeState,
    SimNode,
)
from stoker.sim.cluster.resources import (
    InstanceType,
)
from stoker.sim.cluster.timeline import Timeline


class NodeListener(Protocol):
    """What hears of the nodes' lives (the cluster, which tells its controllers)."""

    def node_ready(self, node: SimNode) -> None:
        """`node` became schedulable."""
        ...

    def node_cordoned(self, node: SimNode) -> None:
        """`node` stopped being schedulable."""
        ...

    def node_terminated(self, node: SimNode) -> None:
        """`node` is gone."""
        ...


class NodeFleet:
    """Every simulated node: launched, Ready, cordoned for a drain, terminated; `listener`
    hears of each change."""

    def __init__(
        self,
        *,
        pools: tuple[NodePool, ...],
        timeline: Timeline,
        rng: random.Random,
        listener: NodeListener,
    ) -> None:
        self.pools = {pool.name: pool for pool in pools}
        self._timeline = timeline
        self._rng = rng
        # Launch failures draw from their own generator (seeded from the run's without
        # drawing from it), so a pool without them replays exactly as before. The seed is
        # the state's text, not its hash(): before Python 3.12 that hashes the state's
        # None by its address, which differs from process to process.
        self._failures = random.Random(repr(rng.getstate()))
        #: Launches whose instance never joined and was replaced (`launch_failure_rate`).
        self.launch_failures = 0
        self._listener = listener
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
        config = pool.config
        if delay_s is None and config.launch_failure_rate:
            # An instance that never joins is replaced once its registration times out;
            # the node (and its cost) runs from the first launch.
            while self._failures.random() < config.launch_failure_rate:
                self.launch_failures += 1
                delay += config.launch_failure_after_s
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
        self._listener.node_cordoned(node)

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
        self._listener.node_terminated(node)

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
        self._listener.node_ready(node)

    def _move(self, node: SimNode, state: NodeState) -> None:
        self.by_state[node.state] -= 1
        self.by_state[state] += 1
        node.state = state
