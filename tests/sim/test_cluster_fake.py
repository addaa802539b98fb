"""The in-process `FakeApiServer`: the ClusterAPI contract plus what only a fake can do.

No Kubernetes cluster can run where these tests run; the fake stands in for one here and
in the simulator, so it must honour resourceVersions, watch history, graceful deletion and
compare-and-set exactly as an API server does. Time-driven tests run on looptime's virtual
clock and assert virtual elapsed time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from looptime import LoopTimeProxy

from cluster_contract import ClusterContract, collect, make_lease, make_pod, summary
from stoker.ports.clock import LoopClock
from stoker.ports.cluster import (
    ClusterError,
    Conflict,
    Container,
    Gone,
    Invalid,
    Pod,
    PodPhase,
    PodSpec,
    Throttled,
    WatchEventType,
)
from stoker.sim.cluster import FakeApiServer

EPOCH = 1_700_000_000.0
POOL = {"stoker.dev/pool": "p"}


class TestFakeApiServerContract(ClusterContract):
    """The shared contract, on the fake standing in for a cluster (none can run here)."""

    @pytest.fixture
    async def cluster(self) -> AsyncIterator[FakeApiServer]:
        server = FakeApiServer(clock=LoopClock(epoch=EPOCH), namespace="workers")
        yield server
        await server.close()


@pytest.fixture
def clock() -> LoopClock:
    """The loop clock the fake cluster keeps its time on."""
    return LoopClock(epoch=EPOCH)


@pytest.fixture
async def server(clock: LoopClock) -> AsyncIterator[FakeApiServer]:
    """A fake cluster keeping only five changes of history, to make compaction easy."""
    fake = FakeApiServer(clock=clock, namespace="workers", history_size=5)
    yield fake
    await fake.close()


async def scheduled(server: FakeApiServer, name: str, *, grace_s: int | None = None) -> Pod:
    """Create a pod and run it on a node, as scheduler and kubelet would."""
    spec = PodSpec(
        containers=(Container(name="worker", image="worker:1"),),
        termination_grace_period_s=grace_s,
    )
    await server.create_pod(Pod(name=name, labels=dict(POOL), spec=spec))
    return server.set_pod_status(
        name, node_name="node-a", phase=PodPhase.RUNNING, ready=True, pod_ip="10.0.0.7"
    )


# -- resourceVersions and watch history ------------------------------------------------------


async def test_watch_older_than_the_history_is_gone(server: FakeApiServer) -> None:
    """Past the history window a watch gets Gone; relisting and watching again works."""
    first = await server.create_pod(make_pod("w-0", labels=POOL))
    for index in range(1, 7):
        await server.create_pod(make_pod(f"w-{index}", labels=POOL))
    # Seven changes, five kept: the changes after w-1's version are all still there.
    with pytest.raises(Gone):
        await anext(server.watch_pods(POOL, first.resource_version))
    from_w1 = server.watch_pods(POOL, str(int(first.resource_version) + 1))
    assert summary(await collect(from_w1, 5)) == [("ADDED", f"w-{i}") for i in range(2, 7)]
    await from_w1.aclose()

    listing = await server.list_pods(POOL)
    watch = server.watch_pods(POOL, listing.resource_version)
    await server.delete_pod("w-3")
    assert summary(await collect(watch, 1)) == [("DELETED", "w-3")]
    await watch.aclose()


async def test_compaction_makes_every_older_version_gone(server: FakeApiServer) -> None:
    """After a compaction only the current version can be watched from."""
    created = await server.create_pod(make_pod("w-1"))
    await server.patch_pod("w-1", annotations={"a": "1"})
    server.compact()
    with pytest.raises(Gone):
        await anext(server.watch_pods({}, created.resource_version))
    watch = server.watch_pods({}, server.resource_version)
    await server.patch_pod("w-1", annotations={"a": "2"})
    assert summary(await collect(watch, 1)) == [("MODIFIED", "w-1")]
    await watch.aclose()


async def test_a_resumed_watch_loses_no_event_across_a_drop(server: FakeApiServer) -> None:
    """A dropped watch ends; resuming from the last version seen replays what was missed."""
    listing = await server.list_pods(POOL)
    watch = server.watch_pods(POOL, listing.resource_version)
    await server.create_pod(make_pod("w-1", labels=POOL))
    seen = await collect(watch, 1)
    assert server.open_watches == 1

    server.drop_watches()
    await server.create_pod(make_pod("w-2", labels=POOL))  # while the watch is going away
    assert [event async for event in watch] == []  # the stream ends instead of hanging
    assert server.open_watches == 0
    await server.patch_pod("w-1", annotations={"b": "1"})  # while nobody watches

    resumed = server.watch_pods(POOL, seen[-1].pod.resource_version)
    seen += await collect(resumed, 2)
    await server.delete_pod("w-2")
    seen += await collect(resumed, 1)
    await resumed.aclose()
    assert summary(seen) == [
        ("ADDED", "w-1"),
        ("ADDED", "w-2"),
        ("MODIFIED", "w-1"),
        ("DELETED", "w-2"),
    ]
    versions = [int(event.pod.resource_version) for event in seen]
    assert versions == sorted(set(versions))


async def test_empty_version_starts_with_the_current_pods(server: FakeApiServer) -> None:
    """Watching from "" sends ADDED for every matching pod, then live changes."""
    await server.create_pod(make_pod("w-1", labels=POOL))
    await server.create_pod(make_pod("w-2"))
    watch = server.watch_pods(POOL, "")
    assert summary(await collect(watch, 1)) == [("ADDED", "w-1")]
    await server.patch_pod("w-1", annotations={"a": "1"})
    assert summary(await collect(watch, 1)) == [("MODIFIED", "w-1")]
    await watch.aclose()


async def test_a_pod_leaving_the_selector_is_deleted_from_that_watch(
    server: FakeApiServer,
) -> None:
    """As the API server's watch cache does: label changes move pods in and out."""
    await server.create_pod(make_pod("w-1", labels={**POOL, "state": "warm"}))
    warm = {**POOL, "state": "warm"}
    watch = server.watch_pods(warm, server.resource_version)
    await server.patch_pod("w-1", labels={"state": "hot"})
    await server.patch_pod("w-1", labels={"state": "warm"})
    events = await collect(watch, 2)
    await watch.aclose()
    assert summary(events) == [("DELETED", "w-1"), ("ADDED", "w-1")]
    assert events[0].pod.labels["state"] == "hot"


async def test_a_no_op_write_does_not_bump_the_version(server: FakeApiServer) -> None:
    """Rewriting what is already there is not a change: no new version, no event."""
    created = await server.create_pod(make_pod("w-1", annotations={"a": "1"}))
    assert (await server.patch_pod("w-1", annotations={"a": "1"})) == created
    assert (await server.patch_pod("w-1", annotations={"gone": None})) == created
    assert server.set_pod_status("w-1", phase=PodPhase.PENDING) == created
    assert server.resource_version == created.resource_version


async def test_an_unconditional_lease_update_is_accepted(server: FakeApiServer) -> None:
    """As in Kubernetes, an update without a resourceVersion skips the compare-and-set."""
    created = await server.create_lease(make_lease(holder="replica-a"))
    forced = await server.update_lease(make_lease(holder="replica-b"))
    assert forced.holder == "replica-b"
    assert int(forced.resource_version) > int(created.resource_version)


async def test_names_and_labels_are_validated(server: FakeApiServer) -> None:
    """What a real API server would refuse is refused here too (422)."""
    with pytest.raises(Invalid):
        await server.create_pod(make_pod("Not_A_Name"))
    with pytest.raises(Invalid):
        await server.create_pod(make_pod("w-1", labels={"stoker.dev/org": "x" * 64}))
    with pytest.raises(Invalid):
        await server.create_pod(Pod(name="w-1", spec=PodSpec(containers=())))
    await server.create_pod(make_pod("w-1"))
    with pytest.raises(Invalid):
        await server.patch_pod("w-1", labels={"bad key!": "v"})
    assert [pod.name for pod in (await server.list_pods({})).items] == ["w-1"]


# -- the cluster side: scheduling, deletion, eviction ----------------------------------------


async def test_status_changes_are_modified_events(server: FakeApiServer) -> None:
    """What the scheduler and kubelet report reaches watchers as MODIFIED events."""
    await server.create_pod(make_pod("w-1", labels=POOL))
    watch = server.watch_pods(POOL, server.resource_version)
    server.set_pod_status("w-1", node_name="node-a")
    server.set_pod_status("w-1", phase=PodPhase.RUNNING, ready=True, pod_ip="10.0.0.7")
    events = await collect(watch, 2)
    await watch.aclose()
    assert [event.type for event in events] == [WatchEventType.MODIFIED] * 2
    assert events[0].pod.node_name == "node-a" and not events[0].pod.ready
    assert events[1].pod.ready and events[1].pod.pod_ip == "10.0.0.7"
    assert events[1].pod.phase == PodPhase.RUNNING


@pytest.mark.looptime
async def test_graceful_delete_takes_the_grace_period(
    server: FakeApiServer, clock: LoopClock, looptime: LoopTimeProxy
) -> None:
    """The pod is marked with its deletion time and removed when the grace ends."""
    await scheduled(server, "w-1")
    watch = server.watch_pods(POOL, server.resource_version)
    start = float(looptime)
    deadline = clock.now() + 20
    await server.delete_pod("w-1", grace_s=20)

    terminating = await server.get_pod("w-1")
    assert terminating is not None
    assert terminating.deletion_timestamp == pytest.approx(deadline)
    assert [pod.name for pod in (await server.list_pods(POOL)).items] == ["w-1"]

    events = await collect(watch, 2, timeout_s=60)
    await watch.aclose()
    assert summary(events) == [("MODIFIED", "w-1"), ("DELETED", "w-1")]
    assert float(looptime) - start == pytest.approx(20)
    assert await server.get_pod("w-1") is None


@pytest.mark.looptime
async def test_the_pods_own_grace_period_applies_by_default(
    server: FakeApiServer, looptime: LoopTimeProxy
) -> None:
    """delete_pod without grace uses spec.terminationGracePeriodSeconds."""
    await scheduled(server, "w-1", grace_s=5)
    watch = server.watch_pods(POOL, server.resource_version)
    start = float(looptime)
    await server.delete_pod("w-1")
    assert summary(await collect(watch, 2, timeout_s=60)) == [
        ("MODIFIED", "w-1"),
        ("DELETED", "w-1"),
    ]
    await watch.aclose()
    assert float(looptime) - start == pytest.approx(5)


@pytest.mark.looptime
async def test_a_shorter_second_delete_shortens_the_grace(
    server: FakeApiServer, looptime: LoopTimeProxy
) -> None:
    """A second, shorter delete moves the deadline forward; a longer one never extends it."""
    await scheduled(server, "w-1")
    watch = server.watch_pods(POOL, server.resource_version)
    start = float(looptime)
    await server.delete_pod("w-1", grace_s=30)
    await server.delete_pod("w-1", grace_s=4)
    await server.delete_pod("w-1", grace_s=60)
    events = await collect(watch, 3, timeout_s=120)
    await watch.aclose()
    assert summary(events) == [("MODIFIED", "w-1"), ("MODIFIED", "w-1"), ("DELETED", "w-1")]
    assert float(looptime) - start == pytest.approx(4)


async def test_an_unscheduled_pod_is_deleted_at_once(server: FakeApiServer) -> None:
    """No kubelet runs it, so the API server does not wait for one."""
    await server.create_pod(make_pod("w-1", labels=POOL))
    watch = server.watch_pods(POOL, server.resource_version)
    await server.delete_pod("w-1", grace_s=30)
    assert await server.get_pod("w-1") is None
    assert summary(await collect(watch, 1)) == [("DELETED", "w-1")]
    await watch.aclose()


async def test_kubelet_eviction_leaves_a_failed_pod(server: FakeApiServer) -> None:
    """Node-pressure eviction: the pod stays, Failed with reason Evicted."""
    await scheduled(server, "w-1")
    server.evict("w-1")
    evicted = await server.get_pod("w-1")
    assert evicted is not None
    assert (evicted.phase, evicted.reason, evicted.ready) == (PodPhase.FAILED, "Evicted", False)
    await server.delete_pod("w-1")  # a finished pod goes at once
    assert await server.get_pod("w-1") is None


async def test_api_eviction_deletes_gracefully(server: FakeApiServer) -> None:
    """Drain-style eviction: a graceful deletion with the pod's grace period."""
    await scheduled(server, "w-1", grace_s=10)
    server.evict("w-1", delete=True)
    evicting = await server.get_pod("w-1")
    assert evicting is not None and evicting.deletion_timestamp is not None


# -- fault injection -------------------------------------------------------------------------


async def test_injected_faults_fail_exactly_the_next_calls(server: FakeApiServer) -> None:
    """fail_next makes N calls of one operation fail, then the cluster works again."""
    server.fail_next("create_pod", Throttled("slow down"), times=2)
    for _ in range(2):
        with pytest.raises(Throttled):
            await server.create_pod(make_pod("w-1"))
    created = await server.create_pod(make_pod("w-1"))
    assert server.calls["create_pod"] == 3
    assert [pod.name for pod in (await server.list_pods({})).items] == [created.name]

    lease = await server.create_lease(make_lease())
    server.fail_next("update_lease", Conflict("injected"))
    with pytest.raises(Conflict):
        await server.update_lease(lease)
    assert (await server.update_lease(lease)).holder == lease.holder

    with pytest.raises(ValueError):
        server.fail_next("replace_pod", Conflict("no such operation"))


@pytest.mark.looptime
async def test_latency_is_spent_on_the_virtual_clock(
    server: FakeApiServer, looptime: LoopTimeProxy
) -> None:
    """Per-call latency delays each call by exactly that much loop time, concurrently."""
    server.set_latency(0.5)
    server.set_latency(2.5, "list_pods")
    start = float(looptime)
    await server.create_pod(make_pod("w-1"))
    assert float(looptime) - start == pytest.approx(0.5)

    start = float(looptime)
    listings = await asyncio.gather(*(server.list_pods({}) for _ in range(10)))
    assert float(looptime) - start == pytest.approx(2.5)  # in parallel, not one after another
    assert all(len(listing.items) == 1 for listing in listings)


async def test_a_closed_server_ends_watches_and_refuses_calls(server: FakeApiServer) -> None:
    """close() ends open watches and every later call fails."""
    watch = server.watch_pods({}, server.resource_version)
    await server.create_pod(make_pod("w-1"))
    assert summary(await collect(watch, 1)) == [("ADDED", "w-1")]
    await server.close()
    assert [event async for event in watch] == []
    with pytest.raises(ClusterError):
        await server.get_pod("w-1")
