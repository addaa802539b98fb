"""The Kubernetes timings the simulator assumes, measured on a real kube-apiserver.

    python benchmarks/kube_timings.py [--pods 60] [--burst 250] [--preemptions 5]
                                      [--renewals 50] [--lease-duration 15]

Starts the e2e tier's one-machine control plane (etcd 3.5.1, kube-apiserver and
kube-scheduler 1.20.2, three fake-kubelet nodes of 4 CPUs; `tests/e2e_kubernetes`,
binaries from `tests/e2e_kubernetes/cluster/build.sh`) and measures through stoker's own
ClusterAPI adapter (`LightkubeCluster`), with the ServiceAccount token of the manifests'
Role, what `stoker.sim` models:

- **create latency**: the answer time of `--pods` sequential pod creates (p50, p99, and
  the log-normal fit `median`, `sigma` the simulator's latency distributions take);
- **watch delay**: from a create's request to the ADDED event on a watch of the pods
  (and how often the event beats the create's answer);
- **scheduling latency**: from a create's answer to the event showing the pod bound,
  one pod at a time, and the bind rate of a burst of `--burst` creates (overall, and
  past kube-scheduler's client burst of 100);
- **preemption**: from a worker's create to its bind on the node a placeholder held
  (the scheduler deletes the placeholder first), placeholders at the manifests'
  PriorityClasses;
- **Lease**: the answer time of `--renewals` renewals (stoker's compare-and-set update)
  and the takeover time of a second contender after the holder stops renewing, with
  `--lease-duration` and client-go's 2 s retry period.

A loopback API server with nothing else to do answers faster than a cluster's does;
the figures are a floor, which is what `stoker.sim`'s defaults cite them for. The fake
kubelet marks pause pods Ready at once, so no start-up time is measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "e2e_kubernetes"))

from kube_control_plane import ControlPlane, binaries, build  # noqa: E402

from stoker.adapters.cluster_lightkube import LightkubeCluster  # noqa: E402
from stoker.adapters.elector_k8s import KubernetesLeaseBackend  # noqa: E402
from stoker.ports.clock import LoopClock  # noqa: E402
from stoker.ports.cluster import Container, Pod, PodSpec, WatchEventType  # noqa: E402

NAMESPACE = "stoker"


def percentile(values: Sequence[float], share: float) -> float:
    """The `share` quantile (nearest rank) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


def lognormal_fit(values: Sequence[float]) -> tuple[float, float]:
    """The median and sigma of the log-normal with the same mean and spread of logs."""
    logs = [math.log(max(v, 1e-6)) for v in values]
    return math.exp(statistics.fmean(logs)), statistics.pstdev(logs)


def report(name: str, values: Sequence[float], unit: float = 1000.0, suffix: str = "ms") -> None:
    """One line: count, p50, p90, p99, max and the log-normal fit."""
    median, sigma = lognormal_fit(values)
    print(
        f"{name:<34} n={len(values):<4} p50={percentile(values, 0.5) * unit:7.1f}{suffix} "
        f"p90={percentile(values, 0.9) * unit:7.1f}{suffix} "
        f"p99={percentile(values, 0.99) * unit:7.1f}{suffix} "
        f"max={max(values) * unit:7.1f}{suffix}  "
        f"lognormal(median={median * unit:.1f}{suffix}, sigma={sigma:.2f})"
    )


def pod(name: str, run: str, *, cpu: str = "100m", priority: str | None = None) -> Pod:
    """A pause pod (the fake kubelet runs nothing for it) labelled with its run."""
    return Pod(
        name=name,
        labels={"e2e.stoker.dev/timings": run},
        spec=PodSpec(
            containers=(
                Container(name="pause", image="registry.k8s.io/pause:3.10", cpu=cpu, memory="16Mi"),
            ),
            priority_class_name=priority,
            termination_grace_period_s=0,
        ),
    )


class Observer:
    """A watch of one run's pods: when each was first seen, and first seen bound."""

    def __init__(self, cluster: LightkubeCluster, run: str) -> None:
        self.cluster = cluster
        self.selector = {"e2e.stoker.dev/timings": run}
        self.added: dict[str, float] = {}
        self.bound: dict[str, float] = {}
        self.deleted: dict[str, float] = {}
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        listing = await self.cluster.list_pods(self.selector)
        self.task = asyncio.create_task(self._watch(listing.resource_version))

    async def _watch(self, version: str) -> None:
        async for event in self.cluster.watch_pods(self.selector, version):
            at = time.perf_counter()
            name = event.pod.name
            if event.type == WatchEventType.DELETED:
                self.deleted.setdefault(name, at)
                continue
            self.added.setdefault(name, at)
            if event.pod.node_name:
                self.bound.setdefault(name, at)

    async def until(self, names: Sequence[str], table: dict[str, float], timeout: float) -> None:
        deadline = time.perf_counter() + timeout
        while any(n not in table for n in names):
            if time.perf_counter() > deadline:
                missing = [n for n in names if n not in table]
                raise SystemExit(f"not seen within {timeout}s: {missing[:5]}")
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()


async def delete_run(cluster: LightkubeCluster, names: Sequence[str]) -> None:
    await asyncio.gather(*(cluster.delete_pod(name, 0) for name in names))


async def creates_and_watch(cluster: LightkubeCluster, count: int) -> None:
    """Sequential creates: answer time, watch delay and scheduling latency of each."""
    run = uuid.uuid4().hex[:8]
    observer = Observer(cluster, run)
    await observer.start()
    answers: list[float] = []
    answered: dict[str, float] = {}
    sent_at: dict[str, float] = {}
    names = []
    for index in range(count):
        name = f"timing-{run}-{index}"
        sent = sent_at[name] = time.perf_counter()
        await cluster.create_pod(pod(name, run))
        answered[name] = time.perf_counter()
        answers.append(answered[name] - sent)
        names.append(name)
        await observer.until([name], observer.bound, 30)
    report("pod create (answer)", answers)
    # The write commits during the create; its event and its answer race back.
    report("watch delay (create sent to ADDED)", [observer.added[n] - sent_at[n] for n in names])
    early = sum(1 for n in names if observer.added[n] < answered[n])
    print(f"{'':<34} ADDED before the create's answer for {early} of {len(names)} pods")
    report("scheduling (answer to bound event)", [observer.bound[n] - answered[n] for n in names])
    await observer.close()
    await delete_run(cluster, names)


async def burst(cluster: LightkubeCluster, count: int) -> None:
    """`count` creates at once: how fast the scheduler binds them."""
    run = uuid.uuid4().hex[:8]
    observer = Observer(cluster, run)
    await observer.start()
    names = [f"burst-{run}-{index}" for index in range(count)]
    started = time.perf_counter()
    await asyncio.gather(*(cluster.create_pod(pod(name, run, cpu="10m")) for name in names))
    created = time.perf_counter()
    await observer.until(names, observer.bound, 120)
    binds = sorted(observer.bound[n] for n in names)
    span = binds[-1] - binds[0]
    # kube-scheduler's client budget (QPS 50, burst 100) paces its Binding calls: such a
    # bucket binds the first 100 at once and the rest at 50/s (or as they arrive).
    budget_s = max(created - started, (count - 100) / 50)
    print(
        f"{'burst of ' + str(count) + ' creates':<34} created in {created - started:.2f}s, "
        f"all bound {binds[-1] - started:.2f}s after the first create "
        f"({(count - 1) / span if span > 0 else float('inf'):.0f} binds/s); "
        f"a QPS 50 / burst 100 client needs {budget_s:.2f}s"
    )
    await observer.close()
    await delete_run(cluster, names)


async def preemption(cluster: LightkubeCluster, rounds: int) -> None:
    """A worker needing a placeholder's room: create to bind, victim deletion included."""
    delays: list[float] = []
    for _ in range(rounds):
        run = uuid.uuid4().hex[:8]
        observer = Observer(cluster, run)
        await observer.start()
        # One placeholder of 3.5 CPUs per node: no 1-CPU worker fits anywhere.
        holders = [f"holder-{run}-{i}" for i in range(3)]
        await asyncio.gather(
            *(
                cluster.create_pod(pod(n, run, cpu="3500m", priority="stoker-placeholder"))
                for n in holders
            )
        )
        await observer.until(holders, observer.bound, 30)
        worker = f"worker-{run}"
        sent = time.perf_counter()
        await cluster.create_pod(pod(worker, run, cpu="1", priority="stoker-worker"))
        await observer.until([worker], observer.bound, 60)
        delays.append(observer.bound[worker] - sent)
        await observer.close()
        await delete_run(cluster, [*holders, worker])
        await asyncio.sleep(0.5)
    report("preemption (create to bound)", delays)


async def lease_timings(cluster: LightkubeCluster, renewals: int, duration_s: float) -> None:
    """Renewal answer times, and a takeover after the holder stops renewing."""
    name = f"timings-{uuid.uuid4().hex[:8]}"
    holder = KubernetesLeaseBackend(cluster, name)
    other = KubernetesLeaseBackend(cluster, name)
    wall = time.time
    assert await holder.try_acquire("a", wall(), duration_s) is not None
    answers = []
    for _ in range(renewals):
        sent = time.perf_counter()
        assert await holder.try_acquire("a", wall(), duration_s) is not None
        answers.append(time.perf_counter() - sent)
    report("Lease renewal (answer)", answers)
    # The holder dies right after its last renewal; the other retries every 2 s.
    last_renewal = time.perf_counter()
    retry_s = 2.0
    while await other.try_acquire("b", wall(), duration_s) is None:
        await asyncio.sleep(retry_s)
    takeover = time.perf_counter() - last_renewal
    print(
        f"{'Lease takeover':<34} {takeover:.2f}s after the last renewal "
        f"(duration {duration_s:g}s, retry {retry_s:g}s: "
        f"{takeover - duration_s:+.2f}s beyond the duration)"
    )


async def measure(plane: ControlPlane, args: argparse.Namespace) -> None:
    clock = LoopClock()
    cluster = LightkubeCluster(
        namespace=NAMESPACE,
        clock=clock,
        qps=10_000,
        burst=10_000,
        kubeconfig=str(plane.workdir / "kubeconfig-stoker"),
    )
    try:
        # Warm the connection and the API server's caches.
        await cluster.list_pods({})
        await creates_and_watch(cluster, args.pods)
        await burst(cluster, args.burst)
        await preemption(cluster, args.preemptions)
        await lease_timings(cluster, args.renewals, args.lease_duration)
    finally:
        await cluster.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=60)
    parser.add_argument("--burst", type=int, default=250)
    parser.add_argument("--preemptions", type=int, default=5)
    parser.add_argument("--renewals", type=int, default=50)
    parser.add_argument("--lease-duration", type=float, default=15.0)
    args = parser.parse_args()
    bins = binaries() or build()
    with tempfile.TemporaryDirectory(prefix="kube-timings-") as workdir:
        plane = ControlPlane(Path(workdir), bins)
        started = time.perf_counter()
        plane.start()
        print(f"control plane up in {time.perf_counter() - started:.1f}s ({plane.url})")
        try:
            asyncio.run(measure(plane, args))
        finally:
            plane.stop()


if __name__ == "__main__":
    main()
