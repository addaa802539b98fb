"""The Kubernetes runtime on the in-process fake cluster, on virtual time (looptime).

No Kubernetes cluster can run where these tests run: `FakeApiServer` stands in for one
(resourceVersions, watch history, graceful deletion, eviction), and a small test-side
`Kubelet` plays scheduler and kubelet, driving pod status through the fake's cluster-side
helpers as a real kubelet would. The runtime is tested alone (its events, the pods it
writes) and inside a real control plane with the SQLite store (pods becoming warm workers,
eviction and replacement, do-not-disrupt, a restart that adopts).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import pytest
from looptime import LoopTimeProxy

from fakes import TEST_ACTIVATION_KEY
from runtime_contract import Recorder, RuntimeContract
from stoker.adapters.runtime_kubernetes import (
    DO_NOT_DISRUPT,
    LABEL_FLEET,
    LABEL_INSTANCE,
    LABEL_PLACEHOLDER,
    LABEL_POOL,
    LABEL_REVISION,
    LABEL_WORKER_ID,
    KubernetesRuntime,
)
from stoker.adapters.sqlite import SqliteStore
from stoker.control.plane import ControlPlane
from stoker.domain.errors import ActivationRejected, RuntimeFailure
from stoker.domain.records import ClaimRequest, Worker
from stoker.domain.specs import (
    DemandSpec,
    PlaneSettings,
    PodTemplate,
    PoolSpec,
    ProcessTemplate,
    Timeouts,
)
from stoker.domain.states import ClaimState, WorkerState
from stoker.ports.activator import ActivationPayload
from stoker.ports.clock import LoopClock
from stoker.ports.cluster import (
    ClusterUnavailable,
    Condition,
    Container,
    Forbidden,
    Invalid,
    ObjectNotFound,
    Pod,
    PodList,
    PodPhase,
    PodSpec,
    PreferredNodes,
    Selector,
    Terminated,
    Waiting,
    WatchEvent,
    WatchEventType,
)
from stoker.ports.runtime import Runtime, SpawnProgress
from stoker.sim.cluster import FakeApiServer
from stoker.worker import SECRET_ENV

pytestmark = pytest.mark.looptime

S = WorkerState
EPOCH = 1_700_000_000.0
FLEET = "fleet-a"
NAMESPACE = "stoker"

TEMPLATE = PodTemplate(
    image="ghcr.io/example/worker:1",
    command=("/usr/bin/worker",),
    args=("--port", "{port}", "--worker-id", "{worker_id}"),
    env={"MODE": "pooled", "SELF": "{worker_id}"},
    cpu="500m",
    memory="256Mi",
    port=8080,
    node_selector={"stoker.dev/nodes": "workers"},
    tolerations=({"key": "dedicated", "value": "workers", "effect": "NoSchedule"},),
    priority_class="stoker-worker",
    service_account="stoker-worker",
    labels={"team": "data"},
    annotations={"example.com/owner": "data", DO_NOT_DISRUPT: "true"},
)


def pool(**kw: Any) -> PoolSpec:
    base: dict[str, Any] = {
        "name": "duck",
        "template": TEMPLATE,
        "warm_target": 0,
        "timeouts": Timeouts(stop_grace_s=10),
    }
    base.update(kw)
    return PoolSpec(**base)


def worker(worker_id: str, spec: PoolSpec | None = None, **kw: Any) -> Worker:
    spec = spec or pool()
    base: dict[str, Any] = {
        "id": worker_id,
        "pool": spec.name,
        "revision": spec.revision,
        "state": S.SPAWNING,
        "epoch": 0,
        "owner": "cp-one",
        "created_at": EPOCH,
        "updated_at": EPOCH,
    }
    base.update(kw)
    return Worker(**base)


@dataclass
class Events:
    """A RuntimeListener that records what the runtime reported."""

    ready: list[tuple[str, str]] = field(default_factory=list)
    lost: list[tuple[str, str]] = field(default_factory=list)
    stalled: list[tuple[str, str, str]] = field(default_factory=list)
    #: Workers whose stopped pod left the cluster, and when.
    gone: list[tuple[str, float]] = field(default_factory=list)
    #: How each lost worker ended, as the runtime said (None: it did not say).
    details: dict[str, str | None] = field(default_factory=dict)

    def worker_ready(self, worker_id: str, endpoint: str) -> None:
        self.ready.append((worker_id, endpoint))

    def worker_lost(self, worker_id: str, reason: str, detail: str | None = None) -> None:
        self.lost.append((worker_id, reason))
        self.details[worker_id] = detail

    def worker_stalled(self, worker_id: str, stage: str, error: str) -> None:
        self.stalled.append((worker_id, stage, error))

    def worker_gone(self, worker_id: str, at: float) -> None:
        self.gone.append((worker_id, at))


class Kubelet:
    """Scheduler and kubelet in one: runs every new pod on a node `delay` seconds after it
    was created, by writing its status through the fake's cluster-side helper."""

    def __init__(self, server: FakeApiServer, *, delay: float = 1.0) -> None:
        self.server = server
        self.delay = delay
        self.started: list[str] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Kubelet:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        since = self.server.resource_version
        while True:  # a dropped watch is resumed, as a kubelet's would be
            watch = self.server.watch_pods({}, since)
            try:
                async for event in watch:
                    since = event.pod.resource_version
                    if event.type is WatchEventType.ADDED:
                        loop = asyncio.get_running_loop()
                        loop.call_later(self.delay, self.run_pod, event.pod.name)
            finally:
                await watch.aclose()
            await asyncio.sleep(0.1)

    def run_pod(self, name: str) -> None:
        index = len(self.started)
        try:
            self.server.set_pod_status(
                name,
                node_name=f"node-{index % 3}",
                phase=PodPhase.RUNNING,
                ready=True,
                pod_ip=f"10.0.{index // 200}.{index % 200 + 10}",
            )
        except ObjectNotFound:
            return  # deleted before it ran
        self.started.append(name)


def make_runtime(
    server: Any, *, instance_id: str = "cp-one", **kw: Any
) -> tuple[KubernetesRuntime, Events]:
    kw.setdefault("placeholder_priority_class", "stoker-placeholder")
    runtime = KubernetesRuntime(
        cluster=server,
        clock=LoopClock(epoch=EPOCH),
        fleet=FLEET,
        instance_id=instance_id,
        activation_key=TEST_ACTIVATION_KEY,
        **kw,
    )
    events = Events()
    runtime.subscribe(events)
    return runtime, events


@asynccontextmanager
async def started(runtime: KubernetesRuntime) -> AsyncIterator[KubernetesRuntime]:
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.close()


def server_for_test() -> FakeApiServer:
    return FakeApiServer(clock=LoopClock(epoch=EPOCH), namespace=NAMESPACE)


async def pod_of(server: FakeApiServer, name: str) -> Pod:
    pod = await server.get_pod(name)
    assert pod is not None, f"pod {name} does not exist"
    return pod


def run(server: FakeApiServer, name: str, ip: str = "10.1.2.3") -> Pod:
    """Make the pod Running, Ready and addressed, as scheduler and kubelet would."""
    return server.set_pod_status(
        name, node_name="node-a", phase=PodPhase.RUNNING, ready=True, pod_ip=ip
    )


# -- the worker pod ---------------------------------------------------------------------------


async def test_a_worker_pod_is_built_from_the_pool_template() -> None:
    """Labels, resources (requests = limits), placement, restartPolicy Never, the grace,
    and the worker's activation secret in its environment."""
    server = server_for_test()
    runtime, _ = make_runtime(server)
    spec = pool()
    ref = await runtime.spawn(worker("w-1", spec), spec)
    assert ref == {"pod": "w-1", "namespace": NAMESPACE, "port": 8080}

    pod = await pod_of(server, "w-1")
    assert pod.labels == {
        "team": "data",
        "app.kubernetes.io/managed-by": "stoker",
        LABEL_FLEET: FLEET,
        LABEL_POOL: "duck",
        LABEL_REVISION: spec.revision,
        LABEL_WORKER_ID: "w-1",
        LABEL_INSTANCE: "cp-one",
    }
    # The template cannot pin a neutral worker: do-not-disrupt is stoker's to set.
    assert pod.annotations == {"example.com/owner": "data"}
    (container,) = pod.spec.containers
    assert container == Container(
        name="worker",
        image="ghcr.io/example/worker:1",
        command=("/usr/bin/worker",),
        args=("--port", "8080", "--worker-id", "w-1"),
        env={
            "MODE": "pooled",
            "SELF": "w-1",
            "STOKER_WORKER_ID": "w-1",
            "STOKER_POOL": "duck",
            "STOKER_FLEET": FLEET,
            "STOKER_PORT": "8080",
            # Its own secret, derived from the fleet key; the key itself is not in the pod.
            SECRET_ENV: TEST_ACTIVATION_KEY.worker_secret("w-1"),
        },
        cpu="500m",
        memory="256Mi",
        ports=(8080,),
    )
    assert pod.spec.restart_policy == "Never"
    assert pod.spec.node_selector == {"stoker.dev/nodes": "workers"}
    (toleration,) = pod.spec.tolerations
    assert (toleration.key, toleration.operator, toleration.value, toleration.effect) == (
        "dedicated",
        "Equal",
        "workers",
        "NoSchedule",
    )
    assert pod.spec.priority_class_name == "stoker-worker"
    assert pod.spec.service_account_name == "stoker-worker"
    assert pod.spec.termination_grace_period_s == 10
    await server.close()


async def test_spawn_failures_are_runtime_failures() -> None:
    """No pod template, a name Kubernetes refuses, a refused create, a foreign pod."""
    server = server_for_test()
    runtime, _ = make_runtime(server)
    local = pool(template=ProcessTemplate(argv=("worker",)))
    with pytest.raises(RuntimeFailure, match="no pod template"):
        await runtime.spawn(worker("w-1", local), local)
    with pytest.raises(RuntimeFailure, match="not a valid Kubernetes label value"):
        await runtime.spawn(worker("w-1"), pool(name="ends-with-"))
    server.fail_next("create_pod", Invalid("spec.containers[0].image: Required value"))
    with pytest.raises(RuntimeFailure, match="Required value"):
        await runtime.spawn(worker("w-1"), pool())
    # Someone else's pod with the worker's name: never taken for ours.
    await server.create_pod(
        Pod(name="w-2", spec=PodSpec(containers=(Container(name="x", image="x"),)))
    )
    with pytest.raises(RuntimeFailure, match="not this worker's"):
        await runtime.spawn(worker("w-2"), pool())
    await server.close()


async def test_a_refused_create_says_why_without_the_pods_secrets() -> None:
    """The API server's words (a quota's, a field's) without the client's request prefix;
    an env value of the template, or the activation secret, quoted by an admission
    webhook is masked, and the cluster's error is not chained to the failure."""
    server = server_for_test()
    runtime, _ = make_runtime(server)
    spec = pool(template=replace(TEMPLATE, env={"DB_PASSWORD": "hunter2-secret", "N": "1"}))
    secret = TEST_ACTIVATION_KEY.worker_secret("w-1")
    server.fail_next(
        "create_pod",
        Forbidden(
            'create pod w-1: pods "w-1" is forbidden: webhook "policy" denied: '
            f"env DB_PASSWORD=hunter2-secret, {SECRET_ENV}={secret}, N=1"
        ),
    )
    with pytest.raises(RuntimeFailure) as caught:
        await runtime.spawn(worker("w-1", spec), spec)
    assert str(caught.value) == (
        'cannot create pod w-1: pods "w-1" is forbidden: webhook "policy" denied: '
        f"env DB_PASSWORD=***, {SECRET_ENV}=***, N=1"
    )
    assert caught.value.__cause__ is None
    await server.close()


async def test_a_create_that_already_succeeded_is_not_a_failure() -> None:
    """A create retried after a lost answer meets its own pod (409): the spawn succeeded."""
    server = server_for_test()
    runtime, _ = make_runtime(server)
    spec = pool()
    await runtime.spawn(worker("w-1", spec), spec)
    assert await runtime.spawn(worker("w-1", spec), spec) == {
        "pod": "w-1",
        "namespace": NAMESPACE,
        "port": 8080,
    }
    assert server.calls["create_pod"] == 2
    await server.close()


async def test_cluster_mode_is_unbounded() -> None:
    """max_workers 0 means no cap: the cluster bounds the fleet, not this machine."""
    runtime, _ = make_runtime(server_for_test())
    assert runtime.kind == "kubernetes"
    assert runtime.derived_cap(pool(max_workers=0)) == 0


async def test_fleet_and_instance_must_be_label_values() -> None:
    """They label every pod, so what Kubernetes would refuse is refused at construction."""
    with pytest.raises(ValueError, match="fleet"):
        KubernetesRuntime(
            cluster=server_for_test(),
            clock=LoopClock(),
            fleet="",
            instance_id="a",
            activation_key=TEST_ACTIVATION_KEY,
        )
    with pytest.raises(ValueError, match="instance_id"):
        KubernetesRuntime(
            cluster=server_for_test(),
            clock=LoopClock(),
            fleet="f",
            instance_id="x" * 64,
            activation_key=TEST_ACTIVATION_KEY,
        )


# -- readiness and loss -------------------------------------------------------------------------


async def test_ready_is_reported_once_when_running_ready_and_addressed() -> None:
    """Scheduled, Running, Ready without an IP: not yet; all three: once, never again."""
    server = server_for_test()
    runtime, events = make_runtime(server)
    async with started(runtime):
        spec = pool()
        await runtime.spawn(worker("w-1", spec), spec)
        server.set_pod_status("w-1", node_name="node-a")
        server.set_pod_status("w-1", phase=PodPhase.RUNNING)
        server.set_pod_status("w-1", ready=True)
        await asyncio.sleep(1)
        assert events.ready == []
        server.set_pod_status("w-1", pod_ip="10.1.2.3")
        await asyncio.sleep(1)
        assert events.ready == [("w-1", "http://10.1.2.3:8080")]
        await server.patch_pod("w-1", annotations={"a": "1"})
        server.set_pod_status("w-1", ready=False)
        server.set_pod_status("w-1", ready=True)
        await asyncio.sleep(1)
        assert events.ready == [("w-1", "http://10.1.2.3:8080")]
        assert events.lost == []
    await server.close()


async def test_an_ipv6_endpoint_is_bracketed() -> None:
    """http://[fd00::1]:8080, not an unparsable http://fd00::1:8080."""
    server = server_for_test()
    runtime, events = make_runtime(server)
    async with started(runtime):
        spec = pool()
        await runtime.spawn(worker("w-1", spec), spec)
        run(server, "w-1", ip="fd00::1")
        await asyncio.sleep(1)
    assert events.ready == [("w-1", "http://[fd00::1]:8080")]
    await server.close()


async def test_ready_pods_found_by_the_first_list_are_reported() -> None:
    """A replica that starts later reports every ready pod once (the pool manager ignores
    the ones it does not own) and reports a pod that finished meanwhile as lost."""
    server = server_for_test()
    creator, _ = make_runtime(server)
    spec = pool()
    for name in ("w-1", "w-2", "w-3"):
        await creator.spawn(worker(name, spec), spec)
    run(server, "w-1", ip="10.0.0.1")
    run(server, "w-3", ip="10.0.0.3")
    server.evict("w-3")
    runtime, events = make_runtime(server, instance_id="cp-two")
    async with started(runtime):
        await asyncio.sleep(1)
    assert events.ready == [("w-1", "http://10.0.0.1:8080")]
    assert events.lost == [("w-3", "evicted")]
    await server.close()


@pytest.mark.parametrize(
    ("end", "reason"),
    [
        ("kubelet_eviction", "evicted"),
        ("api_eviction", "lost"),
        ("deleted", "lost"),
        ("failed", "lost"),
        ("succeeded", "lost"),
    ],
)
async def test_a_pod_that_ends_is_reported_lost_once(end: str, reason: str) -> None:
    """Evicted (kubelet: Failed/Evicted), drained (Eviction API: a graceful delete), deleted
    by someone, Failed, Succeeded: one `worker_lost`, even as the pod is cleaned up later."""
    server = server_for_test()
    runtime, events = make_runtime(server)
    async with started(runtime):
        spec = pool()
        await runtime.spawn(worker("w-1", spec), spec)
        run(server, "w-1")
        await asyncio.sleep(1)
        if end == "kubelet_eviction":
            server.evict("w-1")
        elif end == "api_eviction":
            server.evict("w-1", delete=True)
        elif end == "deleted":
            await server.delete_pod("w-1", grace_s=0)
        elif end == "failed":
            ended = Terminated(3, "Error")
            server.set_pod_status("w-1", phase=PodPhase.FAILED, ready=False, terminated=ended)
        else:
            ended = Terminated(0, "Completed")
            server.set_pod_status("w-1", phase=PodPhase.SUCCEEDED, ready=False, terminated=ended)
        await asyncio.sleep(1)
        assert events.lost == [("w-1", reason)]
        # How the container ended, when it did: the cause a failed spawn shows.
        assert events.details["w-1"] == {
            "failed": "pod w-1: its container exited with code 3 (Error)",
            "succeeded": "pod w-1: its container exited with code 0 (Completed)",
        }.get(end)
        await server.delete_pod("w-1", grace_s=0)
        await asyncio.sleep(60)  # past any grace period: the pod is gone for good
        assert await server.get_pod("w-1") is None
    assert events.lost == [("w-1", reason)]
    assert events.ready == [("w-1", "http://10.1.2.3:8080")]
    await server.close()


NO_NODE = Condition("False", "Unschedulable", "0/3 nodes are available: 3 Insufficient cpu.")


async def test_a_pending_pod_tells_how_it_gets_on() -> None:
    """The runtime reads PodScheduled, the nominated node, the container's waiting reason
    and its start: a pod no node fits is `unschedulable` (reported once as a stall, with
    the scheduler's message) but waits; a nominated one has a node coming; a scheduled one
    pulls its image; a failing pull is a stall that does not wait; a running, unready
    one counts from its start."""
    server = server_for_test()
    runtime, events = make_runtime(server)
    spec = pool()
    one = worker("w-1", spec)
    async with started(runtime):
        await runtime.spawn(one, spec)
        await asyncio.sleep(0.1)
        assert runtime.progress(one) == SpawnProgress("scheduling")
        server.set_pod_status("w-1", scheduled=NO_NODE)
        await asyncio.sleep(0.1)
        unschedulable = runtime.progress(one)
        assert unschedulable is not None
        assert (unschedulable.stage, unschedulable.waiting) == ("unschedulable", True)
        assert events.stalled == [
            ("w-1", "unschedulable", "pod w-1 unschedulable: " + str(NO_NODE.message))
        ]
        # The scheduler writes the condition again on every attempt: still one report.
        server.set_pod_status("w-1", scheduled=replace(NO_NODE, message="0/4 nodes fit"))
        await asyncio.sleep(0.1)
        assert len(events.stalled) == 1
        server.set_pod_status("w-1", nominated_node="node-b")
        await asyncio.sleep(0.1)
        assert runtime.progress(one) == SpawnProgress(
            "node_coming", waiting=True, detail="nominated to node-b"
        )
        server.set_pod_status(
            "w-1",
            node_name="node-b",
            scheduled=Condition("True"),
            waiting=Waiting("ContainerCreating"),
        )
        await asyncio.sleep(0.1)
        assert runtime.progress(one) == SpawnProgress(
            "pulling", waiting=True, detail="ContainerCreating"
        )
        server.set_pod_status("w-1", waiting=Waiting("ImagePullBackOff", "Back-off pulling"))
        await asyncio.sleep(0.1)
        failing = runtime.progress(one)
        assert failing is not None and (failing.stage, failing.waiting) == (
            "image_pull_failing",
            False,
        )
        assert events.stalled[1:] == [
            (
                "w-1",
                "image_pull_failing",
                "pod w-1 cannot pull its image: ImagePullBackOff: Back-off pulling",
            )
        ]
        server.set_pod_status("w-1", phase=PodPhase.RUNNING, waiting=None, started_at=EPOCH + 300)
        await asyncio.sleep(0.1)
        assert runtime.progress(one) == SpawnProgress("not_ready", started_at=EPOCH + 300)
        run(server, "w-1")
        await asyncio.sleep(0.1)
        assert runtime.progress(one) is None
        assert events.ready == [("w-1", "http://10.1.2.3:8080")]
    await server.close()


async def test_a_stopped_pod_is_deleted_with_its_grace_and_not_reported(
    looptime: LoopTimeProxy,
) -> None:
    """stop() deletes with the pool's grace (capped by stop_grace_s); the pod's end is the
    control plane's own doing, never a loss: it is reported gone once it leaves the
    cluster (the ledger counts its terminating time up to there), once."""
    server = server_for_test()
    runtime, events = make_runtime(server, stop_grace_s=5)
    async with started(runtime):
        spec = pool()
        one = worker("w-1", spec)
        await runtime.spawn(one, spec)
        run(server, "w-1")
        await asyncio.sleep(1)
        assert (await pod_of(server, "w-1")).spec.termination_grace_period_s == 5
        before, asked = float(looptime), runtime.informer.clock.now()
        await runtime.stop(one, 10)
        terminating = await pod_of(server, "w-1")
        assert terminating.deletion_timestamp == pytest.approx(EPOCH + before + 5)
        await asyncio.sleep(10)
        assert await server.get_pod("w-1") is None
        await runtime.stop(one, 10)  # already gone: fine
        await asyncio.sleep(1)
    assert events.lost == []
    ((gone, at),) = events.gone
    assert gone == "w-1" and at == pytest.approx(asked + 5, abs=0.5)
    await server.close()


async def test_a_stopped_pod_is_gone_once_it_ends_and_one_ended_before_never() -> None:
    """A stopped pod the kubelet reports Succeeded (its worker exited on SIGTERM) holds its
    node share no more: reported gone then, once, not again at its removal. A pod that had
    failed before its stop (a spawn failure's) held none: never reported gone."""
    server = server_for_test()
    runtime, events = make_runtime(server, stop_grace_s=30)
    async with started(runtime):
        spec = pool()
        one, two = worker("w-1", spec), worker("w-2", spec)
        for each in (one, two):
            await runtime.spawn(each, spec)
            run(server, each.id)
        await asyncio.sleep(1)
        ended = Terminated(3, "Error")
        server.set_pod_status("w-2", phase=PodPhase.FAILED, ready=False, terminated=ended)
        await asyncio.sleep(1)
        await runtime.stop(one, 30)
        await runtime.stop(two, 30)
        await asyncio.sleep(3)
        exited = runtime.informer.clock.now()
        done = Terminated(0, "Completed")
        server.set_pod_status("w-1", phase=PodPhase.SUCCEEDED, ready=False, terminated=done)
        await asyncio.sleep(1)
        for name in ("w-1", "w-2"):
            await server.delete_pod(name, grace_s=0)
        await asyncio.sleep(1)
        assert await server.get_pod("w-1") is None and await server.get_pod("w-2") is None
    ((gone, at),) = events.gone
    assert gone == "w-1" and at == pytest.approx(exited, abs=0.5)
    assert events.lost == [("w-2", "lost")]
    await server.close()


async def test_a_refused_stop_is_a_runtime_failure_and_the_pod_still_counts() -> None:
    """If the delete is refused the pod stays watched: its later end is still reported."""
    server = server_for_test()
    runtime, events = make_runtime(server)
    async with started(runtime):
        spec = pool()
        one = worker("w-1", spec)
        await runtime.spawn(one, spec)
        run(server, "w-1")
        await asyncio.sleep(1)
        server.fail_next("delete_pod", ClusterUnavailable("etcd is down"))
        with pytest.raises(RuntimeFailure, match="etcd is down"):
            await runtime.stop(one, 10)
        server.evict("w-1")
        await asyncio.sleep(1)
    assert events.lost == [("w-1", "evicted")]
    await server.close()


# -- adoption, listing, disruption --------------------------------------------------------------


async def test_adopt_takes_live_pods_only_and_relabels_them() -> None:
    """Alive and not terminating: adopted and stamped with this replica's instance id."""
    server = server_for_test()
    creator, _ = make_runtime(server, instance_id="cp-old")
    spec = pool()
    for name in ("w-live", "w-pending", "w-failed", "w-leaving"):
        await creator.spawn(worker(name, spec), spec)
    for name in ("w-live", "w-failed", "w-leaving"):
        run(server, name)
    server.set_pod_status("w-failed", phase=PodPhase.FAILED, ready=False)
    server.evict("w-leaving", delete=True)

    runtime, _ = make_runtime(server, instance_id="cp-new")
    async with started(runtime):
        # No waiting for the informer: adopt waits for its first list itself.
        assert await runtime.adopt(worker("w-live", spec))
        assert await runtime.adopt(worker("w-pending", spec))
        assert not await runtime.adopt(worker("w-failed", spec))
        assert not await runtime.adopt(worker("w-leaving", spec))
        assert not await runtime.adopt(worker("w-never", spec))
    assert (await pod_of(server, "w-live")).labels[LABEL_INSTANCE] == "cp-new"
    assert (await pod_of(server, "w-pending")).labels[LABEL_INSTANCE] == "cp-new"
    assert server.calls["list_pods"] == 1
    await server.close()


async def test_adopt_fails_clearly_when_the_cluster_cannot_be_listed(
    looptime: LoopTimeProxy,
) -> None:
    """Never a False (which would retire a live worker) for a cache that is not filled."""
    server = server_for_test()
    server.fail_next("list_pods", ClusterUnavailable("apiserver down"), times=1000)
    runtime, _ = make_runtime(server, sync_timeout_s=20)
    async with started(runtime):
        with pytest.raises(RuntimeFailure, match="no list of the fleet's pods within 20s"):
            await runtime.adopt(worker("w-1"))
        assert float(looptime) == pytest.approx(20)
        with pytest.raises(RuntimeFailure):
            await runtime.list_objects()
    await server.close()


async def test_list_objects_reports_worker_pods_from_the_cache() -> None:
    """Workers only (never placeholders), with liveness and readiness, and no list call."""
    server = server_for_test()
    runtime, _ = make_runtime(server)
    async with started(runtime):
        spec = pool(headroom_nodes=1)
        for name in ("w-1", "w-2"):
            await runtime.spawn(worker(name, spec), spec)
        run(server, "w-1")
        server.evict("w-2")
        await runtime.reconcile_headroom([spec])
        await asyncio.sleep(1)
        lists = server.calls["list_pods"]
        objects = {obj.worker_id: obj for obj in await runtime.list_objects()}
        assert server.calls["list_pods"] == lists
    assert set(objects) == {"w-1", "w-2"}
    assert objects["w-1"].alive and objects["w-1"].ready
    assert objects["w-1"].endpoint == "http://10.1.2.3:8080"
    assert objects["w-1"].ref == {"pod": "w-1", "namespace": NAMESPACE}
    assert (objects["w-1"].pool, objects["w-1"].instance) == ("duck", "cp-one")
    assert objects["w-1"].created_at == pytest.approx(EPOCH, abs=1)
    assert not objects["w-2"].alive and not objects["w-2"].ready
    await server.close()


async def test_set_busy_toggles_do_not_disrupt_and_skips_what_is_already_there() -> None:
    """ "true" while busy, removed when not; no patch when the cached pod has the value."""
    server = server_for_test()
    runtime, _ = make_runtime(server)
    async with started(runtime):
        spec = pool()
        one = worker("w-1", spec)
        await runtime.spawn(one, spec)
        await asyncio.sleep(1)
        await runtime.set_busy(one, False)  # a new pod is not pinned: nothing to send
        assert server.calls["patch_pod"] == 0
        await runtime.set_busy(one, True)
        assert (await pod_of(server, "w-1")).annotations[DO_NOT_DISRUPT] == "true"
        await asyncio.sleep(1)
        await runtime.set_busy(one, True)
        assert server.calls["patch_pod"] == 1
        await runtime.set_busy(one, False)
        assert DO_NOT_DISRUPT not in (await pod_of(server, "w-1")).annotations
        assert server.calls["patch_pod"] == 2
        await runtime.set_busy(worker("w-gone"), True)  # nothing left to protect
    await server.close()


def test_placeholder_slots_fit_workers_by_cpu_and_memory_and_follow_the_template() -> None:
    """How many workers one placeholder holds: the smaller of the CPU and memory fits, 1
    without a placeholder size; a template asking for more gets fewer (no stale answer)."""
    sized, _ = make_runtime(server_for_test(), placeholder_size=("2", "1Gi"))
    assert sized.placeholder_slots(pool()) == 4  # 2 / 500m CPU, 1Gi / 256Mi memory
    assert sized.placeholder_slots(pool()) == 4
    bigger = replace(TEMPLATE, cpu="1", memory="128Mi")
    assert sized.placeholder_slots(pool(template=bigger)) == 2
    plain, _ = make_runtime(server_for_test())
    assert plain.placeholder_slots(pool()) == 1


def test_placeholder_requests_are_its_size_else_a_workers() -> None:
    """What one placeholder requests, which the ledger prices headroom by: its size, not
    the workers it holds room for (2.2 CPUs hold 4 workers of 500m, and 2.2 CPUs)."""
    sized, _ = make_runtime(server_for_test(), placeholder_size=("2200m", "1Gi"))
    assert sized.placeholder_slots(pool()) == 4
    assert sized.placeholder_requests(pool()) == (2.2, 1.0)
    plain, _ = make_runtime(server_for_test())
    assert plain.placeholder_requests(pool()) == (0.5, 0.25)  # a worker's 500m, 256Mi


# -- the informer ----------------------------------------------------------------------------


async def test_a_dropped_watch_resumes_from_the_last_version() -> None:
    """What changed while the watch was down is replayed; no new list is needed."""
    server = server_for_test()
    runtime, events = make_runtime(server)
    async with started(runtime):
        spec = pool()
        for name in ("w-1", "w-2"):
            await runtime.spawn(worker(name, spec), spec)
        await asyncio.sleep(1)
        server.drop_watches()
        run(server, "w-1")
        await server.delete_pod("w-2")
        await asyncio.sleep(5)
        assert (runtime.informer.lists, runtime.informer.watches) == (1, 2)
    assert events.ready == [("w-1", "http://10.1.2.3:8080")]
    assert events.lost == [("w-2", "lost")]
    await server.close()


async def test_gone_relists_and_reports_only_what_was_missed() -> None:
    """History compacted while the watch was down: a fresh list, diffed against the cache,
    reports the pod that became ready and the one that vanished, once each."""
    server = server_for_test()
    runtime, events = make_runtime(server)
    async with started(runtime):
        spec = pool()
        for name in ("w-1", "w-2", "w-3"):
            await runtime.spawn(worker(name, spec), spec)
        run(server, "w-3", ip="10.0.0.3")
        await asyncio.sleep(1)
        assert events.ready == [("w-3", "http://10.0.0.3:8080")]
        server.drop_watches()
        run(server, "w-1", ip="10.0.0.1")
        await server.delete_pod("w-2")
        server.compact()
        await asyncio.sleep(5)
        assert runtime.informer.lists == 2
    assert events.ready == [("w-3", "http://10.0.0.3:8080"), ("w-1", "http://10.0.0.1:8080")]
    assert events.lost == [("w-2", "lost")]
    await server.close()


class LossyWatch:
    """The fake cluster, except that watches silently drop every event for chosen pods:
    the kind of miss only a resync can repair."""

    def __init__(self, server: FakeApiServer) -> None:
        self.server = server
        self.blind_to: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)

    async def list_pods(self, selector: Selector) -> PodList:
        return await self.server.list_pods(selector)

    async def watch_pods(
        self, selector: Selector, resource_version: str
    ) -> AsyncGenerator[WatchEvent, None]:
        watch = self.server.watch_pods(selector, resource_version)
        try:
            async for event in watch:
                if event.pod.name not in self.blind_to:
                    yield event
        finally:
            await watch.aclose()


async def test_a_periodic_resync_reports_what_the_watch_missed(looptime: LoopTimeProxy) -> None:
    """Every resync_s the informer lists and diffs: a missed deletion and a missed
    readiness are reported at the next resync, and nothing is reported twice."""
    server = server_for_test()
    lossy = LossyWatch(server)
    runtime, events = make_runtime(lossy, resync_s=60)
    async with started(runtime):
        spec = pool()
        for name in ("w-1", "w-2", "w-3"):
            await runtime.spawn(worker(name, spec), spec)
        run(server, "w-3", ip="10.0.0.3")
        await asyncio.sleep(1)
        lossy.blind_to = {"w-1", "w-2"}
        run(server, "w-1", ip="10.0.0.1")
        await server.delete_pod("w-2")
        await asyncio.sleep(30)
        assert events.ready == [("w-3", "http://10.0.0.3:8080")] and events.lost == []
        await asyncio.sleep(30)  # the resync at 60 s
        assert runtime.informer.lists == 2
        assert events.ready[1:] == [("w-1", "http://10.0.0.1:8080")]
        assert events.lost == [("w-2", "lost")]
        await asyncio.sleep(125)  # two more resyncs with nothing new
        assert runtime.informer.lists == 4
    assert len(events.ready) == 2 and len(events.lost) == 1
    await server.close()


async def test_the_informer_backs_off_and_recovers_from_api_errors(
    looptime: LoopTimeProxy,
) -> None:
    """Failed lists and watches are retried with a doubling backoff, never given up."""
    server = server_for_test()
    server.fail_next("list_pods", ClusterUnavailable("apiserver restarting"), times=3)
    runtime, events = make_runtime(server)
    async with started(runtime):
        assert await runtime.list_objects() == []
        assert float(looptime) == pytest.approx(0.5 + 1 + 2)
        server.fail_next("watch_pods", ClusterUnavailable("apiserver restarting"), times=2)
        server.drop_watches()
        spec = pool()
        await runtime.spawn(worker("w-1", spec), spec)
        run(server, "w-1")
        await asyncio.sleep(10)
    assert events.ready == [("w-1", "http://10.1.2.3:8080")]
    assert runtime.informer.lists == 1
    await server.close()


# -- headroom placeholders ---------------------------------------------------------------------


async def placeholders(server: FakeApiServer) -> dict[str, Pod]:
    listing = await server.list_pods({LABEL_FLEET: FLEET})
    return {pod.name: pod for pod in listing.items if LABEL_PLACEHOLDER in pod.labels}


async def test_placeholders_are_created_sized_like_the_worker() -> None:
    """headroom_nodes pause pods at the placeholder priority, requests = limits = the
    worker's size, on the workers' nodes; a repeated pass changes nothing."""
    server = server_for_test()
    runtime, _ = make_runtime(server)
    async with started(runtime):
        spec = pool(headroom_nodes=3)
        await runtime.reconcile_headroom([spec])
        made = await placeholders(server)
        assert len(made) == 3
        for pod in made.values():
            (container,) = pod.spec.containers
            assert (container.image, container.cpu, container.memory) == (
                "registry.k8s.io/pause:3.10",
                "500m",
                "256Mi",
            )
            assert pod.spec.priority_class_name == "stoker-placeholder"
            assert pod.spec.restart_policy == "Never"
            assert pod.spec.node_selector == {"stoker.dev/nodes": "workers"}
            assert [t.key for t in pod.spec.tolerations] == ["dedicated"]
            assert pod.labels[LABEL_PLACEHOLDER] == "duck"
            assert LABEL_WORKER_ID not in pod.labels
        # Before the watch delivered them (same pass again) and after: still three.
        await runtime.reconcile_headroom([spec])
        await asyncio.sleep(1)
        await runtime.reconcile_headroom([spec])
        assert set(await placeholders(server)) == set(made)
    await server.close()


async def test_placeholders_follow_size_and_count_and_zero_deletes_them() -> None:
    """A new worker size replaces them; fewer are trimmed; 0 or a removed pool deletes
    them all; worker pods are never touched."""
    server = server_for_test()
    runtime, events = make_runtime(server)
    async with started(runtime):
        spec = pool(headroom_nodes=2)
        await runtime.spawn(worker("w-1", spec), spec)
        await runtime.reconcile_headroom([spec])
        await asyncio.sleep(1)
        first = await placeholders(server)

        bigger = pool(headroom_nodes=2, template=replace(TEMPLATE, cpu="2", memory="4Gi"))
        await runtime.reconcile_headroom([bigger])
        await asyncio.sleep(1)
        second = await placeholders(server)
        assert len(second) == 2 and not set(second) & set(first)
        assert {
            (p.spec.containers[0].cpu, p.spec.containers[0].memory) for p in second.values()
        } == {("2", "4Gi")}

        await runtime.reconcile_headroom([replace(bigger, headroom_nodes=1)])
        await asyncio.sleep(1)
        assert len(await placeholders(server)) == 1

        await runtime.reconcile_headroom([replace(bigger, headroom_nodes=0)])
        await asyncio.sleep(1)
        assert await placeholders(server) == {}

        await runtime.reconcile_headroom([bigger])
        await asyncio.sleep(1)
        await runtime.reconcile_headroom([])  # the pool is gone from the configuration
        await asyncio.sleep(1)
        assert await placeholders(server) == {}
        assert await server.get_pod("w-1") is not None
    assert events.lost == []
    await server.close()


async def test_a_configured_node_size_and_preempted_placeholders() -> None:
    """placeholder_size overrides the worker's size; a preempted (deleted) or evicted
    placeholder is replaced on a later pass."""
    server = server_for_test()
    runtime, _ = make_runtime(server, placeholder_size=("7", "28Gi"))
    async with started(runtime):
        spec = pool(headroom_nodes=2)
        await runtime.reconcile_headroom([spec])
        await asyncio.sleep(1)
        made = sorted(await placeholders(server))
        pods = await placeholders(server)
        assert {(p.spec.containers[0].cpu, p.spec.containers[0].memory) for p in pods.values()} == {
            ("7", "28Gi")
        }
        await server.delete_pod(made[0], grace_s=0)  # preempted by a worker pod
        run(server, made[1])
        server.evict(made[1])
        await asyncio.sleep(1)
        await runtime.reconcile_headroom([spec])  # recreates the first, clears the evicted
        await asyncio.sleep(1)
        await runtime.reconcile_headroom([spec])
        await asyncio.sleep(1)
        now = await placeholders(server)
        assert sorted(now) == made
        assert all(p.phase == PodPhase.PENDING for p in now.values())
    await server.close()


async def test_a_placeholder_the_api_server_refuses_is_asked_for_again_after_a_pause() -> None:
    """A quota without room answers every pass the same: the refused placeholder waits
    5 s, then 10 s, before its next create (each refusal still raised, for the log); a
    new spec (a new name) is tried at once."""
    server = server_for_test()
    runtime, _ = make_runtime(server)
    quota = Forbidden('pods "headroom-x" is forbidden: exceeded quota: q')
    async with started(runtime):
        spec = pool(headroom_nodes=1)
        server.fail_next("create_pod", quota, times=2)
        with pytest.raises(RuntimeFailure, match="exceeded quota: q"):
            await runtime.reconcile_headroom([spec])
        await asyncio.sleep(4.5)
        await runtime.reconcile_headroom([spec])  # paused: no create, nothing to say
        assert server.calls["create_pod"] == 1
        await asyncio.sleep(0.5)
        with pytest.raises(RuntimeFailure, match="exceeded quota: q"):
            await runtime.reconcile_headroom([spec])  # the probe, refused again
        await asyncio.sleep(9.5)
        await runtime.reconcile_headroom([spec])
        assert server.calls["create_pod"] == 2

        smaller = pool(headroom_nodes=1, template=replace(TEMPLATE, cpu="250m"))
        server.fail_next("create_pod", quota)
        with pytest.raises(RuntimeFailure):
            await runtime.reconcile_headroom([smaller])  # a new name: asked at once
        assert server.calls["create_pod"] == 3
        await asyncio.sleep(0.5)
        # Back to the first spec, forgotten while it was not wanted: asked at once.
        await runtime.reconcile_headroom([spec])
        assert server.calls["create_pod"] == 4
        assert len(await placeholders(server)) == 1
    await server.close()


async def test_headroom_without_a_placeholder_priority_class_is_refused() -> None:
    """Placeholders at the workers' priority would never be preempted: a clear failure."""
    server = server_for_test()
    runtime, _ = make_runtime(server, placeholder_priority_class=None)
    async with started(runtime):
        with pytest.raises(RuntimeFailure, match="no placeholder priority class"):
            await runtime.reconcile_headroom([pool(headroom_nodes=1)])
        await runtime.reconcile_headroom([pool(headroom_nodes=0)])
    assert await placeholders(server) == {}
    await server.close()


# -- inside a control plane ---------------------------------------------------------------------


@dataclass
class Workers:
    """The worker side of the activation protocol for pods that run no process here (an
    `Activator`: the plane hands activations to it)."""

    bound: dict[str, tuple[str, int]] = field(default_factory=dict)
    calls: list[tuple[str, str, int, float]] = field(default_factory=list)

    async def activate(self, worker: Worker, payload: ActivationPayload, timeout: float) -> None:
        self.calls.append((worker.id, payload.org, payload.epoch, timeout))
        held = self.bound.get(worker.id)
        if held is not None and (held[0] != payload.org or payload.epoch <= held[1]):
            raise ActivationRejected(f"{worker.id} is bound to {held}")
        self.bound[worker.id] = (payload.org, payload.epoch)

    async def close(self) -> None:
        return None


@dataclass
class Plane:
    plane: ControlPlane
    runtime: KubernetesRuntime
    server: FakeApiServer
    workers: Workers

    async def tick(self, settle: float = 3.0) -> None:
        await self.plane.run_janitor_pass()
        await asyncio.sleep(settle)

    async def rows(self, *states: WorkerState) -> list[Worker]:
        return await self.plane.store.list_workers(states=states or None)

    async def claim(self, org: str = "acme") -> Any:
        return await self.plane.claim(ClaimRequest(pool="duck", org=org, timeout_s=10))


@asynccontextmanager
async def plane(
    tmp_path: Path,
    server: FakeApiServer,
    *,
    instance_id: str = "cp-one",
    spec: PoolSpec | None = None,
    prefer_session_nodes: bool | Literal["forecast"] = False,
) -> AsyncIterator[Plane]:
    """A control plane on the Kubernetes runtime and the fake cluster (SQLite store)."""
    clock = LoopClock(epoch=EPOCH)
    workers = Workers()
    runtime = KubernetesRuntime(
        cluster=server,
        clock=clock,
        fleet=FLEET,
        instance_id=instance_id,
        activation_key=TEST_ACTIVATION_KEY,
        placeholder_priority_class="stoker-placeholder",
        prefer_session_nodes=prefer_session_nodes,
    )
    control = ControlPlane(
        store=SqliteStore(str(tmp_path / "stoker.db")),
        runtime=runtime,
        activator=workers,
        pools=[spec or pool(warm_target=3)],
        settings=PlaneSettings(),
        clock=clock,
        instance_id=instance_id,
    )
    await control.start(loops=False)
    try:
        yield Plane(control, runtime, server, workers)
    finally:
        await control.stop()


async def test_ready_pods_become_warm_workers_and_claims_list_nothing(tmp_path: Path) -> None:
    """The warm target is met by pods the kubelet runs; claims are served from the
    event-fed queue: no list call per claim, one list for the replica's whole life."""
    server = server_for_test()
    async with Kubelet(server), plane(tmp_path, server) as p:
        await asyncio.sleep(3)
        warm = await p.rows(S.WARM)
        assert len(warm) == 3
        for row in warm:
            pod = await pod_of(server, row.id)
            assert row.endpoint == f"http://{pod.pod_ip}:8080"
            assert row.runtime_ref == {"pod": row.id, "namespace": NAMESPACE, "port": 8080}
        for org in ("a", "b", "c"):
            claim = await p.claim(org)
            assert claim.state is ClaimState.BOUND
            await p.plane.release(claim.id)
        assert server.calls["list_pods"] == 1
        assert sorted(p.workers.bound) == sorted(row.id for row in warm)
    await server.close()


async def test_an_evicted_warm_worker_is_lost_and_replaced(tmp_path: Path) -> None:
    """Eviction retires the worker (reason evicted) and the next pass restores the target."""
    server = server_for_test()
    async with Kubelet(server), plane(tmp_path, server) as p:
        await asyncio.sleep(3)
        victim = (await p.rows(S.WARM))[0]
        server.evict(victim.id)
        await asyncio.sleep(1)
        gone = await p.plane.store.get_worker(victim.id)
        assert gone is not None and (gone.state, gone.reason) == (S.RETIRED, "evicted")
        assert await server.get_pod(victim.id) is None  # the Failed pod was cleaned up
        await p.tick()
        warm = await p.rows(S.WARM)
        assert len(warm) == 3 and victim.id not in {w.id for w in warm}
    await server.close()


async def test_a_hot_worker_whose_pod_is_lost_fails_its_claim(tmp_path: Path) -> None:
    """Never silently swapped (I6): the claim fails with the reason, the worker retires."""
    server = server_for_test()
    async with Kubelet(server), plane(tmp_path, server) as p:
        await asyncio.sleep(3)
        claim = await p.claim()
        await server.delete_pod(claim.worker_id, grace_s=0)
        await asyncio.sleep(1)
        failed = await p.plane.get_claim(claim.id)
        assert (failed.state, failed.reason) == (ClaimState.FAILED, "worker_lost")
    await server.close()


async def test_do_not_disrupt_follows_the_worker_state(tmp_path: Path) -> None:
    """Warm workers are movable; activating, hot and hot_idle ones are pinned."""
    server = server_for_test()
    async with Kubelet(server), plane(tmp_path, server) as p:
        await asyncio.sleep(3)
        for row in await p.rows(S.WARM):
            assert DO_NOT_DISRUPT not in (await pod_of(server, row.id)).annotations
        claim = await p.claim()
        await asyncio.sleep(1)
        assert (await pod_of(server, claim.worker_id)).annotations[DO_NOT_DISRUPT] == "true"
        await p.plane.release(claim.id)
        parked = await p.plane.store.get_worker(claim.worker_id)
        assert parked is not None and parked.state is S.HOT_IDLE
        assert (await pod_of(server, claim.worker_id)).annotations[DO_NOT_DISRUPT] == "true"
        for row in await p.rows(S.WARM):
            assert DO_NOT_DISRUPT not in (await pod_of(server, row.id)).annotations
        # Once not busy any more (e.g. retired from hot_idle), the pin is removed.
        await p.runtime.set_busy(parked, False)
        assert DO_NOT_DISRUPT not in (await pod_of(server, claim.worker_id)).annotations
    await server.close()


async def test_claims_gather_on_the_node_whose_pods_are_pinned(tmp_path: Path) -> None:
    """The runtime counts the pinned pods on each node from its informer; a claim takes
    the warm worker on the node that holds the most sessions, so the second claim lands
    beside the first instead of on the next node of the queue (the fake kubelet places
    pods on three nodes in turn)."""
    server = server_for_test()
    async with Kubelet(server), plane(tmp_path, server, spec=pool(warm_target=6)) as p:
        await asyncio.sleep(3)
        first = await p.claim("a")
        await asyncio.sleep(1)  # the pin reaches the informer
        node = (await pod_of(server, first.worker_id)).node_name
        beside = [
            row.id
            for row in await p.rows(S.WARM)
            if (await pod_of(server, row.id)).node_name == node
        ]
        assert len(beside) == 1
        first_row = await p.plane.store.get_worker(first.worker_id)
        assert first_row is not None and p.runtime.node_sessions(first_row) == 1
        second = await p.claim("b")
        assert second.worker_id == beside[0]
        await asyncio.sleep(1)
        assert p.runtime.node_sessions(first_row) == 2
        # Released, both park pinned; once one loses its pin (a parked worker retired),
        # the node counts only the other.
        for claim in (first, second):
            await p.plane.release(claim.id)
        parked = await p.plane.store.get_worker(first.worker_id)
        assert parked is not None
        await p.runtime.set_busy(parked, False)
        await asyncio.sleep(1)
        assert p.runtime.node_sessions(parked) == 1
    await server.close()


async def test_a_new_worker_prefers_the_nodes_that_hold_sessions(tmp_path: Path) -> None:
    """With `prefer_session_nodes`, a spawn asks the scheduler for the nodes that hold the
    most sessions (preferred node affinity on the hostname); with no session anywhere it
    prefers none. The fake API
    server keeps the spec (the real kube-scheduler's answer to it is tested in
    tests/e2e_kubernetes/test_scheduling.py)."""
    server = server_for_test()
    spec = pool(warm_target=2)
    async with Kubelet(server), plane(tmp_path, server, spec=spec, prefer_session_nodes=True) as p:
        await asyncio.sleep(3)
        before = {pod.name: pod for pod in (await server.list_pods({})).items}
        assert len(before) == 2
        assert all(not pod.spec.preferred_nodes for pod in before.values())
        first = await p.claim("a")
        await asyncio.sleep(1)  # the pin reaches the informer
        node = (await pod_of(server, first.worker_id)).node_name
        assert node is not None
        seen = set(before) | {pod.name for pod in (await server.list_pods({})).items}
        p.plane.catalog.update_pool(pool(warm_target=4))
        await p.tick()
        new = [pod for pod in (await server.list_pods({})).items if pod.name not in seen]
        assert len(new) == 3  # the claimed worker's refill, and two more
        for pod in new:
            assert pod.spec.preferred_nodes == (PreferredNodes(100, (node,)),)
    await server.close()


async def test_with_forecast_a_new_worker_prefers_session_nodes_only_while_told_to_gather(
    tmp_path: Path,
) -> None:
    """`prefer_session_nodes="forecast"`: a spawn asks for the nodes that hold sessions
    only while the leader's sizing says the pool may gather (`gather`); claims that find
    no warm worker spawn their own, so each spawn here follows the last word."""
    server = server_for_test()
    spec = pool(warm_target=1)
    async with (
        Kubelet(server),
        plane(tmp_path, server, spec=spec, prefer_session_nodes="forecast") as p,
    ):
        await asyncio.sleep(3)
        first = await p.claim("a")
        await asyncio.sleep(1)  # the pin reaches the informer
        node = (await pod_of(server, first.worker_id)).node_name
        assert node is not None
        spread = await p.claim("b")  # no warm worker left: its own spawn
        first_pod = await pod_of(server, spread.worker_id)
        assert not first_pod.spec.preferred_nodes
        await asyncio.sleep(1)
        p.runtime.gather(spec.name, True)
        gathered = await p.claim("c")
        pod = await pod_of(server, gathered.worker_id)
        # The two nodes that hold a session each, equally preferred.
        sessions = {node, first_pod.node_name}
        assert len(pod.spec.preferred_nodes) == 1
        assert set(pod.spec.preferred_nodes[0].hostnames) == sessions
        p.runtime.gather(spec.name, False)
        again = await p.claim("d")
        assert not (await pod_of(server, again.worker_id)).spec.preferred_nodes
    await server.close()


async def test_without_forecast_a_word_to_gather_changes_nothing(tmp_path: Path) -> None:
    """`prefer_session_nodes=False` never prefers session nodes, whatever the sizing says."""
    server = server_for_test()
    spec = pool(warm_target=1)
    async with Kubelet(server), plane(tmp_path, server, spec=spec) as p:
        await asyncio.sleep(3)
        await p.claim("a")
        await asyncio.sleep(1)
        p.runtime.gather(spec.name, True)
        cold = await p.claim("b")
        assert not (await pod_of(server, cold.worker_id)).spec.preferred_nodes
    await server.close()


async def test_without_the_setting_new_workers_prefer_no_node(tmp_path: Path) -> None:
    server = server_for_test()
    async with Kubelet(server), plane(tmp_path, server, spec=pool(warm_target=2)) as p:
        await asyncio.sleep(3)
        await p.claim("a")
        await asyncio.sleep(1)  # the pin reaches the informer
        p.plane.catalog.update_pool(pool(warm_target=4))
        await p.tick()
        pods = (await server.list_pods({})).items
        assert len(pods) == 5
        assert all(not pod.spec.preferred_nodes for pod in pods)
    await server.close()


async def test_a_pin_lost_in_an_api_outage_is_restored_by_the_next_pass(
    tmp_path: Path,
) -> None:
    """A claim during an API outage cannot pin its pod (the patch fails, the claim is
    served all the same); the pass during the outage counts the pin out of date, and the
    first pass after the API's return pins the hot pod and unpins a warm one that an
    operator pinned by hand."""
    server = server_for_test()
    async with Kubelet(server), plane(tmp_path, server) as p:
        await asyncio.sleep(3)
        down = ClusterUnavailable("connection refused")
        server.fail_next("patch_pod", down)
        claim = await p.claim()
        await asyncio.sleep(1)
        assert claim.state is ClaimState.BOUND
        warm = [row.id for row in await p.rows(S.WARM)]
        await server.patch_pod(warm[0], annotations={DO_NOT_DISRUPT: "true"})
        await asyncio.sleep(1)
        server.fail_next("patch_pod", down)
        assert DO_NOT_DISRUPT not in (await pod_of(server, claim.worker_id)).annotations

        def out_of_date() -> float | None:
            return p.plane.metrics.registry.get_sample_value(
                "stoker_pins_out_of_date", {"pool": "duck"}
            )

        await p.plane.run_janitor_pass()  # the API still fails this pass's first patch
        assert out_of_date() == 1
        await p.plane.run_janitor_pass()
        assert (await pod_of(server, claim.worker_id)).annotations[DO_NOT_DISRUPT] == "true"
        assert DO_NOT_DISRUPT not in (await pod_of(server, warm[0])).annotations
        assert out_of_date() == 0
        patches = server.calls["patch_pod"]
        await asyncio.sleep(1)
        await p.plane.run_janitor_pass()  # all in date: nothing to send
        assert server.calls["patch_pod"] == patches
    await server.close()


class NoRoom:
    """A scheduler that finds no node for any pod: each new pod is marked Unschedulable
    `delay` seconds after its creation, as kube-scheduler does while no node fits."""

    def __init__(self, server: FakeApiServer, *, delay: float = 0.5) -> None:
        self.server = server
        self.delay = delay
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> NoRoom:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        watch = self.server.watch_pods({LABEL_FLEET: FLEET}, self.server.resource_version)
        try:
            async for event in watch:
                if event.type is WatchEventType.ADDED:
                    loop = asyncio.get_running_loop()
                    loop.call_later(self.delay, self._mark, event.pod.name)
        finally:
            await watch.aclose()

    def _mark(self, name: str) -> None:
        with contextlib.suppress(ObjectNotFound):
            self.server.set_pod_status(name, scheduled=NO_NODE)


class CreateCounter(FakeApiServer):
    """The fake cluster, remembering when each pod was created and deleted."""

    def __init__(self) -> None:
        super().__init__(clock=LoopClock(epoch=EPOCH), namespace=NAMESPACE)
        self.created: list[tuple[float, str]] = []
        self.deleted: list[tuple[float, str]] = []

    async def create_pod(self, pod: Pod) -> Pod:
        self.created.append((asyncio.get_running_loop().time(), pod.name))
        return await super().create_pod(pod)

    async def delete_pod(self, name: str, grace_s: float | None = None) -> None:
        self.deleted.append((asyncio.get_running_loop().time(), name))
        await super().delete_pod(name, grace_s)


async def test_an_unschedulable_pool_says_why_backs_off_and_does_not_churn(
    tmp_path: Path,
) -> None:
    """No node fits the pool's pods. Within one pass of the scheduler's verdict the pool
    shows `spawn_failing` with the scheduler's message; its pods are kept (a node may be
    on its way) until `timeouts.pending_s` (600 s), so none is recreated after 5 minutes;
    over 20 minutes of janitor passes every 2 s the pool creates 6 pods (3, then 3
    probes after pending_s), where retiring them at `spawn_s` made 30."""
    server = CreateCounter()
    spec = pool(warm_target=3)
    async with NoRoom(server), plane(tmp_path, server, spec=spec) as p:
        start = asyncio.get_running_loop().time()
        await asyncio.sleep(1)
        await p.plane.run_janitor_pass()
        (status,) = await p.plane.pool_status()
        assert status.spawn_failing and status.spawn_failures == 3
        assert status.last_spawn_error is not None
        assert "unschedulable: 0/3 nodes are available: 3 Insufficient cpu." in (
            status.last_spawn_error
        )
        assert {state: n for state, n in status.counts.items() if n} == {"spawning": 3}
        assert (
            p.plane.metrics.registry.get_sample_value(
                "stoker_spawn_failures_total", {"pool": "duck", "reason": "unschedulable"}
            )
            == 3
        )
        while asyncio.get_running_loop().time() - start < 20 * 60:
            await asyncio.sleep(2)
            await p.plane.run_janitor_pass()
        created = [at - start for at, _ in server.created]
        deleted = [at - start for at, _ in server.deleted]
        assert len(created) == 6, created
        assert created[:3] == pytest.approx([0, 0, 0], abs=0.1)
        assert not [at for at in deleted if at < 600]
        names = [name for _, name in server.deleted]
        assert sorted(names) == sorted(set(names)), "a pod deleted twice"
        # After pending_s: one probe per back-off interval, never more than the target.
        assert all(later - earlier >= 4 for earlier, later in itertools.pairwise(created[3:]))
        (status,) = await p.plane.pool_status()
        assert status.spawn_failing and status.counts.get("spawning") == 3
    await server.close()


async def test_a_pod_waiting_for_its_node_and_image_is_not_retired_at_spawn_s(
    tmp_path: Path,
) -> None:
    """A pod nominated to a node (preemption) and then pulling its image for 5 minutes is
    not retired at `timeouts.spawn_s` (120 s): it becomes a warm worker when it runs."""
    server = CreateCounter()
    spec = pool(warm_target=1)
    async with plane(tmp_path, server, spec=spec) as p:
        await asyncio.sleep(1)
        [row] = await p.rows(S.SPAWNING)
        server.set_pod_status(row.id, nominated_node="node-b")
        for _ in range(60):  # two minutes of passes
            await asyncio.sleep(2)
            await p.plane.run_janitor_pass()
        server.set_pod_status(row.id, node_name="node-b", waiting=Waiting("ContainerCreating"))
        for _ in range(90):  # three more
            await asyncio.sleep(2)
            await p.plane.run_janitor_pass()
        assert [w.id for w in await p.rows(S.SPAWNING)] == [row.id]
        run(server, row.id)
        await asyncio.sleep(1)
        assert [w.id for w in await p.rows(S.WARM)] == [row.id]
        assert [name for _, name in server.created] == [row.id]
        assert server.deleted == []
        (status,) = await p.plane.pool_status()
        assert not status.spawn_failing
    await server.close()


async def test_a_pod_that_never_gets_a_node_is_retired_at_pending_s(tmp_path: Path) -> None:
    """Past `timeouts.pending_s` an unschedulable pod is retired as stuck (and a probe
    replaces it); before, it stays. A running pod that never gets ready is retired
    `spawn_s` after its container started."""
    server = CreateCounter()
    spec = pool(warm_target=1, timeouts=Timeouts(spawn_s=120, pending_s=300))
    async with NoRoom(server), plane(tmp_path, server, spec=spec) as p:
        await asyncio.sleep(1)
        [row] = await p.rows(S.SPAWNING)
        for _ in range(148):
            await asyncio.sleep(2)
            await p.plane.run_janitor_pass()
        assert [w.id for w in await p.rows(S.SPAWNING)] == [row.id]  # at 297 s
        for _ in range(3):
            await asyncio.sleep(2)
            await p.plane.run_janitor_pass()
        gone = await p.plane.store.get_worker(row.id)
        assert gone is not None and gone.reason == "stuck"
        await asyncio.sleep(1)
        await p.plane.run_janitor_pass()  # the probe, once the back-off allows
        [probe] = await p.rows(S.SPAWNING)
        await asyncio.sleep(1)
        # The probe gets a node and starts, but never gets ready.
        started = asyncio.get_running_loop().time()
        server.set_pod_status(
            probe.id,
            node_name="node-a",
            phase=PodPhase.RUNNING,
            started_at=EPOCH + started,
        )
        while asyncio.get_running_loop().time() - started < 118:
            await asyncio.sleep(2)
            await p.plane.run_janitor_pass()
        assert [w.id for w in await p.rows(S.SPAWNING)] == [probe.id]
        for _ in range(2):
            await asyncio.sleep(2)
            await p.plane.run_janitor_pass()
        late = await p.plane.store.get_worker(probe.id)
        assert late is not None and late.reason == "stuck"
    await server.close()


async def test_a_restarted_control_plane_rebuilds_its_cache_and_adopts(tmp_path: Path) -> None:
    """The first replica stops and leaves its pods; the next one lists them once, adopts
    them (store owner and pod label) and serves claims from them, reuse included."""
    server = server_for_test()
    async with Kubelet(server):
        async with plane(tmp_path, server, instance_id="cp-one") as first:
            await asyncio.sleep(3)
            claim = await first.claim("acme")
            await first.plane.release(claim.id)
            before = {w.id: w.state for w in await first.rows(S.WARM, S.HOT_IDLE)}
        assert sorted(before.values()) == [S.HOT_IDLE, S.WARM, S.WARM]
        lists = server.calls["list_pods"]
        async with plane(tmp_path, server, instance_id="cp-two") as second:
            await asyncio.sleep(3)
            assert server.calls["list_pods"] == lists + 1
            rows = {w.id: w for w in await second.rows(S.WARM, S.HOT_IDLE)}
            adopted = {name: rows[name] for name in before}
            assert {name: row.state for name, row in adopted.items()} == before
            assert {row.owner for row in adopted.values()} == {"cp-two"}
            for name in adopted:
                assert (await pod_of(server, name)).labels[LABEL_INSTANCE] == "cp-two"
            assert len(rows) == 4  # and the pass refilled the warm target
            objects = await second.runtime.list_objects()
            assert {o.worker_id for o in objects} == set(rows)
            # The org's parked worker is reused: the hot_idle queue was rebuilt on adoption.
            again = await second.claim("acme")
            assert again.source.value == "reuse" and again.worker_id == claim.worker_id
    await server.close()


# -- the Runtime contract ----------------------------------------------------------------------


class KubernetesHarness:
    """The contract's harness on the fake cluster, with the test kubelet running pods."""

    pool = pool()

    def __init__(self, server: FakeApiServer) -> None:
        self.server = server
        self.runtimes: list[KubernetesRuntime] = []

    async def start(self, instance_id: str) -> tuple[Runtime, Recorder]:
        runtime = KubernetesRuntime(
            cluster=self.server,
            clock=LoopClock(epoch=EPOCH),
            fleet=FLEET,
            instance_id=instance_id,
            activation_key=TEST_ACTIVATION_KEY,
        )
        recorder = Recorder()
        runtime.subscribe(recorder)
        await runtime.start()
        self.runtimes.append(runtime)
        return runtime, recorder

    async def kill(self, worker: Worker) -> None:
        # The worker's container exits: restartPolicy Never leaves the pod Failed.
        self.server.set_pod_status(worker.id, phase=PodPhase.FAILED, ready=False)

    async def settle(self) -> None:
        await asyncio.sleep(3)


class TestKubernetesRuntimeContract(RuntimeContract):
    """The shared contract, on pods of the fake cluster (virtual time)."""

    @pytest.fixture
    async def harness(self) -> AsyncIterator[KubernetesHarness]:
        server = server_for_test()
        harness = KubernetesHarness(server)
        async with Kubelet(server):
            yield harness
            for runtime in harness.runtimes:
                await runtime.close()
        await server.close()


class DeleteCounter(FakeApiServer):
    """The fake cluster, counting the DELETEs of each pod."""

    def __init__(self) -> None:
        super().__init__(clock=LoopClock(epoch=EPOCH), namespace=NAMESPACE)
        self.deletes: Counter[str] = Counter()

    async def delete_pod(self, name: str, grace_s: float | None = None) -> None:
        self.deletes[name] += 1
        await super().delete_pod(name, grace_s)


async def test_stop_workers_deletes_each_pod_once_and_the_placeholders(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`--stop-workers`: one DELETE per worker pod (the leftover scan leaves pods whose
    deletion is under way alone, and says nothing of them), and the leader's headroom
    placeholders are deleted too."""
    server = DeleteCounter()
    # A constant headroom: placeholders from the first pass, whatever they buy.
    spec = pool(warm_target=3, headroom_nodes=2, demand=DemandSpec(headroom="constant"))
    async with Kubelet(server), plane(tmp_path, server, spec=spec) as p:
        await asyncio.sleep(3)
        claim = await p.claim()
        workers = {row.id for row in await p.rows()}
        assert len(workers) == 3  # two warm, one hot (no pass refilled the target)
        placeholders = {
            pod.name for pod in (await server.list_pods({LABEL_PLACEHOLDER: "duck"})).items
        }
        assert len(placeholders) == 2
        await p.plane.stop(stop_workers=True)
        assert {name: server.deletes[name] for name in workers} == dict.fromkeys(workers, 1)
        assert {name: server.deletes[name] for name in placeholders} == dict.fromkeys(
            placeholders, 1
        )
        assert "leftover_stopped" not in caplog.text
        await asyncio.sleep(15)  # past every grace
        assert (await server.list_pods({LABEL_FLEET: FLEET})).items == ()
        assert claim.worker_id in workers
    await server.close()
