"""The simulated cluster: scheduler, kubelet, autoscaler, controllers, faults, determinism.

Every test runs on looptime's virtual clock and asserts virtual times exactly. Delays
are constants here, so each expected time is a sum a reader can check by hand; the
cluster's events fall on its half-second grid, and `until` looks between grid points
(at x.25 / x.75) so that what it sees is settled, then reports the grid time.

Allocatable CPU of the nodes used below (see `InstanceType.allocatable`): m5.xlarge
4000m - 80m kube-reserved - 125m DaemonSets = 3795m; m5.2xlarge 8000m - 90m - 125m = 7785m.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import looptime
import pytest

from stoker.ports.clock import LoopClock
from stoker.ports.cluster import (
    LABEL_HOSTNAME,
    ClusterUnavailable,
    Conflict,
    Container,
    Lease,
    Pod,
    PodPhase,
    PodSpec,
    PreferredNodes,
    Toleration,
)
from stoker.sim.cluster import SimCluster
from stoker.sim.cluster.autoscaler import AutoscalerConfig
from stoker.sim.cluster.client import FaultKind, FaultSpec
from stoker.sim.cluster.config import SimClusterConfig
from stoker.sim.cluster.disruption import EvictionVerdict
from stoker.sim.cluster.distributions import Bucket, Buckets, Constant
from stoker.sim.cluster.kubelet import KubeletConfig
from stoker.sim.cluster.model import DO_NOT_DISRUPT
from stoker.sim.cluster.resources import INSTANCE_TYPES_BY_NAME
from stoker.sim.cluster.scheduler import SchedulerConfig
from stoker.sim.cluster.specs import Archetype, NodePoolConfig, Shape, Taint, WorkloadKind
from stoker.sim.cluster.workloads import BackgroundConfig, StepProfile

pytestmark = pytest.mark.looptime

EPOCH = 1_700_000_000.0
WORKER = "stoker-worker"
PLACEHOLDER = "stoker-placeholder"
PAUSE = "registry.k8s.io/pause:3.9"
XLARGE = INSTANCE_TYPES_BY_NAME["m5.xlarge"]
XXLARGE = INSTANCE_TYPES_BY_NAME["m5.2xlarge"]

#: Pulls take 10 s (pause images 1 s), containers start in 2 s, SIGTERM exits in 1 s.
KUBELET = KubeletConfig(
    image_pull=Constant(10.0),
    image_pull_by_image={"registry.k8s.io/pause": Constant(1.0)},
    container_start=Constant(2.0),
    shutdown=Constant(1.0),
)


def pool(**overrides: Any) -> NodePoolConfig:
    """m5.xlarge and m5.2xlarge nodes, Ready 40 s after launch, consolidated after 30 s."""
    settings: dict[str, Any] = {
        "instance_types": (XLARGE, XXLARGE),
        "provisioning": Constant(40.0),
        "consolidate_after_s": 30.0,
    }
    settings.update(overrides)
    return NodePoolConfig(**settings)


def config(**overrides: Any) -> SimClusterConfig:
    """A small deterministic cluster; autoscaling off unless a test turns it on."""
    settings: dict[str, Any] = {
        "priority_classes": {WORKER: 10_000, PLACEHOLDER: -10},
        "node_pools": (pool(),),
        "kubelet": KUBELET,
        "autoscaler": AutoscalerConfig(provisioning=False, consolidation=False),
    }
    settings.update(overrides)
    return SimClusterConfig(**settings)


def pod(
    name: str,
    *,
    cpu: str = "1",
    memory: str = "1Gi",
    image: str = "worker:1",
    priority_class: str | None = WORKER,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    grace_s: int | None = None,
    node: str | None = None,
    preferred: tuple[PreferredNodes, ...] = (),
) -> Pod:
    """A worker-like pod; `node` pins it to a node by hostname, `preferred` are its
    preferred nodes."""
    return Pod(
        name=name,
        labels=labels or {"stoker.dev/pool": "p"},
        annotations=annotations or {},
        spec=PodSpec(
            containers=(Container(name="worker", image=image, cpu=cpu, memory=memory),),
            priority_class_name=priority_class,
            termination_grace_period_s=grace_s,
            node_selector={LABEL_HOSTNAME: node} if node else {},
            preferred_nodes=preferred,
        ),
    )


MakeCluster = Callable[..., Awaitable[SimCluster]]


@pytest.fixture
async def make_cluster() -> AsyncIterator[MakeCluster]:
    """Builds started clusters (seed 7) from `config(**overrides)`; stops them after."""
    made: list[SimCluster] = []

    async def make(**overrides: Any) -> SimCluster:
        cluster = SimCluster(
            config(**overrides), clock=LoopClock(epoch=EPOCH), rng=random.Random(7)
        )
        await cluster.start()
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        await cluster.stop()


async def until(cluster: SimCluster, check: Callable[[], Any], *, limit: float = 3600) -> float:
    """The grid time at which `check()` first holds (looking between grid points)."""
    tick = cluster.config.tick_s
    phase = cluster.now() % tick
    await asyncio.sleep((tick / 2 - phase) % tick)
    while not check():
        if cluster.now() > limit:
            raise AssertionError(f"not reached within {limit} s")
        await asyncio.sleep(tick)
    return cluster.now() - tick / 2


async def at(cluster: SimCluster, t: float) -> None:
    """Sleep until `t` seconds after the cluster started."""
    await asyncio.sleep(t - cluster.now())


def node_of(cluster: SimCluster, name: str, *, namespace: str | None = None) -> str | None:
    """The node a pod is bound to (None if unbound or gone)."""
    for usage in cluster.pod_usage(namespace or cluster.config.namespace):
        if usage.name == name:
            return usage.node
    return None


def phase_of(cluster: SimCluster, name: str) -> str | None:
    """The pod's phase, or None if it is gone."""
    for usage in cluster.pod_usage(cluster.config.namespace):
        if usage.name == name:
            return usage.phase
    return None


def names(cluster: SimCluster) -> list[str]:
    """Names of the nodes not terminated."""
    return [node.name for node in cluster.nodes()]


# -- the scheduler ---------------------------------------------------------------------------


async def test_the_scheduler_packs_the_most_allocated_node_that_fits(
    make_cluster: MakeCluster,
) -> None:
    """MostAllocated: pods pile onto one node until it is full, then take the next one."""
    cluster = await make_cluster(node_pools=(pool(initial_nodes={"m5.xlarge": 3}),))
    first, second, _ = names(cluster)
    for name, cpu in [("a", "1"), ("b", "1"), ("c", "1"), ("d", "2"), ("e", "500m")]:
        await cluster.api.create_pod(pod(name, cpu=cpu))
    await until(cluster, lambda: cluster.snapshot().binds_total == 5)
    # a, b, c fill the first node to 3000m of 3795m; d (2 cores) no longer fits there;
    # e (500m) fits the 795m left, the fullest candidate.
    assert [node_of(cluster, name) for name in "abcde"] == [first, first, first, second, first]


async def test_a_preferred_node_wins_over_a_fuller_one_while_it_has_room(
    make_cluster: MakeCluster,
) -> None:
    """Preferred node affinity outweighs MostAllocated (kube-scheduler's two scores, each
    0-100 with weight 1): the pod goes to the preferred node that fits, the heavier
    preference first, and to the fullest node when none of them fits."""
    cluster = await make_cluster(node_pools=(pool(initial_nodes={"m5.xlarge": 3}),))
    first, second, third = names(cluster)
    await cluster.api.create_pod(pod("full", cpu="3", node=first))
    await cluster.api.create_pod(pod("some", cpu="1", node=second))
    await until(cluster, lambda: cluster.snapshot().binds_total == 2)
    near = (PreferredNodes(100, (first,)), PreferredNodes(50, (third,)))
    # The first (100) has no room for 1 core: the third (50) beats the fuller second.
    await cluster.api.create_pod(pod("a", cpu="1", preferred=near))
    await until(cluster, lambda: cluster.snapshot().binds_total == 3)
    assert node_of(cluster, "a") == third
    # 500m fits the first: the heaviest preference wins.
    await cluster.api.create_pod(pod("b", cpu="500m", preferred=near))
    await until(cluster, lambda: cluster.snapshot().binds_total == 4)
    assert node_of(cluster, "b") == first
    # A preference for nodes the cluster does not have changes nothing: the fullest
    # node with room (the second, with 1 core of 3.8) takes it.
    await cluster.api.create_pod(pod("c", cpu="2", preferred=(PreferredNodes(100, ("gone",)),)))
    await until(cluster, lambda: cluster.snapshot().binds_total == 5)
    assert node_of(cluster, "c") == second


async def test_binds_are_limited_to_the_configured_rate(make_cluster: MakeCluster) -> None:
    """A burst of 5, then 10 pods per second: 25 pods are bound in 2 s, 5 per grid step."""
    cluster = await make_cluster(
        node_pools=(pool(initial_nodes={"m5.2xlarge": 1}),),
        scheduler=SchedulerConfig(bind_rate=10, bind_burst=5),
    )
    for index in range(25):
        await cluster.api.create_pod(pod(f"w-{index}", cpu="100m"))
    bound = []
    await asyncio.sleep(0.25)
    for _ in range(5):
        bound.append(cluster.snapshot().binds_total)
        await asyncio.sleep(0.5)
    assert bound == [5, 10, 15, 20, 25]


@pytest.mark.timeout(60, method="thread")
async def test_a_slow_bind_rate_that_accrues_to_just_under_a_token_still_binds(
    make_cluster: MakeCluster,
) -> None:
    """0.2 binds/s on a half-second grid: ten steps of 0.1 token sum to 0.9999999999999999.
    The scheduler must come back a tick later, not spin in the same tick for ever."""
    cluster = await make_cluster(
        node_pools=(pool(initial_nodes={"m5.2xlarge": 1}),),
        scheduler=SchedulerConfig(bind_rate=0.2, bind_burst=1),
    )
    # A new pod every step makes the scheduler pass (and accrue 0.1 token) every step.
    for index in range(24):
        await cluster.api.create_pod(pod(f"w-{index}", cpu="100m"))
        await asyncio.sleep(0.5)
    assert 2 <= cluster.snapshot().binds_total <= 3


async def test_a_pod_that_fits_nowhere_stays_pending_with_a_reason(
    make_cluster: MakeCluster,
) -> None:
    """Too big for every node: Pending, reason Unschedulable, and counted as such."""
    cluster = await make_cluster(node_pools=(pool(initial_nodes={"m5.xlarge": 1}),))
    await cluster.api.create_pod(pod("huge", cpu="6"))
    await until(cluster, lambda: cluster.snapshot().pods_unschedulable == 1)
    stored = await cluster.api.get_pod("huge")
    assert stored is not None
    assert (stored.phase, stored.node_name, stored.reason) == (
        PodPhase.PENDING,
        None,
        "Unschedulable",
    )


async def test_node_selectors_and_taints_decide_the_pool(make_cluster: MakeCluster) -> None:
    """A tainted pool takes only pods that tolerate it; a selector picks the pool."""
    gpu_like = pool(
        name="dedicated",
        labels={"stoker.dev/nodes": "workers"},
        taints=(Taint("stoker.dev/dedicated", "workers"),),
        initial_nodes={"m5.xlarge": 1},
    )
    cluster = await make_cluster(node_pools=(pool(initial_nodes={"m5.xlarge": 1}), gpu_like))
    general, dedicated = (node.name for node in cluster.nodes())
    toleration = Toleration(key="stoker.dev/dedicated", value="workers", effect="NoSchedule")
    plain = pod("plain")
    chosen = Pod(
        name="chosen",
        spec=PodSpec(
            containers=plain.spec.containers,
            node_selector={"stoker.dev/nodes": "workers"},
            tolerations=(toleration,),
        ),
    )
    intolerant = Pod(
        name="intolerant",
        spec=PodSpec(
            containers=plain.spec.containers, node_selector={"stoker.dev/nodes": "workers"}
        ),
    )
    for item in (plain, chosen, intolerant):
        await cluster.api.create_pod(item)
    await until(cluster, lambda: cluster.snapshot().binds_total == 2)
    assert node_of(cluster, "plain") == general
    assert node_of(cluster, "chosen") == dedicated
    assert node_of(cluster, "intolerant") is None


# -- the kubelet -----------------------------------------------------------------------------


async def test_images_are_pulled_once_per_node_and_one_at_a_time(
    make_cluster: MakeCluster,
) -> None:
    """Pull 10 s (serial per node, shared by pods needing the same image), start 2 s."""
    cluster = await make_cluster(node_pools=(pool(initial_nodes={"m5.2xlarge": 2}),))
    one, two = names(cluster)
    await cluster.api.create_pod(pod("p1", image="a:1", node=one))
    await cluster.api.create_pod(pod("p2", image="a:1", node=one))
    await cluster.api.create_pod(pod("p3", image="b:1", node=one))

    def running(name: str) -> Callable[[], bool]:
        return lambda: phase_of(cluster, name) == PodPhase.RUNNING

    assert await until(cluster, running("p1")) == 12  # pull a 0-10, start 10-12
    assert phase_of(cluster, "p2") == PodPhase.RUNNING  # shared the pull of a
    assert await until(cluster, running("p3")) == 22  # pull b waits for a: 10-20

    await at(cluster, 30)
    await cluster.api.create_pod(pod("p4", image="a:1", node=one))
    await cluster.api.create_pod(pod("p5", image="a:1", node=two))
    assert await until(cluster, running("p4")) == 32  # a is cached on the first node
    assert await until(cluster, running("p5")) == 42  # the second node pulls it
    assert cluster.snapshot().image_pulls_total == 3

    started = await cluster.api.get_pod("p5")
    assert started is not None and started.ready and started.pod_ip is not None


async def test_deletion_waits_for_the_container_or_the_grace_period(
    make_cluster: MakeCluster,
) -> None:
    """SIGTERM exits in 1 s unless the grace is shorter; an unbound pod goes at once."""
    cluster = await make_cluster(
        node_pools=(pool(initial_nodes={"m5.xlarge": 1}),),
        kubelet=KubeletConfig(
            image_pull=Constant(10.0), container_start=Constant(2.0), shutdown=Constant(5.0)
        ),
    )
    for name in ("slow", "short"):
        await cluster.api.create_pod(pod(name))
    await cluster.api.create_pod(pod("pending", cpu="64"))
    await until(cluster, lambda: phase_of(cluster, "short") == PodPhase.RUNNING)

    await at(cluster, 20)
    client = cluster.client("replica-a")
    await client.delete_pod("slow", grace_s=30)
    await client.delete_pod("short", grace_s=3)
    await client.delete_pod("pending", grace_s=30)
    assert await client.get_pod("pending") is None
    terminating = await client.get_pod("slow")
    assert terminating is not None and terminating.deletion_timestamp == EPOCH + 50
    assert await until(cluster, lambda: phase_of(cluster, "short") is None) == 23
    assert await until(cluster, lambda: phase_of(cluster, "slow") is None) == 25


async def test_start_slots_bound_the_starts_of_the_whole_cluster(
    make_cluster: MakeCluster,
) -> None:
    """A machine's start-up slots (a backtest of local processes): two starts at once
    across both nodes, the others in arrival order; a start that holds its slot for its
    whole 2 s, or for 1 s only (a start-up that waits gives its slot on)."""
    for hold, expected in ((None, [2, 2, 4, 4, 6]), (1.0, [2, 2, 3, 3, 4])):
        cluster = await make_cluster(
            node_pools=(pool(initial_nodes={"m5.2xlarge": 2}),),
            kubelet=dataclasses.replace(
                KUBELET, image_pull=Constant(0.0), start_limit=2, start_hold_s=hold
            ),
        )
        one, two = names(cluster)
        start = cluster.now()
        for i in range(5):
            await cluster.api.create_pod(pod(f"p{i}", node=one if i % 2 else two))
        times = [await until(cluster, _running(cluster, f"p{i}")) - start for i in range(5)]
        assert times == expected, (hold, times)


def _running(cluster: SimCluster, name: str) -> Callable[[], bool]:
    return lambda: phase_of(cluster, name) == PodPhase.RUNNING


async def test_a_start_stopped_gives_its_slot_on_at_once(make_cluster: MakeCluster) -> None:
    """One slot: the second pod waits for the first's 2 s start, unless the first is
    deleted meanwhile (at 1 s: the second then starts at 1 s and runs at 3 s)."""
    cluster = await make_cluster(
        node_pools=(pool(initial_nodes={"m5.2xlarge": 1}),),
        kubelet=dataclasses.replace(KUBELET, image_pull=Constant(0.0), start_limit=1),
    )
    await cluster.api.create_pod(pod("first"))
    await cluster.api.create_pod(pod("second"))
    await at(cluster, 1)
    await cluster.client("replica-a").delete_pod("first", grace_s=30)
    assert await until(cluster, lambda: phase_of(cluster, "second") == PodPhase.RUNNING) == 3


def test_start_slots_refuse_a_bound_below_one() -> None:
    with pytest.raises(ValueError, match="start_limit"):
        KubeletConfig(start_limit=0)
    with pytest.raises(ValueError, match="start_hold_s"):
        KubeletConfig(start_limit=1, start_hold_s=-1.0)


# -- preemption ------------------------------------------------------------------------------


async def test_a_worker_preempts_a_placeholder_whose_replacement_gets_a_new_node(
    make_cluster: MakeCluster,
) -> None:
    """The youngest placeholder makes room at once; recreated, it waits for a new node."""
    cluster = await make_cluster(
        node_pools=(pool(instance_types=(XLARGE,), initial_nodes={"m5.xlarge": 1}),),
        autoscaler=AutoscalerConfig(consolidation=False),
    )
    (first,) = names(cluster)
    for index in range(3):
        await cluster.api.create_pod(
            pod(f"ph-{index}", cpu="1200m", image=PAUSE, priority_class=PLACEHOLDER, grace_s=0)
        )
    await until(cluster, lambda: cluster.snapshot().binds_total == 3)

    await at(cluster, 5)
    await cluster.api.create_pod(pod("worker", cpu="1"))
    assert await until(cluster, lambda: node_of(cluster, "worker") == first) == 5
    assert await cluster.api.get_pod("ph-2") is None  # the youngest was the victim
    assert {"ph-0", "ph-1"} <= {usage.name for usage in cluster.pod_usage()}
    snapshot = cluster.snapshot()
    assert (snapshot.preemptions_total, snapshot.preemptors_total) == (1, 1)

    # The runtime's placeholder controller recreates it: pending, it makes the
    # autoscaler launch a node (batch closes 1 s later, Ready 40 s after that).
    await at(cluster, 10)
    await cluster.api.create_pod(
        pod("ph-3", cpu="1200m", image=PAUSE, priority_class=PLACEHOLDER, grace_s=0)
    )
    ready = await until(cluster, lambda: node_of(cluster, "ph-3") is not None)
    assert ready == 10 + 1 + 40
    assert node_of(cluster, "ph-3") != first
    assert cluster.snapshot().nodes_launched_total == 2


async def test_a_pod_never_preempts_its_equals(make_cluster: MakeCluster) -> None:
    """Preemption needs strictly lower priority: a worker waits behind workers."""
    cluster = await make_cluster(node_pools=(pool(initial_nodes={"m5.xlarge": 1}),))
    await cluster.api.create_pod(pod("first", cpu="3"))
    await cluster.api.create_pod(pod("second", cpu="3"))
    await until(cluster, lambda: cluster.snapshot().pods_unschedulable == 1)
    assert node_of(cluster, "second") is None
    assert cluster.snapshot().preemptions_total == 0


# -- provisioning ----------------------------------------------------------------------------


async def test_a_batch_of_unschedulable_pods_launches_the_cheapest_nodes(
    make_cluster: MakeCluster,
) -> None:
    """Ten 1-core pods: one m5.2xlarge (7 fit) and one m5.xlarge for the other 3.

    The batch closes 1 s after the last pod arrived; the nodes are Ready 40 s later and
    the pods are bound in that very step.
    """
    cluster = await make_cluster(autoscaler=AutoscalerConfig(consolidation=False))
    for index in range(10):
        await cluster.api.create_pod(pod(f"w-{index}", memory="2Gi"))
    await until(cluster, lambda: cluster.snapshot().nodes_launched_total > 0)
    nodes = cluster.nodes()
    assert sorted(node.instance_type for node in nodes) == ["m5.2xlarge", "m5.xlarge"]
    assert [node.launched_at for node in nodes] == [1.0, 1.0]
    assert cluster.snapshot().nodes_by_state["launching"] == 2

    bound = await until(cluster, lambda: cluster.snapshot().binds_total == 10)
    assert bound == 41
    assert [node.ready_at for node in cluster.nodes()] == [41.0, 41.0]
    await asyncio.sleep(30)
    assert cluster.snapshot().nodes_launched_total == 2  # nothing more was needed


async def test_the_pool_cpu_limit_caps_provisioning(make_cluster: MakeCluster) -> None:
    """A NodePool limit of 10 cores: one m5.2xlarge (8) fits, the second node does not."""
    cluster = await make_cluster(
        node_pools=(pool(limit_cpu=10.0),), autoscaler=AutoscalerConfig(consolidation=False)
    )
    for index in range(14):
        await cluster.api.create_pod(pod(f"w-{index}"))
    await asyncio.sleep(60)
    snapshot = cluster.snapshot()
    assert snapshot.nodes_by_instance_type == {"m5.2xlarge": 1}
    assert snapshot.binds_total == 7
    assert snapshot.pods_unschedulable == 7


# -- consolidation ---------------------------------------------------------------------------


async def test_an_empty_node_is_consolidated_after_consolidate_after(
    make_cluster: MakeCluster,
) -> None:
    """Polls every 10 s; the poll 30 s after its last pod decides, 15 s later it goes."""
    cluster = await make_cluster(
        node_pools=(pool(initial_nodes={"m5.xlarge": 2}),),
        autoscaler=AutoscalerConfig(provisioning=False),
    )
    busy, idle = names(cluster)
    await cluster.api.create_pod(pod("keeper", node=busy))
    gone = await until(cluster, lambda: idle not in names(cluster))
    assert gone == 30 + 15
    await asyncio.sleep(120)
    assert names(cluster) == [busy]  # its pod has nowhere else to go
    assert node_of(cluster, "keeper") == busy
    assert cluster.snapshot().consolidated_empty_total == 1


async def test_do_not_disrupt_keeps_a_node_until_the_annotation_goes(
    make_cluster: MakeCluster,
) -> None:
    """A do-not-disrupt pod pins its node; once unpinned, its pod moves and the node goes."""
    cluster = await make_cluster(
        node_pools=(pool(instance_types=(XLARGE,), initial_nodes={"m5.xlarge": 3}),),
        autoscaler=AutoscalerConfig(provisioning=False),
    )
    first, second, third = names(cluster)
    await cluster.api.create_pod(
        pod("busy", cpu="500m", annotations={DO_NOT_DISRUPT: "true"})
    )  # lands on the first node
    await cluster.api.create_pod(pod("anchor", cpu="2", node=second))
    # The empty third node: decided at the poll at 30, gone after validation at 45.
    assert await until(cluster, lambda: third not in names(cluster)) == 45
    await at(cluster, 50)
    assert names(cluster) == [first, second]  # no poll so far took the pinned node
    pinned = cluster.node(first)
    assert pinned is not None and pinned.do_not_disrupt_pods == 1

    await cluster.api.patch_pod("busy", annotations={DO_NOT_DISRUPT: None})
    # The poll at 55 finds the pod fits next to the anchor; validated at 70, the pod is
    # evicted and exits 1 s later, and the node goes with it.
    assert await until(cluster, lambda: first not in names(cluster)) == 71
    snapshot = cluster.snapshot()
    assert (snapshot.evictions_total, snapshot.consolidated_underutilized_total) == (1, 1)


async def test_the_budget_limits_how_many_nodes_a_pass_disrupts(
    make_cluster: MakeCluster,
) -> None:
    """`nodes: 20%` of the pool per command, rounded up: 10 empty nodes go 2, 2, 2, 1, 1, 1, 1.

    A command is decided at a poll, runs 15 s later, and the next poll is 10 s after it.
    """
    cluster = await make_cluster(
        node_pools=(pool(initial_nodes={"m5.xlarge": 10}, budget_nodes="20%"),),
        autoscaler=AutoscalerConfig(provisioning=False),
    )
    counts = []
    for t in (29.75, 45.25, 70.25, 95.25, 120.25, 145.25, 170.25, 195.25):
        await at(cluster, t)
        counts.append(len(cluster.nodes()))
    assert counts == [10, 8, 6, 4, 3, 2, 1, 0]
    assert cluster.snapshot().nodes_terminated_total == 10


async def test_a_budget_refuses_an_eviction_it_cannot_afford(make_cluster: MakeCluster) -> None:
    """minAvailable 2 over 3 ready pods: one eviction is allowed, the next is a 429."""
    cluster = await make_cluster(node_pools=(pool(initial_nodes={"m5.xlarge": 1}),))
    db = {"app": "db"}
    for index in range(3):
        await cluster.api.create_pod(pod(f"db-{index}", cpu="500m", labels=db))
    cluster.create_pdb("db", db, min_available=2)
    await until(cluster, lambda: all(u.ready for u in cluster.pod_usage()))

    assert cluster.evict("db-0") is EvictionVerdict.ALLOWED
    assert cluster.evict("db-1") is EvictionVerdict.BUDGET
    spared = await cluster.api.get_pod("db-1")
    assert spared is not None and spared.deletion_timestamp is None
    snapshot = cluster.snapshot()
    assert (snapshot.evictions_total, snapshot.eviction_refusals_total) == (1, 1)

    await cluster.api.create_pod(pod("db-3", cpu="500m", labels=db))
    await until(cluster, lambda: all(u.ready for u in cluster.pod_usage() if u.name == "db-3"))
    assert cluster.evict("db-1") is EvictionVerdict.ALLOWED


async def test_a_drain_retries_a_refused_eviction_every_two_seconds(
    make_cluster: MakeCluster,
) -> None:
    """The only replica is protected until a second one is Ready on another node."""
    cluster = await make_cluster(node_pools=(pool(initial_nodes={"m5.xlarge": 2}),))
    first, second = names(cluster)
    db = {"app": "db"}
    await cluster.api.create_pod(pod("db-0", labels=db, node=first))
    cluster.create_pdb("db", db, min_available=1)
    await at(cluster, 20)
    cluster.disrupt_node(first)
    await at(cluster, 25)
    await cluster.api.create_pod(pod("db-1", labels=db, node=second))  # Ready at 25+10+2
    # Retries at 20, 22, ..., 36 are refused; the one at 38 passes; db-0 exits at 39.
    assert await until(cluster, lambda: first not in names(cluster)) == 39
    snapshot = cluster.snapshot()
    assert (snapshot.eviction_refusals_total, snapshot.evictions_total) == (9, 1)


async def test_a_budget_keeps_a_node_out_of_consolidation(make_cluster: MakeCluster) -> None:
    """Karpenter skips a node whose pods' budget allows no eviction now."""
    cluster = await make_cluster(
        node_pools=(pool(instance_types=(XLARGE,), initial_nodes={"m5.xlarge": 2}),),
        autoscaler=AutoscalerConfig(provisioning=False),
    )
    first, second = names(cluster)
    db = {"app": "db"}
    await cluster.api.create_pod(pod("db-0", cpu="500m", labels=db))  # on the first node
    await cluster.api.create_pod(pod("other", cpu="2", node=second))
    cluster.create_pdb("db", db, max_unavailable=0)
    await at(cluster, 125)
    assert names(cluster) == [first, second]
    assert cluster.snapshot().evictions_total == 0

    cluster.delete_pdb("db")
    # The poll at 130 decides (db-0 fits next to `other`), validation ends at 145, db-0
    # exits at 146 and the node goes.
    assert await until(cluster, lambda: first not in names(cluster)) == 146


# -- controllers -----------------------------------------------------------------------------

WEB = Archetype(
    name="web",
    machine_share=1.0,
    shapes=(Shape("500m", "512Mi"),),
    priority_class="sim-background-standard",
    grace_s=10,
)
DB = Archetype(
    name="db",
    machine_share=1.0,
    shapes=(Shape("500m", "512Mi"),),
    priority_class="sim-background-high",
    kind=WorkloadKind.STATEFULSET,
    grace_s=10,
)
BG = "background"


def bg_pods(cluster: SimCluster) -> dict[str, tuple[str | None, bool, bool]]:
    """Background pods: name -> (node, ready, terminating)."""
    return {
        usage.name: (usage.node, usage.ready, usage.terminating) for usage in cluster.pod_usage(BG)
    }


async def test_a_deployment_replaces_an_evicted_pod_at_once(make_cluster: MakeCluster) -> None:
    """The ReplicaSet creates the replacement while the evicted pod is still terminating."""
    cluster = await make_cluster(node_pools=(pool(initial_nodes={"m5.xlarge": 1}),))
    workload = cluster.start_workload(WEB, replicas=3)
    await until(cluster, lambda: sum(ready for _, ready, _ in bg_pods(cluster).values()) == 3)
    original = cluster.workload_pods(workload)

    await at(cluster, 20)
    assert cluster.evict(original[0], namespace=BG) is EvictionVerdict.ALLOWED
    await asyncio.sleep(0.25)
    pods = bg_pods(cluster)
    assert len(pods) == 4 and pods[original[0]][2]  # replacement exists, old one terminating
    replaced = await until(
        cluster,
        lambda: sum(ready and not term for _, ready, term in bg_pods(cluster).values()) == 3,
    )
    assert replaced == 22  # created at 20, image cached on the node, started in 2 s
    current = cluster.workload_pods(workload)
    assert len(current) == 3 and original[0] not in current
    replacement = next(name for name in current if name not in original)
    assert replacement.startswith(original[0].rsplit("-", 1)[0] + "-")


async def test_a_statefulset_starts_in_order_and_keeps_the_evicted_pods_name(
    make_cluster: MakeCluster,
) -> None:
    """OrderedReady: ordinal i+1 after i is Ready; a lost ordinal comes back by name."""
    cluster = await make_cluster(node_pools=(pool(initial_nodes={"m5.xlarge": 1}),))
    workload = cluster.start_workload(DB, replicas=3)
    expected = [f"{workload}-{i}" for i in range(3)]
    created = {}
    for name in expected:
        await until(cluster, functools.partial(lambda name: name in bg_pods(cluster), name))
        created[name] = cluster.now() - 0.25
    # db-0 pulls (10 s) and starts (2 s); the others only start, the image being cached.
    assert list(created.values()) == [0.0, 12.0, 14.0]
    await until(cluster, lambda: all(ready for _, ready, _ in bg_pods(cluster).values()))

    await at(cluster, 30)
    assert cluster.evict(expected[1], namespace=BG) is EvictionVerdict.ALLOWED
    back = await until(
        cluster, lambda: bg_pods(cluster).get(expected[1], (None, True, True))[2] is False
    )
    assert back == 31  # recreated once the old pod is gone (SIGTERM, 1 s)
    recreated = await cluster.background_api.get_pod(expected[1])
    assert recreated is not None and recreated.created_at == EPOCH + 31
    assert cluster.workload_pods(workload) == expected


async def test_bare_pods_are_not_recreated(make_cluster: MakeCluster) -> None:
    """Without a controller an evicted pod is demand destroyed for good."""
    cluster = await make_cluster(node_pools=(pool(initial_nodes={"m5.xlarge": 1}),))
    workload = cluster.start_workload(WEB, replicas=2, bare=True)
    await until(cluster, lambda: sum(ready for _, ready, _ in bg_pods(cluster).values()) == 2)
    victim = cluster.workload_pods(workload)[0]
    cluster.evict(victim, namespace=BG)
    await asyncio.sleep(60)
    assert cluster.workload_pods(workload) == [name for name in bg_pods(cluster) if name != victim]
    assert len(cluster.workload_pods(workload)) == 1
    assert cluster.snapshot().background.pods_destroyed == 1


async def test_consolidation_conserves_controller_demand_but_destroys_bare_pods(
    make_cluster: MakeCluster,
) -> None:
    """The reclaim cascade in miniature: the same scale-down with and without controllers.

    A pre-bound background of 60 cores in small workloads drops to 30, leaving holes on
    every node; consolidation then packs what is left. With controllers every evicted
    pod comes back and live pods equal desired ones; with bare pods every eviction is
    demand lost for good.
    """
    small = dataclasses.replace(WEB, replicas=Buckets((Bucket(1, 1, 3),)), lifetime=Constant(1e9))
    outcomes = {}
    for bare in (False, True):
        cluster = await make_cluster(
            node_pools=(pool(instance_types=(XLARGE,), consolidate_after_s=0.0),),
            autoscaler=AutoscalerConfig(),
            background=BackgroundConfig(
                target=StepProfile(((0.0, 60.0), (300.0, 30.0))),
                archetypes=(small,),
                bare_pods=bare,
                prebind=True,
            ),
        )
        await asyncio.sleep(1800)
        snapshot = cluster.snapshot()
        outcomes[bare] = snapshot.background
        assert snapshot.evictions_total > 0
        assert snapshot.consolidated_underutilized_total > 0
    managed, lost = outcomes[False], outcomes[True]
    assert managed.live_pods == managed.desired_pods and managed.pods_destroyed == 0
    assert lost.pods_destroyed > 0
    assert lost.live_pods == lost.desired_pods - lost.pods_destroyed


async def test_the_background_follows_its_target(make_cluster: MakeCluster) -> None:
    """Right after each reconcile (every 60 s) demand meets a stepped target.

    A fill stops at the first workload that reaches the target, cut to what was lacking,
    so it overshoots by less than one pod of the largest shape (8 cores, cpu-batch).
    """
    cluster = await make_cluster(
        autoscaler=AutoscalerConfig(),
        background=BackgroundConfig(target=StepProfile(((0.0, 40.0), (1200.0, 80.0)))),
    )
    await at(cluster, 1080.25)
    first = cluster.snapshot()
    assert 40 <= first.background.desired_cpu < 40 + 8
    await at(cluster, 2400.25)
    second = cluster.snapshot()
    assert 80 <= second.background.desired_cpu < 80 + 8
    assert second.allocatable.cpu > first.allocatable.cpu  # the autoscaler followed
    await at(cluster, 2430.25)
    settled = cluster.snapshot().background
    assert settled.live_pods == settled.desired_pods  # all created within 30 s


# -- what the report reads -------------------------------------------------------------------


async def test_the_snapshot_accounts_nodes_pods_resources_and_cost(
    make_cluster: MakeCluster,
) -> None:
    """Counts by state, type and phase; requests by class and tracked label; node-hours."""
    cluster = await make_cluster(
        node_pools=(pool(initial_nodes={"m5.xlarge": 2}),), track_labels=("stoker.dev/state",)
    )
    await cluster.api.create_pod(pod("hot", labels={"stoker.dev/state": "hot"}))
    await cluster.api.create_pod(pod("warm", cpu="500m", labels={"stoker.dev/state": "warm"}))
    await cluster.api.create_pod(pod("huge", cpu="64"))
    await at(cluster, 5)
    early = cluster.snapshot()
    assert early.pods_by_phase == {"Pending": 3}
    assert (early.pods_starting, early.pods_unschedulable) == (2, 1)
    await at(cluster, 3600)
    snapshot = cluster.snapshot()
    assert snapshot.nodes_by_state == {"launching": 0, "ready": 2, "draining": 0, "terminated": 0}
    assert snapshot.nodes_by_instance_type == {"m5.xlarge": 2}
    assert snapshot.pods_by_phase == {"Running": 2, "Pending": 1}
    assert snapshot.pods_by_namespace == {"default": 3, "background": 0}
    assert snapshot.allocatable.cpu == 2 * 3.795
    assert snapshot.requested.cpu == 1.5 and snapshot.requested.pods == 2
    assert snapshot.requested_by_priority_class[WORKER].cpu == 1.5
    by_state = snapshot.requested_by_label["stoker.dev/state"]
    assert (by_state["hot"].cpu, by_state["warm"].cpu) == (1.0, 0.5)
    assert snapshot.node_cost_usd == pytest.approx(2 * 0.192)  # two nodes for one hour
    assert snapshot.node_cost_usd_per_hour == pytest.approx(2 * 0.192)

    await cluster.api.patch_pod("warm", labels={"stoker.dev/state": "hot"})
    assert cluster.snapshot().requested_by_label["stoker.dev/state"]["hot"].cpu == 1.5
    usage = {u.name: u for u in cluster.pod_usage()}
    assert (usage["hot"].cpu, usage["hot"].memory_bytes, usage["hot"].priority) == (
        1.0,
        1 << 30,
        10_000,
    )
    (node, _) = cluster.nodes()
    assert (node.requested.cpu, node.requested.pods) == (1.5, 2)
    assert json.loads(json.dumps(snapshot.as_dict()))["requested"]["cpu"] == 1.5


# -- the API server and its faults -----------------------------------------------------------


async def test_a_client_waits_for_tokens_and_pays_its_latency(make_cluster: MakeCluster) -> None:
    """QPS 2 with a burst of 1: three calls at once end at 0.1, 0.6 and 1.1 s."""
    cluster = await make_cluster()
    client = cluster.client("slow", qps=2, burst=1, latency=Constant(0.1))
    start = cluster.now()
    done: list[float] = []

    async def call() -> None:
        await client.get_pod("nobody")
        done.append(cluster.now() - start)

    await asyncio.gather(call(), call(), call())
    assert done == pytest.approx([0.1, 0.6, 1.1])
    stats = cluster.snapshot().api["slow"]
    assert stats.calls == {"get_pod": 3}
    assert stats.throttled_calls == 2
    assert stats.throttle_wait_s == pytest.approx(1.5)


async def test_scheduled_faults_hit_their_client_and_window(make_cluster: MakeCluster) -> None:
    """Errors, a lease blip, a watch drop and an applied timeout, each in its window."""
    cluster = await make_cluster(
        faults=(
            FaultSpec(at=10, duration=10, kind=FaultKind.ERROR, client="a", op="create_pod"),
            FaultSpec(at=30, duration=10, kind=FaultKind.LEASE_BLIP, client="a"),
            FaultSpec(at=50, kind=FaultKind.WATCH_DROP, client="a"),
            FaultSpec(
                at=60, duration=5, kind=FaultKind.TIMEOUT, client="b", op="create_pod", applied=True
            ),
        )
    )
    a, b = cluster.client("a"), cluster.client("b")

    await at(cluster, 5)
    await a.create_pod(pod("a-5"))
    await at(cluster, 10)
    with pytest.raises(ClusterUnavailable) as error:
        await a.create_pod(pod("a-10"))
    assert error.value.status == 500
    await b.create_pod(pod("b-10"))
    await at(cluster, 19.5)
    with pytest.raises(ClusterUnavailable):
        await a.create_pod(pod("a-19"))
    await at(cluster, 20)
    await a.create_pod(pod("a-20"))

    await at(cluster, 25)
    lease = await a.create_lease(Lease(name="janitor", holder="a", duration_s=15))
    await at(cluster, 30)
    renewal = Lease(
        name="janitor", holder="a", duration_s=15, resource_version=lease.resource_version
    )
    with pytest.raises(ClusterUnavailable):
        await a.update_lease(renewal)
    assert (await a.get_lease("janitor")) == lease  # reads still work
    taken = await b.update_lease(
        Lease(name="janitor", holder="b", duration_s=15, resource_version=lease.resource_version)
    )
    await at(cluster, 40)
    with pytest.raises(Conflict):
        await a.update_lease(renewal)  # the blip is over; b took the lease meanwhile
    assert (await a.get_lease("janitor")) == taken

    await at(cluster, 45)
    listing = await a.list_pods({})
    watch_a = a.watch_pods({}, listing.resource_version)
    watch_b = b.watch_pods({}, listing.resource_version)
    await a.create_pod(pod("a-45"))
    assert (await anext(watch_a)).pod.name == "a-45"
    assert (await anext(watch_b)).pod.name == "a-45"
    await at(cluster, 50.25)
    # Dropped at 50: what was queued before (the scheduler marking a-45) drains, then
    # the stream ends.
    assert {event.pod.name async for event in watch_a} <= {"a-45"}
    await b.create_pod(pod("b-51"))
    async with asyncio.timeout(5):
        async for event in watch_b:
            if event.pod.name == "b-51":
                break
    await watch_b.aclose()

    await at(cluster, 60)
    with pytest.raises(ClusterUnavailable):
        await b.create_pod(pod("b-60"))
    assert cluster.now() == 70  # it hung for the timeout
    assert await b.get_pod("b-60") is not None  # ...but the server had created it
    with pytest.raises(Conflict):
        await b.create_pod(pod("b-60"))

    stats = cluster.snapshot().api
    assert (stats["a"].faults_injected, stats["b"].faults_injected) == (3, 1)


# -- determinism -----------------------------------------------------------------------------


def _run(seed: int) -> list[str]:
    """A busy hour (background churn, workers, consolidation) as JSON snapshots."""

    async def scenario() -> list[str]:
        cluster = SimCluster(
            SimClusterConfig(
                priority_classes={WORKER: 10_000, PLACEHOLDER: -10},
                background=BackgroundConfig(
                    target=StepProfile(((0.0, 120.0), (1800.0, 60.0))), churn_per_minute=0.02
                ),
            ),
            clock=LoopClock(epoch=EPOCH),
            rng=random.Random(seed),
        )
        await cluster.start()
        client = cluster.client("replica-a", qps=20, burst=40)
        snapshots = []
        for minute in range(60):
            for index in range(5):
                await client.create_pod(pod(f"w-{minute}-{index}", cpu="500m"))
            if minute >= 10:
                await client.delete_pod(f"w-{minute - 10}-0", grace_s=5)
            await asyncio.sleep(60 - cluster.now() % 60)
            snapshots.append(json.dumps(cluster.snapshot().as_dict(), sort_keys=True))
        await cluster.stop()
        return snapshots

    loop = looptime.new_event_loop(noop_cycles=1)
    try:
        return loop.run_until_complete(scenario())
    finally:
        loop.close()


@pytest.mark.looptime(False)
def test_the_same_seed_replays_the_same_history() -> None:
    """Byte-identical snapshots for one seed; another seed gives another history."""
    first, second, other = _run(11), _run(11), _run(12)
    assert first == second
    assert first != other
    last = json.loads(first[-1])
    assert last["binds_total"] > 300 and last["nodes_launched_total"] > 0
