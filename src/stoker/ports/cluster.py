"""The ClusterAPI port: the slice of the Kubernetes API that stoker's pod runtime needs.

Pods (create, delete, patch labels and annotations, get, list, watch) and coordination
Leases (get, create, compare-and-set update) in one namespace, in stoker's own types: no
Kubernetes-library object crosses this boundary. `stoker.adapters.cluster_lightkube` talks
to a real API server; `stoker.sim.cluster.FakeApiServer` is the in-process cluster of the
tests and the simulator. Both pass the contract suite in `tests/cluster_contract.py`.

resourceVersions are opaque strings, as in Kubernetes: compare them only for equality, hand
them back unchanged (list → watch, get → update), never do arithmetic on them.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from stoker.domain.errors import RuntimeFailure

#: An equality-only label selector: every key must be present with exactly that value.
Selector = Mapping[str, str]
#: A merge patch of labels or annotations: a `None` value removes that key; no patch
#: (`None`) leaves them as they are.
MetadataPatch = Mapping[str, str | None] | None


class PodPhase(StrEnum):
    """`status.phase` of a pod."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"


class WatchEventType(StrEnum):
    """What happened to the pod in a watch event."""

    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"


@dataclass(frozen=True, slots=True, kw_only=True)
class Container:
    """One container; cpu and memory are Kubernetes quantities used as requests *and* limits.

    Requests equal to limits make the pod Guaranteed QoS, so a warm worker is never the
    first thing the kubelet evicts under memory pressure.
    """

    name: str
    image: str
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cpu: str = "1"
    memory: str = "1Gi"
    ports: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Toleration:
    """A pod toleration, as in `spec.tolerations[]`."""

    key: str | None = None
    operator: str = "Equal"
    value: str | None = None
    effect: str | None = None
    toleration_seconds: int | None = None


#: The node label that names a node (its hostname; the node's name on most clusters).
LABEL_HOSTNAME = "kubernetes.io/hostname"


@dataclass(frozen=True, slots=True)
class PreferredNodes:
    """One term of a pod's preferred node affinity
    (`affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[]`): the
    nodes whose `kubernetes.io/hostname` is one of `hostnames` score `weight` (1-100)."""

    weight: int
    hostnames: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PodSpec:
    """What stoker asks of a worker pod.

    `restart_policy` is "Never": a worker that exits is lost and replaced by the control
    plane (with a fresh, never-activated worker), never restarted in place with an org's
    state still in memory.
    """

    containers: tuple[Container, ...]
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    #: Nodes the scheduler should prefer, where they fit (a preference, never a filter).
    preferred_nodes: tuple[PreferredNodes, ...] = ()
    priority_class_name: str | None = None
    service_account_name: str | None = None
    restart_policy: str = "Never"
    termination_grace_period_s: int | None = None


@dataclass(frozen=True, slots=True)
class Condition:
    """A pod condition (`status.conditions[]`): its status ("True", "False", "Unknown"),
    and for a False one the machine-readable reason and the human message."""

    status: str
    reason: str | None = None
    message: str | None = None


@dataclass(frozen=True, slots=True)
class Waiting:
    """Why a container does not run yet (`state.waiting`): `ContainerCreating` while its
    image is pulled, `ErrImagePull` or `ImagePullBackOff` when the pull fails, ..."""

    reason: str
    message: str | None = None


@dataclass(frozen=True, slots=True)
class Terminated:
    """How the first container ended (`state.terminated`): its exit code, and the
    kubelet's reason (`Error`, `Completed`, `OOMKilled`, `ContainerCannotRun`, ...)."""

    exit_code: int
    reason: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Pod:
    """A pod as stoker sees it; the cluster fills in everything after `spec` on create."""

    name: str
    spec: PodSpec
    namespace: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    phase: str = PodPhase.PENDING
    #: The pod's Ready condition is True (its readiness probe passes).
    ready: bool = False
    pod_ip: str | None = None
    node_name: str | None = None
    #: `status.reason`, e.g. "Evicted" for a pod the kubelet evicted under node pressure.
    reason: str | None = None
    #: The PodScheduled condition; None before the scheduler wrote one. False with reason
    #: "Unschedulable" (and a message saying which nodes did not fit, and why) while no
    #: node can take the pod.
    scheduled: Condition | None = None
    #: `status.nominatedNodeName`: a preemption freed room there, and the pod goes there.
    nominated_node: str | None = None
    #: Why the first container is not running yet, if it is waiting.
    waiting: Waiting | None = None
    #: Seconds since the epoch at which the first container started running, if it runs.
    started_at: float | None = None
    #: How the first container ended, once it did (the worker pods never restart).
    terminated: Terminated | None = None
    #: Seconds since the epoch at which a graceful deletion completes; None while not deleting.
    deletion_timestamp: float | None = None
    resource_version: str = ""
    #: Seconds since the epoch (creationTimestamp); None before the cluster stored the pod.
    created_at: float | None = None


@dataclass(frozen=True, slots=True)
class PodList:
    """The pods of a list call and the resourceVersion to start watching from."""

    items: tuple[Pod, ...]
    resource_version: str


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change to one pod."""

    type: WatchEventType
    pod: Pod


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    """A coordination.k8s.io/v1 Lease; times are seconds since the epoch.

    `transitions` counts changes of holder and serves as the elector's fencing epoch.
    """

    name: str
    namespace: str = ""
    holder: str | None = None
    acquire_time: float | None = None
    renew_time: float | None = None
    duration_s: int | None = None
    transitions: int = 0
    resource_version: str = ""


class ClusterError(RuntimeFailure, code="cluster-error"):
    """The cluster refused or could not serve a request; `status` is the HTTP status if any."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ObjectNotFound(ClusterError, code="cluster-not-found"):
    """The named pod or lease does not exist (404)."""


class Conflict(ClusterError, code="cluster-conflict"):
    """The object already exists, or its resourceVersion changed since it was read (409)."""


class Gone(ClusterError, code="cluster-gone"):
    """The watch's resourceVersion is older than the cluster's history (410): list again."""


class Throttled(ClusterError, code="cluster-throttled"):
    """The API server asked the client to slow down (429) and retries did not help."""

    def __init__(
        self, message: str, *, status: int | None = 429, retry_after: float | None = None
    ) -> None:
        super().__init__(message, status=status)
        self.retry_after = retry_after


class Invalid(ClusterError, code="cluster-invalid"):
    """The API server rejected the object or request as malformed (400, 422)."""


class Forbidden(ClusterError, code="cluster-forbidden"):
    """The API server refused the request (401, 403): stoker's credentials or RBAC, or an
    admission plugin's refusal of the object (a ResourceQuota without room, a
    LimitRange's maximum, a PriorityClass that does not exist); its message says which.

    Not to be confused with `stoker.domain.errors.Forbidden`, an org acting for another org.
    """


class ClusterUnavailable(ClusterError, code="cluster-unavailable"):
    """The API server kept failing (5xx) or could not be reached, after all retries."""


def error_for_status(
    status: int, message: str, *, retry_after: float | None = None
) -> ClusterError:
    """The port's error for an HTTP status the API server answered (one mapping for every
    ClusterAPI adapter): 404, 409, 410, 429, 400/422, 401/403 and 5xx each have theirs,
    any other status is a plain `ClusterError`. `retry_after` goes with a 429."""
    if status == 404:
        return ObjectNotFound(message, status=status)
    if status == 409:
        return Conflict(message, status=status)
    if status == 410:
        return Gone(message, status=status)
    if status == 429:
        return Throttled(message, status=status, retry_after=retry_after)
    if status in (400, 422):
        return Invalid(message, status=status)
    if status in (401, 403):
        return Forbidden(message, status=status)
    if status >= 500:
        return ClusterUnavailable(message, status=status)
    return ClusterError(message, status=status)


class ClusterAPI(Protocol):
    """Pods and Leases in one namespace, with Kubernetes' resourceVersion semantics."""

    @property
    def namespace(self) -> str:
        """The namespace every call acts in."""
        ...

    async def create_pod(self, pod: Pod) -> Pod:
        """Create `pod` in this namespace and return it as stored; `Conflict` if the name exists."""
        ...

    async def delete_pod(self, name: str, grace_s: float | None = None) -> None:
        """Ask for the pod's deletion, after `grace_s` (None: the pod's own grace period).

        A pod that does not exist is already gone: that is not an error.
        """
        ...

    async def patch_pod(
        self, name: str, labels: MetadataPatch = None, annotations: MetadataPatch = None
    ) -> Pod:
        """Merge-patch labels and annotations; a `None` value removes that key."""
        ...

    async def get_pod(self, name: str) -> Pod | None:
        """The pod, or None if it does not exist."""
        ...

    async def list_pods(self, selector: Selector) -> PodList:
        """The pods matching `selector` and the resourceVersion of that snapshot."""
        ...

    def watch_pods(
        self, selector: Selector, resource_version: str
    ) -> AsyncGenerator[WatchEvent, None]:
        """Every change to matching pods after `resource_version`, then live changes.

        Pass the resourceVersion of a `list_pods` (or of the last event seen) to miss
        nothing; an empty one starts with an ADDED event for every current pod. The
        stream may end when the cluster closes the watch: resume from the last event's
        resourceVersion. Raises `Gone` when that version is too old: list again.
        `aclose()` it to stop watching; that releases the connection at once.
        """
        ...

    async def get_lease(self, name: str) -> Lease | None:
        """The lease, or None if it does not exist."""
        ...

    async def create_lease(self, lease: Lease) -> Lease:
        """Create the lease; `Conflict` if it exists (another replica created it first)."""
        ...

    async def update_lease(self, lease: Lease) -> Lease:
        """Replace the lease if its resourceVersion is still `lease.resource_version`.

        `Conflict` when someone else wrote it since it was read; `ObjectNotFound` if it
        was deleted. This compare-and-set is what makes the Lease elector safe. As in
        Kubernetes, an empty resourceVersion replaces unconditionally: electors never send one.
        """
        ...

    async def close(self) -> None:
        """Release connections; open watches end."""
        ...
