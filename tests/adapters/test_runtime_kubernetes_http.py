"""The Kubernetes runtime through the lightkube adapter, at the HTTP level (kmock).

No Kubernetes cluster can run where these tests run; kmock's emulator (extended in
`tests/adapters/test_cluster_lightkube.py` with resourceVersions and label selectors) stands in for
the API server, so the exact requests the runtime makes are recorded and asserted: the
pod body it creates (labels, annotations, requests equal to limits, restartPolicy Never,
no owner references), the merge patches of the do-not-disrupt annotation, the delete with
its grace, and the informer's list and watch of its own fleet only.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from test_cluster_lightkube import (
    NAMESPACE,
    PODS,
    PODS_PATH,
    ContractEmulator,
    StepClock,
    client_for,
)

from fakes import TEST_ACTIVATION_KEY
from stoker.adapters.cluster_lightkube import LightkubeCluster
from stoker.adapters.runtime_kubernetes import KubernetesRuntime
from stoker.bootstrap import HTTP_CLIENT_LOGGERS, configure_logging
from stoker.domain.errors import RuntimeFailure
from stoker.domain.records import Worker
from stoker.domain.specs import PodTemplate, PoolSpec, Timeouts
from stoker.domain.states import WorkerState
from stoker.ports.clock import LoopClock
from stoker.ports.cluster import Container, Pod, PodSpec

pytestmark = pytest.mark.kmock(cls=ContractEmulator)

FLEET = "fleet-a"
TEMPLATE = PodTemplate(
    image="ghcr.io/example/worker:1",
    command=("/usr/bin/worker",),
    args=("--port", "{port}"),
    env={"MODE": "pooled"},
    cpu="2",
    memory="4Gi",
    port=8816,
    node_selector={"stoker.dev/nodes": "workers"},
    tolerations=({"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"},),
    priority_class="stoker-worker",
    service_account="stoker-worker",
    annotations={"example.com/owner": "data"},
)
POOL = PoolSpec(
    name="duck", template=TEMPLATE, timeouts=Timeouts(stop_grace_s=30), headroom_nodes=1
)


def worker(worker_id: str) -> Worker:
    return Worker(
        id=worker_id,
        pool=POOL.name,
        revision=POOL.revision,
        state=WorkerState.SPAWNING,
        epoch=0,
        owner="cp-one",
        created_at=0.0,
        updated_at=0.0,
    )


MakeRuntime = Callable[[], Awaitable[KubernetesRuntime]]


@pytest.fixture
async def make_runtime(kmock: ContractEmulator) -> AsyncIterator[MakeRuntime]:
    """Runtimes on a LightkubeCluster talking to kmock; all closed at the end."""
    made: list[tuple[KubernetesRuntime, LightkubeCluster]] = []

    async def make() -> KubernetesRuntime:
        cluster = LightkubeCluster(
            namespace=NAMESPACE, clock=StepClock(), client=client_for(str(kmock.url))
        )
        runtime = KubernetesRuntime(
            cluster=cluster,
            clock=LoopClock(),
            fleet=FLEET,
            instance_id="cp-one",
            activation_key=TEST_ACTIVATION_KEY,
            placeholder_priority_class="stoker-placeholder",
        )
        made.append((runtime, cluster))
        return runtime

    yield make
    for runtime, cluster in made:
        await runtime.close()
        await cluster.close()


async def test_the_worker_pod_body_on_the_wire(
    kmock: ContractEmulator, make_runtime: MakeRuntime
) -> None:
    """One POST with stoker's labels, requests == limits, restartPolicy Never, no owner."""
    runtime = await make_runtime()
    await runtime.spawn(worker("w-1"), POOL)

    (post,) = kmock["post", PODS]
    assert post.url.path == PODS_PATH
    sent = json.loads(post.body)
    assert (sent["apiVersion"], sent["kind"]) == ("v1", "Pod")
    assert sent["metadata"] == {
        "name": "w-1",
        "namespace": NAMESPACE,
        "labels": {
            "app.kubernetes.io/managed-by": "stoker",
            "stoker.dev/fleet": FLEET,
            "stoker.dev/pool": "duck",
            "stoker.dev/revision": POOL.revision,
            "stoker.dev/worker-id": "w-1",
            "stoker.dev/instance": "cp-one",
        },
        "annotations": {"example.com/owner": "data"},
    }
    assert "ownerReferences" not in sent["metadata"]
    (container,) = sent["spec"]["containers"]
    assert container["resources"] == {
        "requests": {"cpu": "2", "memory": "4Gi"},
        "limits": {"cpu": "2", "memory": "4Gi"},
    }
    assert container["args"] == ["--port", "8816"]
    assert container["ports"] == [{"containerPort": 8816}]
    assert {"name": "STOKER_WORKER_ID", "value": "w-1"} in container["env"]
    assert sent["spec"] == {
        "containers": [container],
        "nodeSelector": {"stoker.dev/nodes": "workers"},
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "priorityClassName": "stoker-worker",
        "serviceAccountName": "stoker-worker",
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 30,
    }


async def test_do_not_disrupt_and_stop_on_the_wire(
    kmock: ContractEmulator, make_runtime: MakeRuntime
) -> None:
    """Busy: a merge patch setting the annotation; idle: one removing it; stop: a DELETE
    with the pool's grace in whole seconds."""
    runtime = await make_runtime()
    one = worker("w-1")
    await runtime.spawn(one, POOL)
    await runtime.set_busy(one, True)
    await runtime.set_busy(one, False)
    await runtime.stop(one, 2.5)

    pin, unpin = kmock["patch", PODS]
    for request in (pin, unpin):
        assert request.url.path == f"{PODS_PATH}/w-1"
        assert request.headers["Content-Type"] == "application/merge-patch+json"
    assert json.loads(pin.body) == {
        "metadata": {"annotations": {"karpenter.sh/do-not-disrupt": "true"}}
    }
    assert json.loads(unpin.body) == {
        "metadata": {"annotations": {"karpenter.sh/do-not-disrupt": None}}
    }
    (delete,) = kmock["delete", PODS]
    assert delete.url.path == f"{PODS_PATH}/w-1"
    assert delete.params == {"gracePeriodSeconds": "3"}


async def test_a_spawn_against_an_unreachable_api_fails_within_the_deadline() -> None:
    """During an API outage a spawn is a `RuntimeFailure` (a spawn failure, which backs the
    pool off) within `create_deadline_s` of virtual time, not after 15.5 s of retries."""
    clock = StepClock()
    cluster = LightkubeCluster(
        namespace=NAMESPACE,
        clock=clock,
        client=client_for("http://127.0.0.1:1"),
        create_deadline_s=5.0,
    )
    runtime = KubernetesRuntime(
        cluster=cluster,
        clock=clock,
        fleet=FLEET,
        instance_id="cp-one",
        activation_key=TEST_ACTIVATION_KEY,
    )
    try:
        with pytest.raises(RuntimeFailure, match=r"cannot create pod w-1: .*no answer within 5s"):
            await runtime.spawn(worker("w-1"), POOL)
        assert 0 < clock.elapsed <= 5.0
    finally:
        await cluster.close()


async def wait_for(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    """Until `check` holds (real HTTP I/O: wall time), failing after `timeout` seconds."""
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.01)


async def test_the_informer_lists_and_watches_its_fleet_only(
    kmock: ContractEmulator, make_runtime: MakeRuntime
) -> None:
    """One list with the fleet selector, then a watch from the list's version; pods of
    other fleets never reach the cache; placeholders go out with their priority class."""
    other = await make_runtime()
    await other.spawn(worker("w-0"), POOL)  # before the list
    runtime = await make_runtime()
    await runtime.start()
    assert [o.worker_id for o in await runtime.list_objects()] == ["w-0"]
    foreign = Pod(
        name="w-foreign",
        labels={"stoker.dev/fleet": "fleet-b", "stoker.dev/worker-id": "w-foreign"},
        spec=PodSpec(containers=(Container(name="worker", image="other:1"),)),
    )
    await other.cluster.create_pod(foreign)
    # Created after the foreign pod: once w-1 is cached, the foreign one would be too.
    await runtime.spawn(worker("w-1"), POOL)

    async def seen() -> bool:
        return {o.worker_id for o in await runtime.list_objects()} == {"w-0", "w-1"}

    await wait_for(seen)
    await runtime.reconcile_headroom([POOL])

    (listing,) = kmock["list", PODS]
    assert listing.params == {"labelSelector": "stoker.dev/fleet=fleet-a"}
    (watch,) = kmock["watch", PODS]
    assert watch.params["labelSelector"] == "stoker.dev/fleet=fleet-a"
    assert int(watch.params["resourceVersion"]) >= 1
    # kmock types a selection as a View; a selected request carries its body.
    placeholder = json.loads(kmock["post", PODS][-1].body)  # type: ignore[attr-defined]
    assert placeholder["metadata"]["labels"]["stoker.dev/placeholder"] == "duck"
    assert "stoker.dev/worker-id" not in placeholder["metadata"]["labels"]
    assert placeholder["spec"]["priorityClassName"] == "stoker-placeholder"
    assert placeholder["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "2", "memory": "4Gi"},
        "limits": {"cpu": "2", "memory": "4Gi"},
    }
    assert placeholder["spec"]["restartPolicy"] == "Never"


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """Puts back the root handlers and the loggers' levels and filters `configure_logging`
    changes."""
    root = logging.getLogger()
    names = ("", *HTTP_CLIENT_LOGGERS, "httpcore", "httpcore2")
    saved = {
        name: (logging.getLogger(name).level, list(logging.getLogger(name).filters))
        for name in names
    }
    handlers = list(root.handlers)
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    for name, (level, filters) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.filters = filters


@pytest.mark.parametrize("level", ["info", "debug"])
@pytest.mark.usefixtures("logging_restored")
async def test_api_requests_are_debug_events(
    kmock: ContractEmulator, make_runtime: MakeRuntime, level: str
) -> None:
    """At the default level a Kubernetes API call logs no line of the HTTP client; at
    debug it logs one `event=http_request` line per request, at debug level."""
    stream = io.StringIO()
    configure_logging(level, stream=stream)
    runtime = await make_runtime()
    await runtime.spawn(worker("w-1"), POOL)
    lines = stream.getvalue().splitlines()
    client_lines = [line for line in lines if "logger=httpx" in line]
    assert not [line for line in lines if "level=info logger=httpx" in line]
    if level == "info":
        assert client_lines == []
        return
    (request,) = client_lines
    assert "level=debug logger=httpx2 event=http_request method=POST" in request
    assert f'url="{kmock.url}'.rstrip("/") + f"{PODS_PATH}?fieldManager=stoker" in request
    assert "status=200 reason=OK" in request
