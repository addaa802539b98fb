"""`FakeApiServer`: an in-process Kubernetes API server for pods and leases.

It is the cluster of the tests and of the fleet simulator, so it keeps the semantics that
control code relies on exactly, not approximately:

- one global resourceVersion that every write bumps; a write that changes nothing (a
  no-op patch) does not bump it, as in Kubernetes;
- create of an existing name, and an update of a Lease with a stale resourceVersion, are
  `Conflict`s; an empty resourceVersion updates unconditionally;
- `watch_pods(selector, rv)` replays every change after `rv` from a bounded history, then
  streams live changes, and raises `Gone` when `rv` is older than the history kept; a pod
  whose labels stop (start) matching a selector is DELETED from (ADDED to) that watch;
- a graceful deletion stamps `deletion_timestamp` and removes the pod after the grace
  period on the injected `Clock`; a pod that is not scheduled to a node, or has already
  finished, is removed at once (the API server's own rule for pods).

The cluster side (the simulator's kubelet, scheduler, controllers and node autoscaler)
drives pods through `set_pod_status`, `evict`, `create_pod_nowait`, `delete_pod_nowait`
and `finish_deletion`, and follows every change through `add_listener`; tests inject
faults with `fail_next`, `drop_watches` and `set_latency`. Nothing here starts a thread
or does I/O, so it runs on a virtual-time loop, and nothing iterates in an order that
depends on object addresses or string hashing, so a seeded simulation replays exactly.

Its parts: `changes` (the history, watches and listeners), `leases`, `calls` (what tests
inject into calls) and `validation` (names and labels).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import replace
from typing import Any, TypedDict, Unpack

from stoker.ports.clock import Clock
from stoker.ports.cluster import (
    ClusterError,
    Condition,
    Conflict,
    Invalid,
    Lease,
    MetadataPatch,
    ObjectNotFound,
    Pod,
    PodList,
    PodPhase,
    Selector,
    Terminated,
    Waiting,
    WatchEvent,
    WatchEventType,
)
from stoker.sim.cluster.calls import CallGate
from stoker.sim.cluster.changes import ChangeFeed, PodChange, PodListener, matches
from stoker.sim.cluster.leases import LeaseTable
from stoker.sim.cluster.validation import check_labels, check_name


class PodStatus(TypedDict, total=False):
    """The status fields `FakeApiServer.set_pod_status` sets (those given)."""

    phase: str
    ready: bool
    pod_ip: str
    node_name: str
    reason: str
    scheduled: Condition
    nominated_node: str | None
    waiting: Waiting | None
    started_at: float
    terminated: Terminated | None


def _merge(current: Mapping[str, str], patch: MetadataPatch) -> dict[str, str]:
    merged = dict(current)
    for key, value in (patch or {}).items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


#: Called when a graceful deletion starts (or is shortened) with the pod as stamped and
#: the grace in seconds; it owns finishing the deletion through `finish_deletion`.
TerminationHook = Callable[[Pod, float], None]


class FakeApiServer:
    """An in-process API server holding the pods and leases of one namespace.

    `history_size` is how many pod changes a watch can resume across; `default_grace_s`
    is the grace period of a pod that sets none (Kubernetes' default is 30 s). Without
    `on_terminating` a graceful deletion completes when its grace period ends; with it,
    the hook (a simulated kubelet) decides when the containers have stopped.
    `watch_latency_s` delays every watch event by that much after its write.
    """

    def __init__(
        self,
        *,
        clock: Clock,
        namespace: str = "default",
        history_size: int = 1000,
        default_grace_s: float = 30.0,
        on_terminating: TerminationHook | None = None,
        watch_latency_s: float = 0.0,
    ) -> None:
        self._clock = clock
        self._namespace = namespace
        self._default_grace_s = default_grace_s
        self._rv = 0
        self._pods: dict[str, Pod] = {}
        self._leases = LeaseTable(namespace, self._next_rv)
        self._feed = ChangeFeed(
            history_size, latency_s=watch_latency_s, clock=clock if watch_latency_s else None
        )
        self._on_terminating = on_terminating
        self._terminations: dict[str, asyncio.Task[None]] = {}
        self._gate = CallGate(clock)
        #: How often each port operation was called (failed calls included).
        self.calls = self._gate.calls
        self._enter = self._gate.enter

    # -- the ClusterAPI port -------------------------------------------------------------

    @property
    def namespace(self) -> str:
        """The namespace every call acts in."""
        return self._namespace

    async def create_pod(self, pod: Pod) -> Pod:
        """Store a new pod in phase Pending; `Conflict` if the name is taken."""
        await self._enter("create_pod")
        return self.create_pod_nowait(pod)

    async def delete_pod(self, name: str, grace_s: float | None = None) -> None:
        """Delete gracefully; a missing pod is already gone, which is fine."""
        await self._enter("delete_pod")
        self._delete(name, grace_s)

    async def patch_pod(
        self, name: str, labels: MetadataPatch = None, annotations: MetadataPatch = None
    ) -> Pod:
        """Merge-patch labels and annotations; `None` removes a key."""
        await self._enter("patch_pod")
        pod = self._pod(name)
        changes: dict[str, Any] = {}
        # An unchanged map keeps its identity, so listeners can tell what changed cheaply.
        new_labels = _merge(pod.labels, labels)
        check_labels(new_labels)
        if new_labels != pod.labels:
            changes["labels"] = new_labels
        new_annotations = _merge(pod.annotations, annotations)
        if new_annotations != pod.annotations:
            changes["annotations"] = new_annotations
        return self._update_pod(pod, changes) if changes else pod

    async def get_pod(self, name: str) -> Pod | None:
        """The pod, or None."""
        await self._enter("get_pod")
        return self._pods.get(name)

    async def list_pods(self, selector: Selector) -> PodList:
        """Matching pods, ordered by name as the API server orders them, and the current rv."""
        await self._enter("list_pods")
        items = tuple(pod for _, pod in sorted(self._pods.items()) if matches(pod.labels, selector))
        return PodList(items=items, resource_version=str(self._rv))

    def watch_pods(
        self, selector: Selector, resource_version: str
    ) -> AsyncGenerator[WatchEvent, None]:
        """Replay changes after `resource_version` from history, then stream live ones."""
        return self.open_watch(selector, resource_version)

    async def get_lease(self, name: str) -> Lease | None:
        """The lease, or None."""
        await self._enter("get_lease")
        return self._leases.get(name)

    async def create_lease(self, lease: Lease) -> Lease:
        """Store a new lease; `Conflict` if it exists."""
        await self._enter("create_lease")
        return self._leases.create(lease)

    async def update_lease(self, lease: Lease) -> Lease:
        """Replace the lease if `lease.resource_version` is still current (compare-and-set)."""
        await self._enter("update_lease")
        return self._leases.update(lease)

    async def close(self) -> None:
        """Shut the cluster down: open watches end, pending deletions stop, calls fail."""
        self._gate.closed = True
        self.drop_watches()
        pending = list(self._terminations.values())
        self._terminations.clear()
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    # -- the cluster side: what kubelet, scheduler and autoscaler would do ---------------

    @property
    def resource_version(self) -> str:
        """The current global resourceVersion."""
        return str(self._rv)

    @property
    def open_watches(self) -> int:
        """How many watches are streaming right now."""
        return self._feed.open_watches

    def add_listener(self, listener: PodListener) -> None:
        """Call `listener` with every pod change, synchronously, in resourceVersion order.

        It runs after the change reached the watches and must not write to the server
        (a nested write would reach listeners before the change that caused it).
        """
        self._feed.add_listener(listener)

    def open_watch(
        self, selector: Selector, resource_version: str, *, owner: str | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        """`watch_pods`, tagged with the `owner` that `drop_watches(owner)` can target."""
        return self._feed.watch(
            selector, resource_version, owner=owner, enter=self._enter, pods=self._pods
        )

    def create_pod_nowait(self, pod: Pod) -> Pod:
        """`create_pod` as an in-cluster controller does it: no latency, faults or counting."""
        check_name("pod", pod.name)
        check_labels(pod.labels)
        if pod.namespace and pod.namespace != self._namespace:
            raise Invalid(f"pod namespace {pod.namespace!r} is not {self._namespace!r}", status=400)
        if not pod.spec.containers:
            raise Invalid(f"pod {pod.name!r} has no containers", status=422)
        if pod.name in self._pods:
            raise Conflict(f'pods "{pod.name}" already exists', status=409)
        created = replace(
            pod,
            namespace=self._namespace,
            labels=dict(pod.labels),
            annotations=dict(pod.annotations),
            phase=PodPhase.PENDING,
            ready=False,
            pod_ip=None,
            node_name=None,
            reason=None,
            scheduled=None,
            nominated_node=None,
            waiting=None,
            started_at=None,
            deletion_timestamp=None,
            resource_version=self._next_rv(),
            created_at=self._clock.now(),
        )
        self._pods[pod.name] = created
        self._record(WatchEventType.ADDED, None, created)
        return created

    def delete_pod_nowait(self, name: str, grace_s: float | None = None) -> None:
        """`delete_pod` as an in-cluster controller does it: no latency, faults or counting."""
        self._delete(name, grace_s)

    def finish_deletion(self, name: str) -> None:
        """The kubelet reports the terminating pod's containers stopped: remove the pod.

        A pod that is gone, or that is not terminating, is left alone.
        """
        pod = self._pods.get(name)
        if pod is not None and pod.deletion_timestamp is not None:
            self._remove(name)

    def set_pod_status(
        self, name: str, *, clear_reason: bool = False, **status: Unpack[PodStatus]
    ) -> Pod:
        """Change the pod's status as the scheduler or kubelet would: the fields given.

        `clear_reason` removes `reason` (a pod that was Unschedulable got a node).
        Returns the pod as stored; a change that changes nothing writes nothing.
        """
        pod = self._pod(name)
        changes: dict[str, Any] = {
            key: value for key, value in status.items() if getattr(pod, key) != value
        }
        if clear_reason and "reason" not in status and pod.reason is not None:
            changes["reason"] = None
        return self._update_pod(pod, changes) if changes else pod

    def evict(self, name: str, *, delete: bool = False) -> None:
        """Evict the pod.

        By default as the kubelet does under node pressure: the pod stays, Failed with
        reason "Evicted". With `delete=True` as the Eviction API does (node drain, node
        autoscaler): a graceful deletion with the pod's own grace period.
        """
        pod = self._pod(name)
        if delete:
            self._delete(name, None)
        else:
            self._update_pod(pod, {"phase": PodPhase.FAILED, "ready": False, "reason": "Evicted"})

    def compact(self) -> None:
        """Forget the whole change history, as an etcd compaction does: older watches get Gone."""
        self._feed.compact(self._rv)

    # -- fault injection -----------------------------------------------------------------

    def fail_next(self, operation: str, error: ClusterError, times: int = 1) -> None:
        """Make the next `times` calls of `operation` raise `error` (after any latency)."""
        self._gate.fail_next(operation, error, times)

    def drop_watches(self, owner: str | None = None) -> None:
        """End every open watch (or only `owner`'s), as an API server restart would."""
        self._feed.drop(owner)

    def set_latency(self, seconds: float, operation: str | None = None) -> None:
        """Delay every call of `operation` (all of them if None) by `seconds` of clock time."""
        self._gate.set_latency(seconds, operation)

    # -- internals -----------------------------------------------------------------------

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _pod(self, name: str) -> Pod:
        pod = self._pods.get(name)
        if pod is None:
            raise ObjectNotFound(f'pods "{name}" not found', status=404)
        return pod

    def _update_pod(self, pod: Pod, changes: Mapping[str, Any]) -> Pod:
        """Write `changes` (fields of the pod and their new values) as a new version."""
        updated = replace(pod, **changes, resource_version=self._next_rv())
        self._pods[pod.name] = updated
        self._record(WatchEventType.MODIFIED, pod, updated)
        return updated

    def _delete(self, name: str, grace_s: float | None) -> None:
        pod = self._pods.get(name)
        if pod is None:
            return
        if grace_s is None:
            grace_s = pod.spec.termination_grace_period_s
        if grace_s is None:
            grace_s = self._default_grace_s
        # The API server deletes a pod that no kubelet runs, or that has finished, at once.
        if pod.node_name is None or pod.phase in (PodPhase.SUCCEEDED, PodPhase.FAILED):
            grace_s = 0.0
        if grace_s <= 0:
            self._remove(name)
            return
        deadline = self._clock.now() + grace_s
        if pod.deletion_timestamp is not None and pod.deletion_timestamp <= deadline:
            return  # already terminating, at least as soon: a longer grace never extends it
        stamped = self._update_pod(pod, {"deletion_timestamp": deadline})
        if self._on_terminating is not None:
            self._on_terminating(stamped, grace_s)
            return
        previous = self._terminations.pop(name, None)
        if previous is not None:
            previous.cancel()
        self._terminations[name] = asyncio.get_running_loop().create_task(
            self._finish_termination(name, grace_s), name=f"fake-apiserver-terminate-{name}"
        )

    async def _finish_termination(self, name: str, grace_s: float) -> None:
        await self._clock.sleep(grace_s)
        self._terminations.pop(name, None)
        self._remove(name)

    def _remove(self, name: str) -> None:
        pod = self._pods.pop(name)
        # A termination that finishes has already forgotten itself; any other one is moot.
        task = self._terminations.pop(name, None)
        if task is not None:
            task.cancel()
        self._record(WatchEventType.DELETED, pod, replace(pod, resource_version=self._next_rv()))

    def _record(self, kind: WatchEventType, before: Pod | None, after: Pod) -> None:
        self._feed.record(PodChange(int(after.resource_version), kind, before, after))
