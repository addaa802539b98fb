"""The lightkube adapter against a mock Kubernetes API server at the HTTP level (kmock).

No Kubernetes cluster can run where these tests run; kmock's emulator stands in for the
API server, so the adapter's real HTTP requests are made, recorded and asserted. kmock 0.8
lacks parts of the API server the contract needs (see `ContractEmulator`); what it cannot
decide — compare-and-set conflicts, throttling, server errors — is scripted with its DSL.

Sleeps of the adapter (backoff, request budget) go to a `StepClock` that records them and
moves its own time forward at once, so timing is asserted on the injected clock, never on
the wall clock.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import kmock
import pytest
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User
from looptime import LoopTimeProxy

from cluster_contract import ClusterContract, collect, make_lease, make_pod, summary
from stoker.adapters.cluster_lightkube import LightkubeCluster
from stoker.ports.clock import LoopClock, TokenBucket
from stoker.ports.cluster import (
    ClusterAPI,
    ClusterUnavailable,
    Condition,
    Conflict,
    Container,
    Forbidden,
    Gone,
    Invalid,
    Lease,
    Pod,
    PodSpec,
    PreferredNodes,
    Throttled,
    Toleration,
    Waiting,
)

NAMESPACE = "workers"
PODS = kmock.resource("", "v1", "pods")
LEASES = kmock.resource("coordination.k8s.io", "v1", "leases")
PODS_PATH = f"/api/v1/namespaces/{NAMESPACE}/pods"
LEASES_PATH = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases"
_CREATED_BASE = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A Kubernetes Status body, as the API server sends with an error."""
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


def _selector(text: str) -> dict[str, str]:
    pairs = (term.split("=", 1) for term in text.split(",") if term)
    return {key.rstrip("="): value.lstrip("=") for key, value in pairs}


def _selected(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(key) == value for key, value in selector.items())


class ContractEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator plus the API-server behaviour the contract relies on.

    kmock 0.8 stores objects and merges patches, but (read in kmock/_internal/k8s.py) its
    writes carry no resourceVersion and its lists report "...", it ignores label
    selectors, its watches always start with ADDED for every object and ignore the
    resourceVersion, and it routes no PUT at all (404). This adds a global resourceVersion
    stamped on every write, equality label selectors on list and watch, PUT as a full
    replacement, and watches that replay every change after their resourceVersion.

    It does not compare resourceVersions on PUT: kmock has no compare-and-set, so the
    CAS tests are skipped on it, and the adapter's handling of a 409 is tested with a
    scripted response instead.
    """

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.rv = 0
        self.log: list[tuple[int, Any, str | None, dict[str, Any]]] = []
        self._write_lock = asyncio.Lock()
        self._logged = asyncio.Condition()
        for resource, kind in ((PODS, "Pod"), (LEASES, "Lease")):
            self.resources[resource] = kmock.ResourceInfo(
                namespaced=True, kind=kind, verbs={"create", "get", "list", "watch", "update"}
            )
        self.fallback["put"] << self._serve_replace

    async def _append(self, rv: int, request: Any, kind: str, obj: dict[str, Any]) -> None:
        async with self._logged:
            event = {"type": kind, "object": copy.deepcopy(obj)}
            self.log.append((rv, request.resource, request.namespace, event))
            self._logged.notify_all()

    async def _handle(self, request: Any) -> Any:
        action = request.action
        writes = (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE)
        if request.resource not in (PODS, LEASES) or action not in writes:
            return await super()._handle(request)
        async with self._write_lock:  # stamp, store and log in one order
            self.rv += 1
            rv = self.rv
            if action == kmock.action.CREATE:
                meta = request.data.setdefault("metadata", {})
                name = meta["name"]
                created = _CREATED_BASE + datetime.timedelta(seconds=rv)
                meta.update(
                    resourceVersion=str(rv),
                    uid=f"uid-{rv}",
                    creationTimestamp=created.strftime("%Y-%m-%dT%H:%M:%SZ"),
                )
                if request.resource == PODS:
                    request.data.setdefault("status", {"phase": "Pending"})
            else:
                name = request.name
                key = (request.resource, request.namespace, name)
                if action == kmock.action.UPDATE:
                    request.data.setdefault("metadata", {})["resourceVersion"] = str(rv)
                elif key in self.objects and not self.objects[key].deleted:
                    stored = self.objects[key]
                    # Through .raw: item access wraps nested dicts in kmock's views.
                    stored["metadata"] = {**stored.raw["metadata"], "resourceVersion": str(rv)}
            response = await super()._handle(request)
            if response.status < 300:
                stored = self.objects[request.resource, request.namespace, name]
                kind = {"CREATE": "ADDED", "UPDATE": "MODIFIED", "DELETE": "DELETED"}
                await self._append(rv, request, kind[action.value], stored.last.raw)
            return response

    async def _serve_replace(self, request: Any) -> dict[str, Any]:
        key = (request.resource, request.namespace, request.name)
        if request.resource not in (PODS, LEASES) or request.name is None:
            raise kmock.KubernetesEndpointNotFoundError()
        async with self._write_lock:
            if key not in self.objects or self.objects[key].deleted:
                raise kmock.KubernetesObjectNotFoundError()
            self.rv += 1
            old_meta = self.objects[key].raw["metadata"]
            body = dict(request.data)
            body["metadata"] = {
                **body.get("metadata", {}),
                "resourceVersion": str(self.rv),
                "uid": old_meta["uid"],
                "creationTimestamp": old_meta["creationTimestamp"],
            }
            self.objects[key].create(body)  # a new full version, not a merge
            await self._append(self.rv, request, "MODIFIED", body)
            return body

    async def _serve_list(self, request: Any) -> dict[str, Any]:
        listing: Any = await super()._serve_list(request)
        selector = _selector(request.params.get("labelSelector", ""))
        return {
            "metadata": {"resourceVersion": str(self.rv)},
            "items": [item for item in listing["items"] if _selected(item, selector)],
        }

    async def _serve_watch(self, request: Any) -> AsyncIterator[Any]:
        yield b""  # send the headers now: the client waits for them before streaming
        selector = _selector(request.params.get("labelSelector", ""))
        since = request.params.get("resourceVersion", "")
        if since in ("", "0"):
            async with self._write_lock:
                cursor = self.rv
                current = [
                    obj.raw
                    for (resource, namespace, _), obj in self.objects.items()
                    if resource == request.resource
                    and namespace == request.namespace
                    and not obj.deleted
                ]
            for obj in current:
                if _selected(obj, selector):
                    yield {"type": "ADDED", "object": obj}
        else:
            cursor = int(since)
        while True:
            for rv, resource, namespace, event in list(self.log):
                if rv <= cursor:
                    continue
                cursor = rv
                same_place = resource == request.resource and namespace == request.namespace
                if same_place and _selected(event["object"], selector):
                    yield event
            await self._wait_past(cursor)

    async def _wait_past(self, cursor: int) -> None:
        """Until a change newer than `cursor` is logged."""
        async with self._logged:
            await self._logged.wait_for(lambda: bool(self.log) and self.log[-1][0] > cursor)


pytestmark = pytest.mark.kmock(cls=ContractEmulator)


class StepClock:
    """A Clock whose sleeps take no real time: each one moves it forward at once."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.start = start
        self.time = start
        self.slept: list[float] = []

    def now(self) -> float:
        return self.time

    def monotonic(self) -> float:
        return self.time

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.time += max(0.0, seconds)
        await asyncio.sleep(0)

    @property
    def elapsed(self) -> float:
        return self.time - self.start


def client_for(url: str) -> AsyncClient:
    """A lightkube client for a plain-HTTP test server.

    `KubeConfig.from_server` is not enough: lightkube refuses a config without a user.
    """
    config = KubeConfig.from_one(
        cluster=Cluster(server=url), user=User(token="test-token"), namespace=NAMESPACE
    )
    return AsyncClient(config=config, trust_env=False)


MakeCluster = Callable[..., Awaitable[LightkubeCluster]]


@pytest.fixture
async def make_cluster(kmock: ContractEmulator) -> AsyncIterator[MakeCluster]:
    """Build adapters on the kmock server (or another URL); all are closed at the end."""
    made: list[LightkubeCluster] = []

    async def make(
        *, url: str | None = None, clock: StepClock | None = None, **limits: Any
    ) -> LightkubeCluster:
        cluster = LightkubeCluster(
            namespace=NAMESPACE,
            clock=clock or StepClock(),
            client=client_for(url or str(kmock.url)),
            **limits,
        )
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        await cluster.close()


class TestLightkubeContract(ClusterContract):
    """The shared contract, the adapter talking HTTP to kmock: no real cluster can run here."""

    @pytest.fixture
    async def cluster(self, make_cluster: MakeCluster) -> LightkubeCluster:
        return await make_cluster()

    @pytest.mark.skip(reason="kmock 0.8 does not compare resourceVersions on update")
    async def test_update_with_a_stale_version_conflicts(self, cluster: ClusterAPI) -> None:
        """Skipped: kmock's emulator updates without checking the resourceVersion, so it
        cannot refuse a stale one. The adapter sends the resourceVersion and maps a 409 to
        Conflict without retrying: see test_update_lease_conflict_is_not_retried."""

    @pytest.mark.skip(reason="kmock 0.8 does not compare resourceVersions on update")
    async def test_concurrent_updaters_exactly_one_wins(self, cluster: ClusterAPI) -> None:
        """Skipped: without a compare-and-set in kmock both updates would succeed; the
        decision is the API server's, and the fake's contract run covers the semantics."""


# -- the exact requests --------------------------------------------------------------------


async def test_create_pod_sends_the_whole_spec(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """POST body: labels, annotations, requests == limits, restartPolicy Never, no owner."""
    cluster = await make_cluster()
    pod = Pod(
        name="w-1",
        labels={"stoker.dev/pool": "p", "stoker.dev/worker": "w-1"},
        annotations={"stoker.dev/revision": "abc"},
        spec=PodSpec(
            containers=(
                Container(
                    name="worker",
                    image="ghcr.io/example/worker:1",
                    command=("/bin/worker",),
                    args=("--port", "8080"),
                    env={"STOKER_WORKER_ID": "w-1"},
                    cpu="500m",
                    memory="256Mi",
                    ports=(8080,),
                ),
            ),
            node_selector={"pool": "workers"},
            preferred_nodes=(
                PreferredNodes(100, ("node-a",)),
                PreferredNodes(34, ("node-b", "node-c")),
            ),
            tolerations=(Toleration(key="dedicated", value="workers", effect="NoSchedule"),),
            priority_class_name="stoker-workers",
            service_account_name="worker",
            termination_grace_period_s=10,
        ),
    )
    await cluster.create_pod(pod)

    (post,) = kmock["post", PODS]
    assert post.url.path == PODS_PATH
    assert post.params == {"fieldManager": "stoker"}
    assert post.headers["Content-Type"] == "application/json"
    sent = json.loads(post.body)  # the bytes on the wire, before the emulator stamps them
    assert sent["metadata"] == {
        "name": "w-1",
        "namespace": NAMESPACE,
        "labels": {"stoker.dev/pool": "p", "stoker.dev/worker": "w-1"},
        "annotations": {"stoker.dev/revision": "abc"},
    }
    assert "ownerReferences" not in sent["metadata"]
    assert sent["spec"] == {
        "containers": [
            {
                "name": "worker",
                "image": "ghcr.io/example/worker:1",
                "command": ["/bin/worker"],
                "args": ["--port", "8080"],
                "env": [{"name": "STOKER_WORKER_ID", "value": "w-1"}],
                "resources": {
                    "requests": {"cpu": "500m", "memory": "256Mi"},
                    "limits": {"cpu": "500m", "memory": "256Mi"},
                },
                "ports": [{"containerPort": 8080}],
            }
        ],
        "nodeSelector": {"pool": "workers"},
        "affinity": {
            "nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": weight,
                        "preference": {
                            "matchExpressions": [
                                {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}
                            ]
                        },
                    }
                    for weight, nodes in [(100, ["node-a"]), (34, ["node-b", "node-c"])]
                ]
            }
        },
        "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "workers", "effect": "NoSchedule"}
        ],
        "priorityClassName": "stoker-workers",
        "serviceAccountName": "worker",
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 10,
    }
    assert (sent["apiVersion"], sent["kind"]) == ("v1", "Pod")
    assert set(sent) == {"apiVersion", "kind", "metadata", "spec"}
    # Read back, the preferred nodes are the ones sent.
    read = await cluster.get_pod("w-1")
    assert read is not None and read.spec.preferred_nodes == pod.spec.preferred_nodes


async def test_list_and_watch_send_the_label_selector(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """The selector travels as labelSelector; the watch starts at the list's version."""
    cluster = await make_cluster()
    selector = {"stoker.dev/pool": "p", "stoker.dev/state": "warm"}
    listing = await cluster.list_pods(selector)
    watch = cluster.watch_pods(selector, listing.resource_version)
    await cluster.create_pod(make_pod("w-1", labels=selector))
    assert summary(await collect(watch, 1)) == [("ADDED", "w-1")]
    await watch.aclose()

    (list_request,) = kmock["list", PODS]
    assert list_request.url.path == PODS_PATH
    assert list_request.params == {"labelSelector": "stoker.dev/pool=p,stoker.dev/state=warm"}
    (watch_request,) = kmock["watch", PODS]
    assert watch_request.url.path == PODS_PATH
    assert watch_request.params == {
        "watch": "true",
        "resourceVersion": listing.resource_version,
        "labelSelector": "stoker.dev/pool=p,stoker.dev/state=warm",
    }


async def test_an_empty_selector_sends_no_label_selector(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """An empty selector lists everything, so no labelSelector parameter is sent at all."""
    cluster = await make_cluster()
    await cluster.list_pods({})
    (list_request,) = kmock["list", PODS]
    assert list_request.params == {}


async def test_do_not_disrupt_toggle_is_a_merge_patch(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """Setting and removing karpenter.sh/do-not-disrupt: two JSON merge patches."""
    cluster = await make_cluster()
    await cluster.create_pod(make_pod("w-1", annotations={"keep": "me"}))
    pinned = await cluster.patch_pod("w-1", annotations={"karpenter.sh/do-not-disrupt": "true"})
    unpinned = await cluster.patch_pod("w-1", annotations={"karpenter.sh/do-not-disrupt": None})

    set_request, remove_request = kmock["patch", PODS]
    for request in (set_request, remove_request):
        assert request.url.path == f"{PODS_PATH}/w-1"
        assert request.headers["Content-Type"] == "application/merge-patch+json"
        assert request.params == {"fieldManager": "stoker"}
    assert json.loads(set_request.body) == {
        "metadata": {"annotations": {"karpenter.sh/do-not-disrupt": "true"}}
    }
    assert json.loads(remove_request.body) == {
        "metadata": {"annotations": {"karpenter.sh/do-not-disrupt": None}}
    }
    assert pinned.annotations == {"keep": "me", "karpenter.sh/do-not-disrupt": "true"}
    assert unpinned.annotations == {"keep": "me"}


async def test_admit_pod_is_a_dry_run_create(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """`config check --connect`'s question: the pod is POSTed with dryRun=All."""
    cluster = await make_cluster()
    await cluster.admit_pod(make_pod("w-1"))
    [sent] = kmock["create", PODS]
    assert sent.params["dryRun"] == "All"
    assert json.loads(sent.body)["metadata"]["name"] == "w-1"


@pytest.mark.parametrize(
    ("status", "message", "error"),
    [
        (422, 'Pod "w-1" is invalid: spec.containers[0].image: Invalid value', Invalid),
        (403, 'pods "w-1" is forbidden: exceeded quota: q, requested: pods=1', Forbidden),
        (409, 'pods "w-1" already exists', None),
    ],
)
async def test_admit_pod_says_why_the_api_server_refuses_it(
    kmock: ContractEmulator,
    make_cluster: MakeCluster,
    status: int,
    message: str,
    error: type[Exception] | None,
) -> None:
    """The refusal is the port's error with the API server's words, asked once; a name
    taken already is no objection to the pod."""
    cluster = await make_cluster()
    kmock["create", PODS] << status << _status(status, "Refused", message)
    if error is None:
        await cluster.admit_pod(make_pod("w-1"))
    else:
        with pytest.raises(error) as caught:
            await cluster.admit_pod(make_pod("w-1"))
        assert message in str(caught.value)
    assert len(kmock["create", PODS]) == 1


async def test_delete_sends_the_grace_in_whole_seconds(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """gracePeriodSeconds is an integer: a fractional grace is rounded up, never down."""
    cluster = await make_cluster()
    await cluster.create_pod(make_pod("w-1"))
    await cluster.delete_pod("w-1", grace_s=2.5)
    await cluster.delete_pod("w-1")  # already gone: a 404, which is fine
    first, second = kmock["delete", PODS]
    assert first.url.path == f"{PODS_PATH}/w-1"
    assert first.params == {"gracePeriodSeconds": "3"}
    assert second.params == {}


async def test_update_lease_replaces_with_the_resource_version(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """PUT carries metadata.resourceVersion (the API server's CAS) and six-digit MicroTimes."""
    cluster = await make_cluster()
    created = await cluster.create_lease(make_lease())
    renewed = Lease(
        name=created.name,
        holder="replica-a",
        acquire_time=1_700_000_000.0,
        renew_time=1_700_000_010.0,
        duration_s=15,
        transitions=0,
        resource_version=created.resource_version,
    )
    stored = await cluster.update_lease(renewed)

    (put,) = kmock["put", LEASES]
    assert put.url.path == f"{LEASES_PATH}/stoker-janitor"
    assert put.params == {"fieldManager": "stoker"}
    assert json.loads(put.body) == {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": "stoker-janitor",
            "namespace": NAMESPACE,
            "resourceVersion": created.resource_version,
        },
        "spec": {
            "holderIdentity": "replica-a",
            "acquireTime": "2023-11-14T22:13:20.000000Z",
            "renewTime": "2023-11-14T22:13:30.000000Z",
            "leaseDurationSeconds": 15,
            "leaseTransitions": 0,
        },
    }
    assert stored.renew_time == 1_700_000_010.0
    assert int(stored.resource_version) > int(created.resource_version)


async def test_create_lease_sends_no_resource_version(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """The API server refuses a create that carries a resourceVersion."""
    cluster = await make_cluster()
    await cluster.create_lease(Lease(name="l", holder="a", resource_version="17"))
    (post,) = kmock["post", LEASES]
    assert post.url.path == LEASES_PATH
    assert "resourceVersion" not in json.loads(post.body)["metadata"]


# -- errors and retries --------------------------------------------------------------------


async def test_update_lease_conflict_is_not_retried(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """A 409 on PUT is another replica's win: Conflict at once, one request, no sleep."""
    clock = StepClock()
    cluster = await make_cluster(clock=clock)
    created = await cluster.create_lease(make_lease())
    kmock["put", LEASES] << 409 << _status(409, "Conflict", "the object has been modified")
    with pytest.raises(Conflict, match="the object has been modified"):
        await cluster.update_lease(make_lease(holder="replica-b"))
    assert len(kmock["put", LEASES]) == 1
    assert clock.slept == []
    assert await cluster.get_lease(created.name) == created


async def test_a_throttled_request_is_retried_after_retry_after(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """429 then 200: one retry, after the server's Retry-After (longer than the backoff)."""
    clock = StepClock()
    cluster = await make_cluster(clock=clock, backoff_s=0.5)
    await cluster.create_pod(make_pod("w-1"))
    kmock["list", PODS][:1] << 429 << {"Retry-After": "2"} << _status(429, "TooMany", "slow")
    listing = await cluster.list_pods({})
    assert [pod.name for pod in listing.items] == ["w-1"]
    assert len(kmock["list", PODS]) == 2
    assert clock.slept == [2.0]


@pytest.mark.parametrize(
    ("status", "error"),
    [(400, Invalid), (403, Forbidden), (422, Invalid), (401, Forbidden)],
)
async def test_client_errors_are_not_retried(
    kmock: ContractEmulator,
    make_cluster: MakeCluster,
    status: int,
    error: type[Exception],
) -> None:
    """400/401/403/422 are answers: the mapped error at once, after exactly one request."""
    clock = StepClock()
    cluster = await make_cluster(clock=clock)
    kmock["list", PODS] << status << _status(status, "Refused", f"refused with {status}")
    with pytest.raises(error, match=f"refused with {status}"):
        await cluster.list_pods({"stoker.dev/pool": "p"})
    assert len(kmock["list", PODS]) == 1
    assert clock.slept == []


async def test_server_errors_are_retried_with_exponential_backoff(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """A 5xx is retried max_retries times, doubling the delay, then ClusterUnavailable."""
    clock = StepClock()
    cluster = await make_cluster(clock=clock, max_retries=3, backoff_s=0.5)
    kmock["fetch", PODS] << 503 << _status(503, "ServiceUnavailable", "etcd is busy")
    with pytest.raises(ClusterUnavailable, match="etcd is busy"):
        await cluster.get_pod("w-1")
    assert len(kmock["fetch", PODS]) == 4
    assert clock.slept == [0.5, 1.0, 2.0]


async def test_throttling_that_persists_is_throttled(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """When every attempt is throttled the caller learns so, with the server's hint."""
    cluster = await make_cluster(max_retries=1)
    kmock["list", PODS] << 429 << {"Retry-After": "3"} << _status(429, "TooMany", "slow")
    with pytest.raises(Throttled) as caught:
        await cluster.list_pods({})
    assert caught.value.retry_after == 3.0
    assert len(kmock["list", PODS]) == 2


async def test_connection_errors_are_retried(make_cluster: MakeCluster) -> None:
    """Nothing listens on the port: retried with backoff, then ClusterUnavailable."""
    clock = StepClock()
    cluster = await make_cluster(url="http://127.0.0.1:1", clock=clock, max_retries=2)
    with pytest.raises(ClusterUnavailable, match="ConnectError"):
        await cluster.get_lease("stoker-janitor")
    assert clock.slept == [0.5, 1.0]


async def test_a_create_stops_retrying_at_its_deadline(make_cluster: MakeCluster) -> None:
    """Nothing listens: a pod create makes no retry that would start past
    `create_deadline_s` (5 s: retries after 0.5, 1 and 2 s, not after 4 more), while other
    requests keep their `max_retries`."""
    clock = StepClock()
    cluster = await make_cluster(url="http://127.0.0.1:1", clock=clock, create_deadline_s=5.0)
    with pytest.raises(ClusterUnavailable, match=r"no answer within 5s \(4 attempts"):
        await cluster.create_pod(make_pod("w-1"))
    assert clock.slept == [0.5, 1.0, 2.0]
    assert clock.elapsed <= 5.0
    clock.slept.clear()
    with pytest.raises(ClusterUnavailable, match="ConnectError"):
        await cluster.get_pod("w-1")
    assert clock.slept == [0.5, 1.0, 2.0, 4.0, 8.0]


# -- watches -------------------------------------------------------------------------------


async def test_a_pending_pods_status_is_read(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """PodScheduled, the nominated node, the container's waiting reason and its start
    reach the port's Pod."""
    cluster = await make_cluster()
    meta = {"name": "w-1", "namespace": NAMESPACE, "resourceVersion": "7"}
    spec = {"containers": [{"name": "worker", "image": "x"}]}
    unschedulable = {
        "phase": "Pending",
        "nominatedNodeName": "node-b",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient cpu.",
            }
        ],
    }
    pulling = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "True"}],
        "containerStatuses": [
            {
                "name": "worker",
                "image": "x",
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": {"waiting": {"reason": "ImagePullBackOff", "message": "not found"}},
            }
        ],
    }
    running = {
        "phase": "Running",
        "containerStatuses": [
            {
                "name": "worker",
                "image": "x",
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": {"running": {"startedAt": "2026-12-06T06:00:00Z"}},
            }
        ],
    }
    kmock["watch", PODS] << tuple(
        {"type": "MODIFIED", "object": {"metadata": meta, "spec": spec, "status": status}}
        for status in (unschedulable, pulling, running)
    )
    watch = cluster.watch_pods({}, "5")
    first, second, third = [(await anext(watch)).pod for _ in range(3)]
    await watch.aclose()
    assert first.scheduled == Condition(
        "False", "Unschedulable", "0/3 nodes are available: 3 Insufficient cpu."
    )
    assert (first.nominated_node, first.waiting, first.started_at) == ("node-b", None, None)
    assert second.scheduled == Condition("True")
    assert second.waiting == Waiting("ImagePullBackOff", "not found")
    assert (third.waiting, third.started_at) == (None, 1796536800.0)


async def test_a_410_error_event_in_the_watch_is_gone(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """An ERROR event with code 410 mid-stream: Gone, so the caller lists again."""
    cluster = await make_cluster()
    kmock["watch", PODS] << (
        {"type": "ERROR", "object": _status(410, "Expired", "too old resource version: 5 (90)")},
    )
    watch = cluster.watch_pods({}, "5")
    with pytest.raises(Gone, match="too old resource version"):
        await anext(watch)
    assert len(kmock["watch", PODS]) == 1


async def test_a_410_status_on_the_watch_is_gone(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """The API server may also refuse the watch itself with HTTP 410."""
    cluster = await make_cluster()
    kmock["watch", PODS] << 410 << _status(410, "Expired", "too old resource version")
    with pytest.raises(Gone):
        await anext(cluster.watch_pods({}, "5"))


async def test_a_failed_watch_reopens_from_the_last_version(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """A 503 on opening the watch is retried from the same version; no change is lost."""
    clock = StepClock()
    cluster = await make_cluster(clock=clock)
    listing = await cluster.list_pods({})
    await cluster.create_pod(make_pod("w-1"))
    kmock["watch", PODS][:1] << 503 << _status(503, "ServiceUnavailable", "restarting")
    watch = cluster.watch_pods({}, listing.resource_version)
    assert summary(await collect(watch, 1)) == [("ADDED", "w-1")]
    await watch.aclose()
    first, second = kmock["watch", PODS]
    assert first.params["resourceVersion"] == second.params["resourceVersion"]
    assert clock.slept == [0.5]


# -- the request budget --------------------------------------------------------------------


async def test_the_request_budget_paces_requests(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """qps=5, burst=1: N requests take (N-1)/5 s of the injected clock, no more, no less."""
    clock = StepClock()
    cluster = await make_cluster(clock=clock, qps=5, burst=1)
    count = 6
    await asyncio.gather(*(cluster.get_pod(f"w-{index}") for index in range(count)))
    assert len(kmock["fetch", PODS]) == count
    assert clock.elapsed == pytest.approx((count - 1) / 5)


@pytest.mark.looptime
async def test_the_request_budget_never_spins_on_a_virtual_clock(looptime: LoopTimeProxy) -> None:
    """Float rounding can leave a token a hair short after its wait; it still counts.

    A bucket that waited for that hair again would spin forever on looptime (timers due
    within the clock's resolution fire without the loop's time moving).
    """
    budget = TokenBucket(LoopClock(), rate=5, burst=1)
    start = float(looptime)
    for _ in range(26):
        await budget.acquire()
    assert float(looptime) - start == pytest.approx(25 / 5)


@pytest.mark.looptime
async def test_the_request_budget_runs_on_loop_time(
    kmock: ContractEmulator, looptime: LoopTimeProxy
) -> None:
    """The same pacing on a LoopClock: at least (N-1)/5 s of virtual loop time pass.

    Only a lower bound: looptime may also skip ahead while HTTP bytes are in flight.
    """
    cluster = LightkubeCluster(
        namespace=NAMESPACE, clock=LoopClock(), client=client_for(str(kmock.url)), qps=5, burst=1
    )
    count = 6
    start = float(looptime)
    try:
        found = await asyncio.gather(*(cluster.get_pod(f"w-{index}") for index in range(count)))
    finally:
        await cluster.close()
    assert found == [None] * count
    assert float(looptime) - start >= (count - 1) / 5 - 1e-6


async def test_a_burst_is_served_without_waiting(
    kmock: ContractEmulator, make_cluster: MakeCluster
) -> None:
    """Up to `burst` requests go out at once; the budget only paces what exceeds it."""
    clock = StepClock()
    cluster = await make_cluster(clock=clock, qps=5, burst=4)
    for index in range(4):
        await cluster.get_pod(f"w-{index}")
    assert clock.slept == []
    await cluster.get_pod("w-4")
    assert clock.elapsed == pytest.approx(0.2)


async def test_build_client_reads_a_kubeconfig(tmp_path: Path) -> None:
    """The factory builds a client from a kubeconfig file and one of its contexts."""
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: a\n"
        "clusters:\n"
        "- {name: a, cluster: {server: 'http://a.example:6443'}}\n"
        "- {name: b, cluster: {server: 'http://b.example:6443'}}\n"
        "users:\n- {name: u, user: {token: t}}\n"
        "contexts:\n"
        "- {name: a, context: {cluster: a, user: u, namespace: ns-a}}\n"
        "- {name: b, context: {cluster: b, user: u, namespace: ns-b}}\n"
    )
    client = LightkubeCluster.build_client(kubeconfig=str(kubeconfig), context="b")
    try:
        assert client.config.cluster.server == "http://b.example:6443"
        assert client.namespace == "ns-b"
    finally:
        await client.close()
