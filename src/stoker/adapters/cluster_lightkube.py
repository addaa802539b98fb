"""`LightkubeCluster`: the ClusterAPI port on a real API server, through lightkube's AsyncClient.

Every request first takes a token from a client-side QPS/burst budget (the API server's
priority-and-fairness budget is shared with the rest of the cluster; a spawn burst must
not eat it). Throttling (429), server errors (5xx) and connection errors are retried with
exponential backoff on the injected clock; a 429's Retry-After is honoured when longer.
A pod create stops retrying at its deadline (`create_deadline_s`), so that a spawn during
an API outage fails, and backs off, within seconds.
400, 401, 403, 404, 409 and 422 are answers, not failures, and are never retried: they map
at once to the port's errors.

Lightkube's models never leave this module: pods and leases are converted to and from the
port's dataclasses here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

import httpx2
import lightkube
from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.models import core_v1 as k8s
from lightkube.models.authorization_v1 import ResourceAttributes, SelfSubjectAccessReviewSpec
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.authorization_v1 import SelfSubjectAccessReview
from lightkube.resources.coordination_v1 import Lease as K8sLease
from lightkube.resources.core_v1 import Pod as K8sPod
from lightkube.types import PatchType

from stoker.domain.errors import ConfigError
from stoker.ports.clock import Clock, TokenBucket
from stoker.ports.cluster import (
    LABEL_HOSTNAME,
    ClusterError,
    ClusterUnavailable,
    Condition,
    Conflict,
    Container,
    Gone,
    Lease,
    MetadataPatch,
    ObjectNotFound,
    Pod,
    PodList,
    PodPhase,
    PodSpec,
    PreferredNodes,
    Selector,
    Terminated,
    Toleration,
    Waiting,
    WatchEvent,
    WatchEventType,
    error_for_status,
)

logger = logging.getLogger("stoker.adapters.cluster_lightkube")

T = TypeVar("T")
_Object = TypeVar("_Object", K8sPod, K8sLease)

#: The field manager recorded in managedFields for everything stoker writes; passed on
#: every write, so that an injected client attributes them to stoker too.
FIELD_MANAGER = "stoker"

_EVENT_TYPES = {kind.value: kind for kind in WatchEventType}

#: What stoker does in its namespace, as (API group, resource, verb): the runtime's pods and
#: the Kubernetes elector's leases; deploy/kubernetes/base/rbac.yaml grants exactly these.
POD_ACCESS = tuple(
    ("", "pods", verb) for verb in ("create", "delete", "get", "list", "patch", "watch")
)
LEASE_ACCESS = tuple(
    ("coordination.k8s.io", "leases", verb) for verb in ("create", "get", "update")
)

# Backoff doubles per attempt up to this ceiling, so a long outage is polled, not hammered.
_MAX_BACKOFF_S = 30.0


def _retryable(status: int) -> bool:
    return status == 429 or status >= 500


def _response_of(exc: httpx2.HTTPStatusError) -> httpx2.Response | None:
    # An ERROR event inside a watch stream is an ApiError whose response is None,
    # although httpx2 types the attribute as always set.
    response: httpx2.Response | None = getattr(exc, "response", None)
    return response


def _status_of(exc: httpx2.HTTPStatusError) -> int:
    if isinstance(exc, ApiError) and exc.status is not None and exc.status.code:
        return int(exc.status.code)
    response = _response_of(exc)
    return response.status_code if response is not None else 0


def _message_of(exc: httpx2.HTTPStatusError) -> str:
    if isinstance(exc, ApiError) and exc.status is not None and exc.status.message:
        return str(exc.status.message)
    response = _response_of(exc)
    if response is None:
        return "no response"
    # Lightkube decodes a Status only for exactly "application/json"; other servers and
    # proxies add a charset or send text, so read the body here.
    try:
        body = response.json()
    except (httpx2.StreamError, ValueError):
        return f"HTTP {response.status_code}"
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"])
    return f"HTTP {response.status_code}"


def _retry_after(exc: httpx2.HTTPStatusError) -> float | None:
    response = _response_of(exc)
    value = response.headers.get("Retry-After") if response is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP-date: the exponential backoff stands


def _cluster_error(exc: httpx2.HTTPStatusError, what: str) -> ClusterError:
    return error_for_status(
        _status_of(exc), f"{what}: {_message_of(exc)}", retry_after=_retry_after(exc)
    )


# -- conversions between lightkube models and the port's dataclasses --------------------


def _seconds(moment: datetime | None) -> float | None:
    if moment is None:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)  # Kubernetes times are UTC
    return moment.timestamp()


def _micro_time(seconds: float | None) -> datetime | None:
    """A Kubernetes MicroTime for `seconds`, always with six fractional digits.

    The API server parses MicroTime with exactly six digits and rejects "…:05Z", which is
    what msgspec writes for a datetime on a whole second (common on virtual clocks). A str
    in the struct is encoded verbatim, so the field carries the formatted string; lightkube
    types the field as datetime, hence the cast.
    """
    if seconds is None:
        return None
    text = datetime.fromtimestamp(seconds, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return cast(datetime, text)


def _container_to_k8s(container: Container) -> k8s.Container:
    # Requests equal limits: Guaranteed QoS, the last class the kubelet evicts.
    resources = {"cpu": container.cpu, "memory": container.memory}
    return k8s.Container(
        name=container.name,
        image=container.image,
        command=list(container.command) or None,
        args=list(container.args) or None,
        env=[k8s.EnvVar(name=key, value=value) for key, value in container.env.items()] or None,
        resources=k8s.ResourceRequirements(requests=dict(resources), limits=dict(resources)),
        ports=[k8s.ContainerPort(containerPort=port) for port in container.ports] or None,
    )


def _pod_to_k8s(pod: Pod, namespace: str) -> K8sPod:
    spec = pod.spec
    tolerations = [
        k8s.Toleration(
            key=toleration.key,
            operator=toleration.operator,
            value=toleration.value,
            effect=toleration.effect,
            tolerationSeconds=toleration.toleration_seconds,
        )
        for toleration in spec.tolerations
    ]
    return K8sPod(
        metadata=ObjectMeta(
            name=pod.name,
            namespace=namespace,
            labels=dict(pod.labels) or None,
            annotations=dict(pod.annotations) or None,
        ),
        spec=k8s.PodSpec(
            containers=[_container_to_k8s(container) for container in spec.containers],
            nodeSelector=dict(spec.node_selector) or None,
            affinity=_affinity_to_k8s(spec.preferred_nodes),
            tolerations=tolerations or None,
            priorityClassName=spec.priority_class_name,
            serviceAccountName=spec.service_account_name,
            restartPolicy=spec.restart_policy,
            terminationGracePeriodSeconds=spec.termination_grace_period_s,
        ),
    )


def _affinity_to_k8s(preferred: Sequence[PreferredNodes]) -> k8s.Affinity | None:
    if not preferred:
        return None
    terms = [
        k8s.PreferredSchedulingTerm(
            weight=term.weight,
            preference=k8s.NodeSelectorTerm(
                matchExpressions=[
                    k8s.NodeSelectorRequirement(
                        key=LABEL_HOSTNAME, operator="In", values=list(term.hostnames)
                    )
                ]
            ),
        )
        for term in preferred
    ]
    return k8s.Affinity(
        nodeAffinity=k8s.NodeAffinity(preferredDuringSchedulingIgnoredDuringExecution=terms)
    )


def _preferred_from_k8s(affinity: k8s.Affinity | None) -> tuple[PreferredNodes, ...]:
    """The hostname terms of a pod's preferred node affinity (others are not stoker's)."""
    node_affinity = affinity.nodeAffinity if affinity else None
    terms = node_affinity.preferredDuringSchedulingIgnoredDuringExecution if node_affinity else None
    found = []
    for term in terms or ():
        for match in term.preference.matchExpressions or ():
            if match.key == LABEL_HOSTNAME and match.operator == "In":
                found.append(PreferredNodes(term.weight, tuple(match.values or ())))
    return tuple(found)


def _container_from_k8s(container: k8s.Container) -> Container:
    resources = container.resources
    requests: Mapping[str, Any] = (resources.requests or {}) if resources else {}
    limits: Mapping[str, Any] = (resources.limits or {}) if resources else {}
    return Container(
        name=container.name,
        image=container.image or "",
        command=tuple(container.command or ()),
        args=tuple(container.args or ()),
        env={var.name: var.value or "" for var in container.env or ()},
        cpu=str(requests.get("cpu", limits.get("cpu", ""))),
        memory=str(requests.get("memory", limits.get("memory", ""))),
        ports=tuple(port.containerPort for port in container.ports or ()),
    )


def _scheduled_of(conditions: Sequence[k8s.PodCondition]) -> Condition | None:
    for condition in conditions:
        if condition.type == "PodScheduled":
            return Condition(condition.status, condition.reason, condition.message)
    return None


def _container_state(
    status: k8s.PodStatus,
) -> tuple[Waiting | None, float | None, Terminated | None]:
    """The first container's waiting reason, the time it started running (while it
    runs), or how it ended."""
    statuses = status.containerStatuses or ()
    state = statuses[0].state if statuses else None
    if state is None:
        return None, None, None
    if state.waiting is not None and state.waiting.reason:
        return Waiting(state.waiting.reason, state.waiting.message), None, None
    if state.running is not None:
        return None, _seconds(state.running.startedAt), None
    if state.terminated is not None:
        ended = state.terminated
        return None, None, Terminated(ended.exitCode, ended.reason)
    return None, None, None


def _pod_from_k8s(obj: K8sPod) -> Pod:
    meta = obj.metadata or ObjectMeta()
    spec = obj.spec
    status = obj.status or k8s.PodStatus()
    conditions = status.conditions or ()
    waiting, started_at, terminated = _container_state(status)
    return Pod(
        name=meta.name or "",
        namespace=meta.namespace or "",
        labels=dict(meta.labels or {}),
        annotations=dict(meta.annotations or {}),
        spec=PodSpec(
            containers=tuple(_container_from_k8s(c) for c in (spec.containers if spec else ())),
            node_selector=dict((spec.nodeSelector if spec else None) or {}),
            preferred_nodes=_preferred_from_k8s(spec.affinity if spec else None),
            tolerations=tuple(
                Toleration(
                    key=t.key,
                    operator=t.operator or "Equal",
                    value=t.value,
                    effect=t.effect,
                    toleration_seconds=t.tolerationSeconds,
                )
                for t in ((spec.tolerations if spec else None) or ())
            ),
            priority_class_name=spec.priorityClassName if spec else None,
            service_account_name=spec.serviceAccountName if spec else None,
            restart_policy=(spec.restartPolicy if spec else None) or "Always",
            termination_grace_period_s=spec.terminationGracePeriodSeconds if spec else None,
        ),
        phase=status.phase or PodPhase.PENDING,
        ready=any(c.type == "Ready" and c.status == "True" for c in conditions),
        pod_ip=status.podIP,
        node_name=spec.nodeName if spec else None,
        reason=status.reason,
        scheduled=_scheduled_of(conditions),
        nominated_node=status.nominatedNodeName,
        waiting=waiting,
        started_at=started_at,
        terminated=terminated,
        deletion_timestamp=_seconds(meta.deletionTimestamp),
        resource_version=meta.resourceVersion or "",
        created_at=_seconds(meta.creationTimestamp),
    )


def _lease_to_k8s(lease: Lease, namespace: str) -> K8sLease:
    return K8sLease(
        metadata=ObjectMeta(
            name=lease.name,
            namespace=namespace,
            # Sent back unchanged so that the API server does the compare-and-set.
            resourceVersion=lease.resource_version or None,
        ),
        spec=LeaseSpec(
            holderIdentity=lease.holder,
            acquireTime=_micro_time(lease.acquire_time),
            renewTime=_micro_time(lease.renew_time),
            leaseDurationSeconds=lease.duration_s,
            leaseTransitions=lease.transitions,
        ),
    )


def _lease_from_k8s(obj: K8sLease) -> Lease:
    meta = obj.metadata or ObjectMeta()
    spec = obj.spec or LeaseSpec()
    return Lease(
        name=meta.name or "",
        namespace=meta.namespace or "",
        holder=spec.holderIdentity,
        acquire_time=_seconds(spec.acquireTime),
        renew_time=_seconds(spec.renewTime),
        duration_s=spec.leaseDurationSeconds,
        transitions=spec.leaseTransitions or 0,
        resource_version=meta.resourceVersion or "",
    )


class LightkubeCluster:
    """ClusterAPI on `lightkube.AsyncClient`, bound to one namespace.

    `qps`/`burst` size the client-side request budget; `max_retries` and `backoff_s` (the
    first delay, doubled per retry) govern retries of 429, 5xx and connection errors. A pod
    create makes no retry that would start more than `create_deadline_s` after its first
    attempt (None: only `max_retries` bounds it).
    Without `client`, one is built by `build_client` from `kubeconfig`/`context`. The
    cluster owns the client: `close` closes it.
    """

    def __init__(
        self,
        *,
        namespace: str,
        clock: Clock,
        qps: float = 50,
        burst: int = 100,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        create_deadline_s: float | None = None,
        client: AsyncClient | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
    ) -> None:
        if client is not None and (kubeconfig is not None or context is not None):
            raise ValueError("pass either a client or kubeconfig/context, not both")
        if max_retries < 0 or backoff_s < 0:
            raise ValueError("max_retries and backoff_s must be >= 0")
        if create_deadline_s is not None and create_deadline_s <= 0:
            raise ValueError("create_deadline_s must be > 0")
        self._namespace = namespace
        self._clock = clock
        self._budget = TokenBucket(clock, rate=qps, burst=burst)
        self._max_retries = max_retries
        self._backoff_s = backoff_s
        self._create_deadline_s = create_deadline_s
        self._client = (
            client
            if client is not None
            else self.build_client(kubeconfig=kubeconfig, context=context, namespace=namespace)
        )

    @classmethod
    def build_client(
        cls,
        *,
        kubeconfig: str | None = None,
        context: str | None = None,
        namespace: str | None = None,
    ) -> AsyncClient:
        """A lightkube client for the in-cluster service account or a kubeconfig.

        With `kubeconfig`, that file; without it, the pod's service account when stoker
        runs in a cluster, else `$KUBECONFIG` or `~/.kube/config`. `context` picks a
        context of the file (default: its current context).
        """
        try:
            config = (
                KubeConfig.from_file(kubeconfig)
                if kubeconfig is not None
                else KubeConfig.from_env()
            )
            return AsyncClient(config=config.get(context), namespace=namespace)
        except lightkube.ConfigError as exc:
            raise ConfigError(f"kubernetes: {exc}") from exc

    @property
    def namespace(self) -> str:
        """The namespace every call acts in."""
        return self._namespace

    def _backoff(self, attempt: int) -> float:
        return float(min(self._backoff_s * 2**attempt, _MAX_BACKOFF_S))

    def _retry_delay(
        self, exc: httpx2.HTTPStatusError | httpx2.TransportError, attempt: int, what: str
    ) -> float:
        """How long to wait before trying `what` again after `exc` failed attempt `attempt`.

        Raises the `ClusterError` for `exc` instead when no retry can help: a status a retry
        does not change, or the retries are used up.
        """
        if isinstance(exc, httpx2.HTTPStatusError):
            if not _retryable(_status_of(exc)) or attempt >= self._max_retries:
                raise _cluster_error(exc, what) from exc
            return max(self._backoff(attempt), _retry_after(exc) or 0.0)
        if attempt >= self._max_retries:
            raise ClusterUnavailable(f"{what}: {exc!r}") from exc
        return self._backoff(attempt)

    async def _get(self, kind: type[_Object], name: str, what: str) -> _Object | None:
        """GET one object of this namespace by name; None on 404 (it does not exist)."""
        try:
            return await self._request(
                f"get {what} {name}",
                lambda: self._client.get(kind, name, namespace=self._namespace),
            )
        except ObjectNotFound:
            return None

    async def _request(
        self, what: str, call: Callable[[], Awaitable[T]], *, deadline_s: float | None = None
    ) -> T:
        """Run `call` within the budget, retrying what a retry can fix; no retry that would
        start more than `deadline_s` after the first attempt (the wait for the budget's
        first token not included: that is the queue of other requests, not an outage)."""
        attempt = 0
        first: float | None = None
        while True:
            await self._budget.acquire()
            if first is None:
                first = self._clock.monotonic()
            try:
                return await call()
            except (httpx2.HTTPStatusError, httpx2.TransportError) as exc:
                delay = self._retry_delay(exc, attempt, what)
                cause = (
                    f"HTTP {_status_of(exc)}"
                    if isinstance(exc, httpx2.HTTPStatusError)
                    else type(exc).__name__
                )
                if deadline_s is not None and (
                    self._clock.monotonic() + delay - first > deadline_s
                ):
                    raise ClusterUnavailable(
                        f"{what}: no answer within {deadline_s:g}s ({attempt + 1} attempts, "
                        f"last: {exc!r})",
                        status=_status_of(exc) if isinstance(exc, httpx2.HTTPStatusError) else None,
                    ) from exc
            attempt += 1
            logger.warning(
                "event=cluster_retry request=%r cause=%s attempt=%d delay_s=%.3f",
                what,
                cause,
                attempt,
                delay,
            )
            await self._clock.sleep(delay)

    async def denied(self, wanted: Sequence[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
        """Of `wanted` (API group, resource, verb), what these credentials may not do in the
        namespace: each asked of the API server as a SelfSubjectAccessReview, which stores
        nothing. A 401 (the credentials are refused) raises."""
        refused = []
        for group, resource, verb in wanted:
            attributes = ResourceAttributes(
                group=group, resource=resource, verb=verb, namespace=self._namespace
            )
            review = SelfSubjectAccessReview(
                spec=SelfSubjectAccessReviewSpec(resourceAttributes=attributes)
            )
            answer = await self._request(
                f"review access to {verb} {resource}",
                lambda review=review: self._client.create(review),  # type: ignore[misc]
            )
            if answer.status is None or not answer.status.allowed:
                refused.append((group, resource, verb))
        return refused

    async def create_pod(self, pod: Pod) -> Pod:
        """POST the pod; `Conflict` if the name exists; `ClusterUnavailable` once retries
        would run past `create_deadline_s`.

        A create retried after a connection error may meet its own earlier success as a
        `Conflict`: the caller reads the pod to tell.
        """
        body = _pod_to_k8s(pod, self._namespace)
        created = await self._request(
            f"create pod {pod.name}",
            lambda: self._client.create(body, field_manager=FIELD_MANAGER),
            deadline_s=self._create_deadline_s,
        )
        return _pod_from_k8s(created)

    async def admit_pod(self, pod: Pod) -> None:
        """POST the pod as a server-side dry run (`dryRun=All`): the API server validates
        it and runs its admission (PriorityClass, LimitRange, ResourceQuota, webhooks) and
        stores nothing. `Invalid` or `Forbidden` with the API server's reason when it would
        refuse the pod; a name that exists already is no objection (`Conflict` is not
        raised)."""
        body = _pod_to_k8s(pod, self._namespace)
        try:
            await self._request(
                f"create pod {pod.name}",
                lambda: self._client.create(body, field_manager=FIELD_MANAGER, dry_run=True),
            )
        except Conflict:
            return

    async def delete_pod(self, name: str, grace_s: float | None = None) -> None:
        """DELETE the pod with `gracePeriodSeconds` (whole seconds, rounded up); 404 is fine."""
        grace = None if grace_s is None else max(0, math.ceil(grace_s))
        try:
            await self._request(
                f"delete pod {name}",
                lambda: self._client.delete(
                    K8sPod, name, namespace=self._namespace, grace_period=grace
                ),
            )
        except ObjectNotFound:
            return

    async def patch_pod(
        self, name: str, labels: MetadataPatch = None, annotations: MetadataPatch = None
    ) -> Pod:
        """A JSON merge patch of metadata; a null value removes the key."""
        metadata: dict[str, Any] = {}
        if labels is not None:
            metadata["labels"] = dict(labels)
        if annotations is not None:
            metadata["annotations"] = dict(annotations)
        patched = await self._request(
            f"patch pod {name}",
            lambda: self._client.patch(
                K8sPod,
                name,
                {"metadata": metadata},
                namespace=self._namespace,
                patch_type=PatchType.MERGE,
                field_manager=FIELD_MANAGER,
            ),
        )
        return _pod_from_k8s(patched)

    async def get_pod(self, name: str) -> Pod | None:
        """GET the pod; None on 404."""
        found = await self._get(K8sPod, name, "pod")
        return None if found is None else _pod_from_k8s(found)

    async def list_pods(self, selector: Selector) -> PodList:
        """One LIST with `labelSelector`; its resourceVersion is where a watch starts."""

        async def list_once() -> tuple[list[K8sPod], str]:
            listing = self._client.list(
                K8sPod, namespace=self._namespace, labels=dict(selector) or None
            )
            items = [item async for item in listing]
            return items, listing.resourceVersion

        items, resource_version = await self._request("list pods", list_once)
        return PodList(
            items=tuple(_pod_from_k8s(item) for item in items), resource_version=resource_version
        )

    async def watch_pods(
        self, selector: Selector, resource_version: str
    ) -> AsyncGenerator[WatchEvent, None]:
        """WATCH from `resource_version`; a 410 (as a status or an ERROR event) is `Gone`.

        Throttling, server and connection errors re-open the watch after a backoff from
        the last resourceVersion seen, so nothing is missed and nothing repeated.
        """
        since = resource_version or None
        failures = 0
        while True:
            await self._budget.acquire()
            stream = cast(
                AsyncGenerator[tuple[str, K8sPod], None],
                self._client.watch(
                    K8sPod,
                    namespace=self._namespace,
                    labels=dict(selector) or None,
                    resource_version=since,
                ),
            )
            try:
                async for kind, obj in stream:
                    failures = 0
                    pod = _pod_from_k8s(obj)
                    since = pod.resource_version or since
                    if kind in _EVENT_TYPES:  # BOOKMARK is never asked for
                        yield WatchEvent(_EVENT_TYPES[kind], pod)
                return  # lightkube re-opens closed watches itself; ending is final
            except (httpx2.HTTPStatusError, httpx2.TransportError) as exc:
                if isinstance(exc, httpx2.HTTPStatusError) and _status_of(exc) == 410:
                    raise Gone(f"watch pods from {since}: {_message_of(exc)}", status=410) from exc
                delay = self._retry_delay(exc, failures, "watch pods")
            finally:
                await stream.aclose()
            failures += 1
            logger.warning(
                "event=cluster_watch_retry since=%s attempt=%d delay_s=%.3f",
                since,
                failures,
                delay,
            )
            await self._clock.sleep(delay)

    async def get_lease(self, name: str) -> Lease | None:
        """GET the lease; None on 404."""
        found = await self._get(K8sLease, name, "lease")
        return None if found is None else _lease_from_k8s(found)

    async def create_lease(self, lease: Lease) -> Lease:
        """POST the lease; `Conflict` if it exists."""
        # A create must not carry a resourceVersion: the API server rejects one.
        body = _lease_to_k8s(replace(lease, resource_version=""), self._namespace)
        created = await self._request(
            f"create lease {lease.name}",
            lambda: self._client.create(body, field_manager=FIELD_MANAGER),
        )
        return _lease_from_k8s(created)

    async def update_lease(self, lease: Lease) -> Lease:
        """PUT the lease with its resourceVersion: the API server does the compare-and-set."""
        body = _lease_to_k8s(lease, self._namespace)
        replaced = await self._request(
            f"update lease {lease.name}",
            lambda: self._client.replace(body, field_manager=FIELD_MANAGER),
        )
        return _lease_from_k8s(replaced)

    async def close(self) -> None:
        """Close the client and its connections; open watches end."""
        await self._client.close()
