"""Scale smoke benchmark of the simulated cluster on a virtual-time loop.

    python benchmarks/sim_cluster.py [--nodes 2500] [--workers 10000] [--hours 2]
                                     [--diurnal] [--seed 1] [--noop-cycles 1] [--profile]

Builds a cluster whose background (bigfleet's CPU archetypes, pre-bound at start) fills
about `--nodes` m5.4xlarge nodes, then creates `--workers` worker-like pods (1 core,
2 GiB) through a client view at QPS 200, plus 40 node-sized placeholders, and runs
`--hours` of simulated time. A stand-in for the runtime keeps the workers busy: every
minute 1 % of them are retired (deleted with 30 s grace) and replaced, and 5 % flip
their `karpenter.sh/do-not-disrupt` annotation; two informers watch the workers. The
autoscaler provisions and consolidates throughout. With `--diurnal` the background
follows a day (half of `--nodes` at the 02:00 trough, all of it at the 14:00 peak)
instead of staying constant.

Prints the wall time, the virtual speed-up, and the cluster at the end. `--noop-cycles`
is looptime's no-op cycles per time jump (its default is 42; 1 is enough for a loop
that does no I/O). `--profile` wraps the run in pyinstrument.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Iterable

import looptime

from stoker.ports.clock import LoopClock
from stoker.ports.cluster import Container, Pod, PodSpec
from stoker.sim.cluster import ClusterSnapshot, SimCluster
from stoker.sim.cluster.autoscaler import AutoscalerConfig
from stoker.sim.cluster.config import SimClusterConfig
from stoker.sim.cluster.model import DO_NOT_DISRUPT
from stoker.sim.cluster.resources import INSTANCE_TYPES_BY_NAME
from stoker.sim.cluster.specs import NodePoolConfig
from stoker.sim.cluster.workloads import (
    BackgroundConfig,
    ConstantProfile,
    DemandProfile,
    DiurnalProfile,
)

WORKERS = {"stoker.dev/fleet": "bench"}
NODE = INSTANCE_TYPES_BY_NAME["m5.4xlarge"]


def worker(name: str) -> Pod:
    """A worker pod as the Kubernetes runtime creates one."""
    return Pod(
        name=name,
        labels={**WORKERS, "stoker.dev/pool": "duck"},
        spec=PodSpec(
            containers=(
                Container(name="worker", image="ghcr.io/example/worker:1", cpu="1", memory="2Gi"),
            ),
            priority_class_name="stoker-worker",
            termination_grace_period_s=30,
        ),
    )


def placeholder(name: str) -> Pod:
    """A node-sized headroom placeholder."""
    return Pod(
        name=name,
        labels={**WORKERS, "stoker.dev/placeholder": "duck"},
        spec=PodSpec(
            containers=(
                Container(name="pause", image="registry.k8s.io/pause:3.9", cpu="14", memory="48Gi"),
            ),
            priority_class_name="stoker-placeholder",
            termination_grace_period_s=0,
        ),
    )


async def informer(cluster: SimCluster, name: str) -> int:
    """List then watch the workers, resuming after drops, as the runtime does; counts events."""
    client = cluster.client(name, qps=50, burst=100)
    events = 0
    listing = await client.list_pods(WORKERS)
    version = listing.resource_version
    while True:
        async for event in client.watch_pods(WORKERS, version):
            events += 1
            version = event.pod.resource_version
        await asyncio.sleep(1)


async def churn(cluster: SimCluster, workers: list[str], rng: random.Random) -> None:
    """Retire 1 % of the workers and flip 5 % of the do-not-disrupt pins every minute."""
    client = cluster.client("replica-b", qps=200, burst=400)
    serial = len(workers)
    pinned: set[str] = set()
    while True:
        await asyncio.sleep(60)
        for index in rng.sample(range(len(workers)), k=len(workers) // 100):
            await client.delete_pod(workers[index], grace_s=30)
            pinned.discard(workers[index])
            serial += 1
            workers[index] = f"w-{serial}"
            await client.create_pod(worker(workers[index]))
        for index in rng.sample(range(len(workers)), k=len(workers) // 20):
            name = workers[index]
            value = None if name in pinned else "true"
            (pinned.discard if value is None else pinned.add)(name)
            try:
                await client.patch_pod(name, annotations={DO_NOT_DISRUPT: value})
            except Exception:  # evicted by consolidation meanwhile: the runtime would see it
                pinned.discard(name)


def line(snapshot: ClusterSnapshot) -> str:
    nodes = snapshot.nodes_by_state
    return (
        f"t={snapshot.t / 60:6.1f} min  nodes ready={nodes['ready']:5d} "
        f"launching={nodes['launching']:4d} draining={nodes['draining']:3d}  "
        f"pods={sum(snapshot.pods_by_phase.values()):6d} unsched={snapshot.pods_unschedulable:5d}  "
        f"cpu req/alloc={snapshot.requested.cpu:8.0f}/{snapshot.allocatable.cpu:8.0f}"
    )


async def scenario(args: argparse.Namespace) -> tuple[ClusterSnapshot, list[str], float]:
    node_cores = NODE.allocatable().cpu_m / 1000
    peak = args.nodes * node_cores * 0.9
    target: DemandProfile = (
        DiurnalProfile(low=peak / 2, high=peak) if args.diurnal else ConstantProfile(peak)
    )
    config = SimClusterConfig(
        priority_classes={"stoker-worker": 100, "stoker-placeholder": -10},
        node_pools=(
            NodePoolConfig(
                instance_types=(INSTANCE_TYPES_BY_NAME["m5.2xlarge"], NODE),
            ),
        ),
        autoscaler=AutoscalerConfig(),
        background=BackgroundConfig(target=target, prebind=True),
        track_labels=("stoker.dev/pool",),
    )
    cluster = SimCluster(
        config, clock=LoopClock(epoch=1_700_000_000.0), rng=random.Random(args.seed)
    )
    build = time.perf_counter()
    await cluster.start()
    await asyncio.sleep(0)
    seeded = time.perf_counter() - build
    log = [f"seeded background in {seeded:.1f} s wall: " + line(cluster.snapshot())]
    client = cluster.client("replica-a", qps=200, burst=400)
    tasks = [asyncio.create_task(informer(cluster, f"informer-{i}")) for i in range(2)]
    names = [f"w-{index}" for index in range(args.workers)]
    for index in range(40):
        await client.create_pod(placeholder(f"ph-{index}"))
    for name in names:
        await client.create_pod(worker(name))
    tasks.append(asyncio.create_task(churn(cluster, names, random.Random(args.seed + 1))))
    horizon = args.hours * 3600
    while cluster.now() < horizon:
        await asyncio.sleep(min(1800.0 if horizon <= 7200 else 7200.0, horizon - cluster.now()))
        log.append(line(cluster.snapshot()))
    final = cluster.snapshot()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await cluster.stop()
    return final, log, horizon


def report(
    final: ClusterSnapshot, log: Iterable[str], horizon: float, wall: float, cpu: float
) -> None:
    for entry in log:
        print(entry)
    print()
    print(
        f"simulated {horizon / 3600:.1f} h in {wall:.1f} s wall ({cpu:.1f} s CPU): "
        f"speed-up x{horizon / wall:,.0f} (x{horizon / cpu:,.0f} per CPU second)"
    )
    print(
        f"nodes launched/terminated: {final.nodes_launched_total}/{final.nodes_terminated_total}"
        f"  by type: {dict(final.nodes_by_instance_type)}  cost ${final.node_cost_usd:,.0f}"
    )
    print(
        f"pods: {dict(final.pods_by_phase)} binds={final.binds_total} "
        f"preemptions={final.preemptions_total} evictions={final.evictions_total} "
        f"refused={final.eviction_refusals_total} pulls={final.image_pulls_total}"
    )
    bg = final.background
    print(
        f"background: {bg.workloads_active} workloads, {bg.live_pods}/{bg.desired_pods} pods "
        f"live/desired, {bg.pods_replaced} replaced, {bg.workloads_ended} workloads ended"
    )
    for name, stats in sorted(final.api.items()):
        print(
            f"client {name}: {sum(stats.calls.values())} calls, "
            f"{stats.throttled_calls} throttled ({stats.throttle_wait_s:.0f} s waiting)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2500)
    parser.add_argument("--workers", type=int, default=10_000)
    parser.add_argument("--hours", type=float, default=2.0)
    parser.add_argument("--diurnal", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--noop-cycles", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    loop = looptime.new_event_loop(noop_cycles=args.noop_cycles)
    profiler = None
    if args.profile:
        from pyinstrument import Profiler

        profiler = Profiler(async_mode="disabled")
        profiler.start()
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        final, log, horizon = loop.run_until_complete(scenario(args))
    finally:
        loop.close()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    if profiler is not None:
        profiler.stop()
        print(profiler.output_text(unicode=False, color=False, show_all=False))
    report(final, log, horizon, wall, cpu)


if __name__ == "__main__":
    main()
