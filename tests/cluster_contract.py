"""The ClusterAPI contract: what every cluster adapter must do, run against each of them.

No Kubernetes cluster can run where these tests run, so the subclasses stand in for one:
`tests/sim/test_cluster_fake.py` runs the suite on the in-process `FakeApiServer`, and
`tests/adapters/test_cluster_lightkube.py` on the lightkube adapter talking HTTP to a kmock API
server. A subclass provides an async `cluster` fixture: a `ClusterAPI` on an empty namespace.

Kubernetes calls resourceVersions opaque; the ordering tests below compare them as integers
because etcd-backed API servers, the fake and the mock all issue increasing integers, and
the simulator's replay of history depends on exactly that order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from stoker.ports.cluster import (
    ClusterAPI,
    Conflict,
    Container,
    Lease,
    ObjectNotFound,
    Pod,
    PodPhase,
    PodSpec,
    WatchEvent,
)

#: A renew time on a whole second (as virtual clocks produce) and one with a fraction.
WHOLE_SECOND = 1_700_000_000.0
FRACTION = 1_700_000_007.25


def make_pod(
    name: str,
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> Pod:
    """A small worker pod as the Kubernetes runtime would create it."""
    return Pod(
        name=name,
        labels=labels or {},
        annotations=annotations or {},
        spec=PodSpec(
            containers=(
                Container(
                    name="worker",
                    image="ghcr.io/example/worker:1",
                    env={"STOKER_WORKER_ID": name},
                    cpu="500m",
                    memory="256Mi",
                    ports=(8080,),
                ),
            ),
        ),
    )


def make_lease(name: str = "stoker-janitor", holder: str = "replica-a") -> Lease:
    """A freshly acquired janitor lease."""
    return Lease(
        name=name,
        holder=holder,
        acquire_time=WHOLE_SECOND,
        renew_time=FRACTION,
        duration_s=15,
        transitions=0,
    )


async def collect(
    events: AsyncIterator[WatchEvent], count: int, *, timeout_s: float = 10
) -> list[WatchEvent]:
    """The next `count` events; fails (rather than hangs) when they do not come in time."""
    received: list[WatchEvent] = []
    async with asyncio.timeout(timeout_s):
        async for event in events:
            received.append(event)
            if len(received) == count:
                break
    return received


def summary(events: list[WatchEvent]) -> list[tuple[str, str]]:
    """(type, pod name) of each event: what a reader of the stream can rely on."""
    return [(event.type.value, event.pod.name) for event in events]


class ClusterContract:
    """Every ClusterAPI adapter behaves like a Kubernetes API server on these points."""

    async def test_create_returns_the_pod_as_stored(self, cluster: ClusterAPI) -> None:
        """The stored pod keeps what was asked for and gains namespace, version, age."""
        pod = make_pod("w-1", labels={"stoker.dev/pool": "p"}, annotations={"a": "1"})
        created = await cluster.create_pod(pod)
        assert created.name == "w-1"
        assert created.namespace == cluster.namespace
        assert created.labels == {"stoker.dev/pool": "p"}
        assert created.annotations == {"a": "1"}
        assert created.spec.containers[0].cpu == "500m"
        assert created.spec.containers[0].memory == "256Mi"
        assert created.spec.containers[0].env == {"STOKER_WORKER_ID": "w-1"}
        assert created.spec.containers[0].ports == (8080,)
        assert created.spec.restart_policy == "Never"
        assert created.phase == PodPhase.PENDING
        assert created.resource_version
        assert created.created_at is not None
        assert await cluster.get_pod("w-1") == created

    async def test_get_of_a_missing_pod_is_none(self, cluster: ClusterAPI) -> None:
        """Absence is an answer, not an error."""
        assert await cluster.get_pod("nobody") is None

    async def test_create_of_an_existing_name_conflicts(self, cluster: ClusterAPI) -> None:
        """A second create with the same name is a 409, and the first pod is untouched."""
        first = await cluster.create_pod(make_pod("w-1", labels={"v": "1"}))
        with pytest.raises(Conflict):
            await cluster.create_pod(make_pod("w-1", labels={"v": "2"}))
        assert await cluster.get_pod("w-1") == first

    async def test_list_filters_by_every_label_of_the_selector(self, cluster: ClusterAPI) -> None:
        """Selectors are equality on all keys; an empty selector lists everything."""
        await cluster.create_pod(make_pod("a-x", labels={"pool": "a", "org": "x"}))
        await cluster.create_pod(make_pod("a-y", labels={"pool": "a", "org": "y"}))
        await cluster.create_pod(make_pod("b-x", labels={"pool": "b", "org": "x"}))
        await cluster.create_pod(make_pod("bare"))

        def names(listing: tuple[Pod, ...]) -> set[str]:
            return {pod.name for pod in listing}

        assert names((await cluster.list_pods({"pool": "a"})).items) == {"a-x", "a-y"}
        assert names((await cluster.list_pods({"pool": "a", "org": "x"})).items) == {"a-x"}
        assert names((await cluster.list_pods({"pool": "c"})).items) == set()
        assert names((await cluster.list_pods({})).items) == {"a-x", "a-y", "b-x", "bare"}

    async def test_patch_sets_and_removes_annotations_and_labels(self, cluster: ClusterAPI) -> None:
        """A merge patch touches only the keys it names; None removes a key."""
        await cluster.create_pod(make_pod("w-1", labels={"keep": "1"}, annotations={"k": "v"}))
        pinned = await cluster.patch_pod("w-1", annotations={"karpenter.sh/do-not-disrupt": "true"})
        assert pinned.annotations == {"k": "v", "karpenter.sh/do-not-disrupt": "true"}
        unpinned = await cluster.patch_pod(
            "w-1", labels={"state": "hot"}, annotations={"karpenter.sh/do-not-disrupt": None}
        )
        assert unpinned.annotations == {"k": "v"}
        assert unpinned.labels == {"keep": "1", "state": "hot"}
        assert await cluster.get_pod("w-1") == unpinned

    async def test_patch_of_a_missing_pod_is_not_found(self, cluster: ClusterAPI) -> None:
        """Patching never creates."""
        with pytest.raises(ObjectNotFound):
            await cluster.patch_pod("nobody", annotations={"a": "1"})

    async def test_delete_removes_the_pod(self, cluster: ClusterAPI) -> None:
        """A delete without grace removes the pod at once."""
        await cluster.create_pod(make_pod("w-1"))
        await cluster.delete_pod("w-1", grace_s=0)
        assert await cluster.get_pod("w-1") is None
        assert (await cluster.list_pods({})).items == ()

    async def test_delete_of_a_missing_pod_is_not_an_error(self, cluster: ClusterAPI) -> None:
        """A 404 on delete means the pod is already gone, which is what was wanted."""
        await cluster.delete_pod("nobody")
        await cluster.delete_pod("nobody", grace_s=0)

    async def test_every_write_gets_a_newer_resource_version(self, cluster: ClusterAPI) -> None:
        """Creates and patches bump the version; a list reports the newest one."""
        first = await cluster.create_pod(make_pod("w-1"))
        second = await cluster.create_pod(make_pod("w-2"))
        patched = await cluster.patch_pod("w-1", annotations={"a": "1"})
        listing = await cluster.list_pods({})
        versions = [int(first.resource_version), int(second.resource_version)]
        versions += [int(patched.resource_version)]
        assert versions == sorted(set(versions))
        assert int(listing.resource_version) >= versions[-1]

    async def test_watch_from_a_list_sees_every_later_change(self, cluster: ClusterAPI) -> None:
        """List, then watch from the list's version: later ADDED, MODIFIED, DELETED arrive.

        The changes happen before the watch starts, so the watch must replay them; a pod
        that existed at the list and pods outside the selector are not reported.
        """
        pool = {"stoker.dev/pool": "p"}
        await cluster.create_pod(make_pod("before", labels=pool))
        listing = await cluster.list_pods(pool)
        assert [pod.name for pod in listing.items] == ["before"]

        await cluster.create_pod(make_pod("w-1", labels=pool))
        await cluster.create_pod(make_pod("other", labels={"stoker.dev/pool": "q"}))
        await cluster.patch_pod("w-1", annotations={"karpenter.sh/do-not-disrupt": "true"})
        await cluster.patch_pod("other", annotations={"a": "1"})
        await cluster.delete_pod("w-1", grace_s=0)

        events = cluster.watch_pods(pool, listing.resource_version)
        try:
            replayed = await collect(events, 3)
            assert summary(replayed) == [("ADDED", "w-1"), ("MODIFIED", "w-1"), ("DELETED", "w-1")]
            assert replayed[1].pod.annotations == {"karpenter.sh/do-not-disrupt": "true"}
            versions = [int(event.pod.resource_version) for event in replayed]
            assert versions == sorted(set(versions))
            assert versions[0] > int(listing.resource_version)

            # Then live: a change made while the watch is open.
            await cluster.create_pod(make_pod("w-2", labels=pool))
            assert summary(await collect(events, 1)) == [("ADDED", "w-2")]
        finally:
            await events.aclose()

    async def test_lease_round_trips(self, cluster: ClusterAPI) -> None:
        """What an elector writes is what it reads back, times to the microsecond."""
        created = await cluster.create_lease(make_lease())
        assert created.resource_version
        assert created.namespace == cluster.namespace
        read = await cluster.get_lease("stoker-janitor")
        assert read == created
        assert read.holder == "replica-a"
        assert read.acquire_time == WHOLE_SECOND
        assert read.renew_time == FRACTION
        assert read.duration_s == 15
        assert read.transitions == 0

    async def test_get_of_a_missing_lease_is_none(self, cluster: ClusterAPI) -> None:
        """No lease yet: the first elector creates it."""
        assert await cluster.get_lease("stoker-janitor") is None

    async def test_create_of_an_existing_lease_conflicts(self, cluster: ClusterAPI) -> None:
        """Two replicas creating the lease at once: the second one loses."""
        await cluster.create_lease(make_lease(holder="replica-a"))
        with pytest.raises(Conflict):
            await cluster.create_lease(make_lease(holder="replica-b"))
        read = await cluster.get_lease("stoker-janitor")
        assert read is not None and read.holder == "replica-a"

    async def test_update_with_the_current_version_succeeds(self, cluster: ClusterAPI) -> None:
        """A renewal from the version just read is accepted and gets a newer version."""
        created = await cluster.create_lease(make_lease())
        renewed = await cluster.update_lease(
            Lease(
                name=created.name,
                holder="replica-a",
                acquire_time=WHOLE_SECOND,
                renew_time=WHOLE_SECOND + 10,
                duration_s=15,
                transitions=0,
                resource_version=created.resource_version,
            )
        )
        assert int(renewed.resource_version) > int(created.resource_version)
        assert renewed.renew_time == WHOLE_SECOND + 10
        assert await cluster.get_lease(created.name) == renewed

    async def test_update_of_a_missing_lease_is_not_found(self, cluster: ClusterAPI) -> None:
        """Update never creates: a deleted lease must be created again."""
        with pytest.raises(ObjectNotFound):
            await cluster.update_lease(make_lease())

    async def test_update_with_a_stale_version_conflicts(self, cluster: ClusterAPI) -> None:
        """Compare-and-set: a write based on an old read is refused, the newer one stays."""
        created = await cluster.create_lease(make_lease(holder="replica-a"))
        taken = await cluster.update_lease(
            _with(created, holder="replica-b", transitions=1, rv=created.resource_version)
        )
        with pytest.raises(Conflict):
            await cluster.update_lease(
                _with(created, holder="replica-a", transitions=0, rv=created.resource_version)
            )
        assert await cluster.get_lease(created.name) == taken

    async def test_concurrent_updaters_exactly_one_wins(self, cluster: ClusterAPI) -> None:
        """Two replicas take over from the same read at once: one wins, one conflicts."""
        created = await cluster.create_lease(make_lease(holder="old"))
        results = await asyncio.gather(
            cluster.update_lease(
                _with(created, holder="replica-a", transitions=1, rv=created.resource_version)
            ),
            cluster.update_lease(
                _with(created, holder="replica-b", transitions=1, rv=created.resource_version)
            ),
            return_exceptions=True,
        )
        winners = [result for result in results if isinstance(result, Lease)]
        losers = [result for result in results if isinstance(result, Conflict)]
        assert len(winners) == 1 and len(losers) == 1
        assert await cluster.get_lease(created.name) == winners[0]


def _with(lease: Lease, *, holder: str, transitions: int, rv: str) -> Lease:
    return Lease(
        name=lease.name,
        holder=holder,
        acquire_time=FRACTION,
        renew_time=FRACTION,
        duration_s=lease.duration_s,
        transitions=transitions,
        resource_version=rv,
    )
