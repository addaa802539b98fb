"""Kubernetes-runtime figures against the in-process fake cluster (no cluster runs here).

    python benchmarks/kubernetes_runtime.py [--pods 1000] [--cache-pods 10000]

Prints:
  1. pods created per second through the real spawn path (janitor -> pool manager -> core
     token bucket -> KubernetesRuntime.spawn -> cluster) with a client budget of 50 and
     100 QPS (burst = 2 x QPS, client-go's ratio). The budget is modelled by wrapping the
     fake cluster with the lightkube adapter's own `TokenBucket` (the token bucket every
     request of `LightkubeCluster` takes a token from), on a virtual-time loop: the fake
     answers instantly, so the budget is the only limit and the figure shows whether the
     runtime reaches it. The core engine's spawn bucket is sized from the same budget, as
     the deployment does (`intervals.spawn_rate/spawn_burst` = `runtime.qps/burst`).
     Expected: the steady rate equals the QPS; the first `burst` pods go out at once.
  2. the informer's cache memory per 10,000 pods (tracemalloc: what the runtime retains
     after its first list). The pods are copied through pickle on their way out of the
     fake, as a real client decodes fresh objects (strings included) from JSON, so nothing
     is shared with the fake's own objects and the figure is what a replica holds for a
     fleet of that size.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import pickle
import tempfile
import time
import tracemalloc
from collections.abc import AsyncGenerator, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import looptime

from stoker.adapters.runtime_kubernetes import KubernetesRuntime
from stoker.adapters.sqlite import SqliteStore
from stoker.control.plane import ControlPlane
from stoker.domain.activation import ActivationKey
from stoker.domain.records import Worker
from stoker.domain.specs import PlaneSettings, PodTemplate, PoolSpec
from stoker.domain.states import WorkerState
from stoker.ports.activator import ActivationPayload
from stoker.ports.clock import LoopClock, TokenBucket
from stoker.ports.cluster import Lease, Pod, PodList, PodPhase, Selector, WatchEvent
from stoker.sim.cluster import FakeApiServer

T = TypeVar("T")

TEMPLATE = PodTemplate(
    image="ghcr.io/example/worker:1",
    command=("/usr/bin/worker",),
    args=("--port", "{port}", "--worker-id", "{worker_id}"),
    env={"MODE": "pooled", "LOG_LEVEL": "info"},
    cpu="2",
    memory="4Gi",
    port=8080,
    node_selector={"stoker.dev/nodes": "workers"},
    priority_class="stoker-worker",
    service_account="stoker-worker",
)

#: Pods carry a derived activation secret as real ones do.
KEY = ActivationKey(b"stoker-benchmark-fleet-activation-key")


class NoActivation:
    """An activator for pools whose claims are not measured here."""

    async def activate(self, worker: Worker, payload: ActivationPayload, timeout: float) -> None:
        return None

    async def close(self) -> None:
        return None


class BudgetedCluster:
    """The fake cluster behind a client-side request budget, as `LightkubeCluster` is:
    every request takes one token first (a watch takes one per opening)."""

    def __init__(self, server: FakeApiServer, budget: TokenBucket, *, decode: bool) -> None:
        self.server = server
        self.budget = budget
        self.decode = decode
        #: Loop time at which each pod creation was answered.
        self.created_at: list[float] = []

    @property
    def namespace(self) -> str:
        return self.server.namespace

    def _fresh(self, pod: Pod) -> Pod:
        # A real client decodes every answer into new objects, strings included (a deep
        # copy would share the strings with the fake and hide their cost).
        return pickle.loads(pickle.dumps(pod)) if self.decode else pod

    async def create_pod(self, pod: Pod) -> Pod:
        await self.budget.acquire()
        created = await self.server.create_pod(pod)
        self.created_at.append(asyncio.get_running_loop().time())
        return created

    async def delete_pod(self, name: str, grace_s: float | None = None) -> None:
        await self.budget.acquire()
        await self.server.delete_pod(name, grace_s)

    async def patch_pod(
        self,
        name: str,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> Pod:
        await self.budget.acquire()
        return await self.server.patch_pod(name, labels, annotations)

    async def get_pod(self, name: str) -> Pod | None:
        await self.budget.acquire()
        return await self.server.get_pod(name)

    async def list_pods(self, selector: Selector) -> PodList:
        await self.budget.acquire()
        listing = await self.server.list_pods(selector)
        return PodList(tuple(self._fresh(p) for p in listing.items), listing.resource_version)

    async def watch_pods(
        self, selector: Selector, resource_version: str
    ) -> AsyncGenerator[WatchEvent, None]:
        await self.budget.acquire()
        watch = self.server.watch_pods(selector, resource_version)
        try:
            async for event in watch:
                yield WatchEvent(event.type, self._fresh(event.pod))
        finally:
            await watch.aclose()

    async def get_lease(self, name: str) -> Lease | None:
        await self.budget.acquire()
        return await self.server.get_lease(name)

    async def create_lease(self, lease: Lease) -> Lease:
        await self.budget.acquire()
        return await self.server.create_lease(lease)

    async def update_lease(self, lease: Lease) -> Lease:
        await self.budget.acquire()
        return await self.server.update_lease(lease)

    async def close(self) -> None:
        await self.server.close()


async def creation_rate(qps: int, pods: int, db: Path) -> tuple[float, float, float, float]:
    """(overall pods/s, steady pods/s after the burst, virtual s, wall s) for one budget."""
    burst = 2 * qps
    clock = LoopClock(epoch=1_700_000_000.0)
    server = FakeApiServer(clock=clock, namespace="stoker", history_size=4 * pods)
    cluster = BudgetedCluster(server, TokenBucket(clock, rate=qps, burst=burst), decode=False)
    runtime = KubernetesRuntime(
        cluster=cluster,
        clock=clock,
        fleet="bench",
        activation_key=KEY,
        instance_id="cp-bench",
    )
    plane = ControlPlane(
        store=SqliteStore(str(db)),
        runtime=runtime,
        activator=NoActivation(),
        pools=[PoolSpec(name="duck", template=TEMPLATE, warm_target=pods)],
        settings=PlaneSettings(
            spawn_rate=qps, spawn_burst=burst, janitor_interval_s=3600, reaper_interval_s=3600
        ),
        clock=clock,
        instance_id="cp-bench",
    )
    loop = asyncio.get_running_loop()
    wall, start = time.perf_counter(), loop.time()
    await plane.start(loops=False)  # its first janitor pass spawns the whole warm target
    while len(cluster.created_at) < pods:
        await asyncio.sleep(0.5)
    wall = time.perf_counter() - wall
    times = sorted(cluster.created_at)
    elapsed = times[-1] - start
    overall = pods / elapsed
    # After the saved-up burst is spent, the rate is the budget's refill rate.
    steady = (pods - burst - 1) / (times[-1] - times[burst])
    await plane.stop()
    await server.close()
    return overall, steady, elapsed, wall


async def cache_memory(pods: int) -> tuple[float, float]:
    """Bytes per pod retained by the informer after its first list, and, for comparison,
    by the decoded list itself (what caching whole `Pod` objects would hold)."""
    clock = LoopClock(epoch=1_700_000_000.0)
    server = FakeApiServer(clock=clock, namespace="stoker", history_size=4 * pods)
    pool = PoolSpec(name="duck", template=TEMPLATE)
    creator = KubernetesRuntime(
        cluster=server, clock=clock, fleet="bench", instance_id="cp-a", activation_key=KEY
    )
    for index in range(pods):
        worker = Worker(
            id=f"w-{index:012x}",
            pool="duck",
            revision=pool.revision,
            state=WorkerState.SPAWNING,
            epoch=0,
            owner="cp-a",
            created_at=0.0,
            updated_at=0.0,
        )
        await creator.spawn(worker, pool)
        server.set_pod_status(
            worker.id,
            node_name=f"node-{index % 500}",
            phase=PodPhase.RUNNING,
            ready=True,
            pod_ip=f"10.{index // 65536}.{index // 256 % 256}.{index % 256}",
        )
    # Unlimited budget: this figure is about memory, not pacing.
    budget = TokenBucket(clock, rate=1e9, burst=1_000_000)
    cluster = BudgetedCluster(server, budget, decode=True)
    runtime = KubernetesRuntime(
        cluster=cluster, clock=clock, fleet="bench", instance_id="cp-b", activation_key=KEY
    )

    class Quiet:
        def worker_ready(self, worker_id: str, endpoint: str) -> None:
            return None

        def worker_lost(self, worker_id: str, reason: str) -> None:
            return None

    runtime.subscribe(Quiet())
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    await runtime.start()
    objects = await runtime.list_objects()  # waits for the first list
    assert len(objects) == pods
    del objects
    await asyncio.sleep(1)
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    retained = sum(stat.size_diff for stat in after.compare_to(before, "filename"))

    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    listing = await cluster.list_pods({"stoker.dev/fleet": "bench"})
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    whole = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert len(listing.items) == pods
    del listing

    await runtime.close()
    await server.close()
    return retained / pods, whole / pods


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on a fresh virtual-time loop (looptime): sleeps take no wall time."""
    loop = looptime.new_event_loop(start=0)
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=1000, help="pods to create per budget")
    parser.add_argument("--cache-pods", type=int, default=10_000, help="pods in the cache")
    args = parser.parse_args()

    print(f"1. pod creation through the runtime, {args.pods} pods, virtual time")
    print("   budget   burst   overall pods/s   steady pods/s   virtual s   wall s")
    with tempfile.TemporaryDirectory() as tmp:
        for qps in (50, 100):
            overall, steady, elapsed, wall = run(
                creation_rate(qps, args.pods, Path(tmp) / f"bench-{qps}.db")
            )
            print(
                f"   {qps:>3} QPS  {2 * qps:>5}   {overall:>14.1f}   {steady:>13.1f}"
                f"   {elapsed:>9.1f}   {wall:>6.2f}"
            )
    per_pod, whole = run(cache_memory(args.cache_pods))
    print(f"2. informer cache, measured with {args.cache_pods:,} running worker pods")
    print(f"   {per_pod:,.0f} bytes per pod = {per_pod * 10_000 / 2**20:.1f} MiB per 10,000 pods")
    print(
        f"   (whole decoded Pod objects: {whole:,.0f} bytes per pod = "
        f"{whole * 10_000 / 2**20:.1f} MiB per 10,000 pods)"
    )


if __name__ == "__main__":
    main()
