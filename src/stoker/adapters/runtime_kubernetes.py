"""The Kubernetes runtime: every worker is a pod, created and watched through the ClusterAPI port.

A worker is one pod named after the worker id, built from the pool's `PodTemplate`
(requests equal limits, `restartPolicy: Never`, no owner references: a worker must outlive
the control-plane replica that created it, to be adopted by the next one). Its labels say
which fleet, pool, revision, worker and replica it belongs to; the fleet label scopes every
list and watch, so several stoker deployments can share a namespace.

What happens to pods is learned from an informer, never from a list per claim: one list,
then a watch from the list's resourceVersion, resumed from the last version seen when the
stream ends, a fresh list when the cluster answers `Gone`, and a periodic resync (list and
diff) that emits whatever a missed watch event would have. The informer turns pod changes
into the two runtime events:

- `worker_ready(id, "http://<podIP>:<port>")` once per pod, when it is Running, Ready and
  has an IP (also for ready pods found by the first list; the pool manager ignores workers
  it does not own);
- `worker_lost(id, reason)` once per pod, when it is deleted (or starts terminating),
  Failed or Succeeded: `"evicted"` for a pod the kubelet evicted, else `"lost"`. A pod that
  this runtime was asked to stop is never reported.

`karpenter.sh/do-not-disrupt: "true"` pins a busy worker's node (activating, hot, hot_idle)
so that consolidation moves only neutral workers. Headroom placeholders are low-priority
pause pods that keep the node autoscaler holding spare nodes; a burst of worker pods
preempts them instead of waiting for new nodes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import re
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from stoker.domain.errors import ActivationRejected, RuntimeFailure
from stoker.domain.records import Worker
from stoker.domain.specs import PodTemplate, PoolSpec
from stoker.ports.clock import Clock
from stoker.ports.cluster import (
    ClusterAPI,
    ClusterError,
    Conflict,
    Container,
    Gone,
    ObjectNotFound,
    Pod,
    PodPhase,
    PodSpec,
    Toleration,
    WatchEvent,
    WatchEventType,
)
from stoker.ports.runtime import ActivationPayload, RuntimeListener, RuntimeObject

logger = logging.getLogger("stoker.runtime.kubernetes")

T = TypeVar("T")

#: Labels every pod of this runtime carries.
LABEL_FLEET = "stoker.dev/fleet"
LABEL_POOL = "stoker.dev/pool"
LABEL_REVISION = "stoker.dev/revision"
LABEL_WORKER_ID = "stoker.dev/worker-id"
LABEL_INSTANCE = "stoker.dev/instance"
#: Placeholders carry the pool they hold nodes for, and a digest of their pod spec.
LABEL_PLACEHOLDER = "stoker.dev/placeholder"
LABEL_PLACEHOLDER_SPEC = "stoker.dev/placeholder-spec"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
#: Karpenter does not consolidate a node running a pod with this annotation set to "true".
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"

#: The worker container's name in every worker pod.
WORKER_CONTAINER = "worker"

#: An activator hands a worker its org: (worker, payload, timeout) -> None, or raises
#: `ActivationRejected` / `RuntimeFailure`. The default POSTs to the worker's `/activate`.
Activator = Callable[[Worker, ActivationPayload, float], Awaitable[None]]

#: How long `adopt` and `list_objects` wait for the informer's first list.
SYNC_TIMEOUT_S = 60.0
#: Backoff of the informer after a failed list or watch: doubles up to the ceiling.
WATCH_BACKOFF_S = 0.5
MAX_WATCH_BACKOFF_S = 30.0
#: Pause between activation attempts that found the worker's port closed.
ACTIVATION_RETRY_S = 0.2

_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_NOT_DNS = re.compile(r"[^a-z0-9-]+")
_FINISHED = frozenset({PodPhase.FAILED, PodPhase.SUCCEEDED})


def _log(event: str, *, level: int = logging.INFO, **fields: Any) -> None:
    """One `key=value` line per event, like the rest of stoker's logs."""
    if logger.isEnabledFor(level):
        parts = [f"event={event}", *(f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None)]
        logger.log(level, " ".join(parts))


def _fmt(value: Any) -> str:
    text = str(value)
    if not text or any(c in text for c in ' ="'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def _valid_label_value(value: str) -> bool:
    return len(value) <= 63 and _LABEL_VALUE.fullmatch(value) is not None


@dataclass(frozen=True, slots=True)
class _PodView:
    """What the informer keeps of one pod: only the fields it decides on.

    Kept instead of the whole `Pod` so that the cache of a large fleet does not hold
    every worker's environment and spec.
    """

    name: str
    worker_id: str | None
    pool: str
    instance: str | None
    placeholder: str | None
    phase: str
    ready: bool
    pod_ip: str | None
    port: int | None
    reason: str | None
    terminating: bool
    do_not_disrupt: str | None
    created_at: float | None
    resource_version: str

    @classmethod
    def of(cls, pod: Pod) -> _PodView:
        labels = pod.labels
        containers = pod.spec.containers
        ports = containers[0].ports if containers else ()
        return cls(
            name=pod.name,
            worker_id=labels.get(LABEL_WORKER_ID),
            pool=labels.get(LABEL_POOL, ""),
            instance=labels.get(LABEL_INSTANCE),
            placeholder=labels.get(LABEL_PLACEHOLDER),
            phase=pod.phase,
            ready=pod.ready,
            pod_ip=pod.pod_ip,
            port=ports[0] if ports else None,
            reason=pod.reason,
            terminating=pod.deletion_timestamp is not None,
            do_not_disrupt=pod.annotations.get(DO_NOT_DISRUPT),
            created_at=pod.created_at,
            resource_version=pod.resource_version,
        )

    @property
    def finished(self) -> bool:
        """Failed or Succeeded: a pod with restartPolicy Never never runs again."""
        return self.phase in _FINISHED

    @property
    def alive(self) -> bool:
        """Not finished and not on its way out."""
        return not self.finished and not self.terminating

    @property
    def serving(self) -> bool:
        """Running, Ready, with an IP, and not terminating: it can take an activation."""
        return (
            self.alive
            and self.phase == PodPhase.RUNNING
            and self.ready
            and bool(self.pod_ip)
            and self.port is not None
        )

    @property
    def endpoint(self) -> str | None:
        """`http://<podIP>:<port>` (IPv6 in brackets), or None before the pod has an IP."""
        if not self.pod_ip or self.port is None:
            return None
        host = f"[{self.pod_ip}]" if ":" in self.pod_ip else self.pod_ip
        return f"http://{host}:{self.port}"

    @property
    def loss_reason(self) -> str:
        """What `worker_lost` says: "evicted" for a kubelet eviction, else "lost"."""
        return "evicted" if self.reason == "Evicted" else "lost"


@dataclass(slots=True)
class _Entry:
    """A cached pod and what has been reported about it."""

    view: _PodView
    #: worker_ready was emitted.
    announced: bool = False
    #: worker_lost was emitted, or the pod's end was requested by `stop`: nothing more to say.
    settled: bool = False
    #: What `list_objects` made of `view` last time (rebuilt once the view changes).
    listed: tuple[_PodView, RuntimeObject] | None = None


class KubernetesRuntime:
    """Runs workers as pods through a `ClusterAPI`; implements the `Runtime` port.

    `fleet` labels every pod (and scopes the informer); `instance_id` is this replica's id,
    stamped on the pods it creates or adopts. `activator` replaces the HTTP activation
    (the simulator injects one). `resync_s` is the informer's list-and-diff period.
    Placeholders use `placeholder_priority_class` (required for headroom: without a class
    below the workers' they would never be preempted), `placeholder_image`, and
    `placeholder_size` = (cpu, memory), else the pool worker's size. `stop_grace_s`, when
    set, caps the grace of every stop and the pods' terminationGracePeriodSeconds; by
    default both are the pool's `timeouts.stop_grace_s`.
    """

    kind = "kubernetes"

    def __init__(
        self,
        *,
        cluster: ClusterAPI,
        clock: Clock,
        fleet: str,
        instance_id: str,
        activator: Activator | None = None,
        resync_s: float = 300.0,
        placeholder_priority_class: str | None = None,
        placeholder_image: str = "registry.k8s.io/pause:3.10",
        placeholder_size: tuple[str, str] | None = None,
        stop_grace_s: float | None = None,
        sync_timeout_s: float = SYNC_TIMEOUT_S,
    ) -> None:
        if not _valid_label_value(fleet) or not fleet:
            raise ValueError(f"fleet {fleet!r} is not a valid Kubernetes label value")
        if not _valid_label_value(instance_id) or not instance_id:
            raise ValueError(f"instance_id {instance_id!r} is not a valid Kubernetes label value")
        if resync_s <= 0 or sync_timeout_s <= 0:
            raise ValueError("resync_s and sync_timeout_s must be > 0")
        if stop_grace_s is not None and stop_grace_s < 0:
            raise ValueError("stop_grace_s must be >= 0")
        self.cluster = cluster
        self.clock = clock
        self.fleet = fleet
        self.instance_id = instance_id
        self.resync_s = resync_s
        self.placeholder_priority_class = placeholder_priority_class
        self.placeholder_image = placeholder_image
        self.placeholder_size = placeholder_size
        self.stop_grace_s = stop_grace_s
        self.sync_timeout_s = sync_timeout_s
        self._activator: Activator = activator if activator is not None else self._http_activate
        self._http = activator is None
        self._client: aiohttp.ClientSession | None = None
        self._listener: RuntimeListener | None = None
        self._selector = {LABEL_FLEET: fleet}
        #: Every pod of the fleet (workers and placeholders), by name.
        self._cache: dict[str, _Entry] = {}
        #: Names of the placeholder pods in `_cache` (headroom looks at these only).
        self._placeholder_names: set[str] = set()
        #: Placeholder pods by pool name, with the (template, count) they were made from
        #: (their digest is costly to compute on every pass).
        self._placeholder_pods: dict[str, tuple[tuple[PodTemplate, int], list[Pod]]] = {}
        #: Where the watch resumes; None means list first.
        self._rv: str | None = None
        self._synced = asyncio.Event()
        self._informer: asyncio.Task[None] | None = None
        #: Pods `stop` deleted, with the monotonic time of the request: not losses.
        self._stopping: dict[str, float] = {}
        #: Informer statistics (for metrics and tests).
        self.lists = 0
        self.watches = 0

    # -- lifecycle of the runtime itself ----------------------------------------------------

    def subscribe(self, listener: RuntimeListener) -> None:
        """Route readiness and loss events to `listener` (before `start`)."""
        self._listener = listener

    async def start(self) -> None:
        """Start the informer (it lists in the background) and the activation client."""
        if self._http and self._client is None:
            self._client = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30),
                # Pod IPs are reached directly: a proxy from the environment must not apply.
                trust_env=False,
            )
        if self._informer is None:
            self._informer = asyncio.create_task(self._inform(), name="kubernetes-informer")

    async def close(self) -> None:
        """Stop the informer; the pods keep running, to be adopted by the next start."""
        informer, self._informer = self._informer, None
        if informer is not None:
            informer.cancel()
            await asyncio.gather(informer, return_exceptions=True)
        if self._client is not None:
            await self._client.close()
            self._client = None

    def derived_cap(self, pool: PoolSpec) -> int:
        """0: the cluster and its node autoscaler bound the fleet, not this machine."""
        return 0

    # -- spawn ------------------------------------------------------------------------------

    async def spawn(self, worker: Worker, pool: PoolSpec) -> Mapping[str, Any]:
        """Create the worker's pod; readiness is reported later by `worker_ready`.

        Returns the ref `{pod, namespace, port}`. Raises `RuntimeFailure` when the pool
        has no pod template or the cluster refuses the pod. Creations are not serialised
        here: a burst fans out in parallel, paced only by the cluster client's budget.
        """
        template = pool.template
        if not isinstance(template, PodTemplate):
            raise RuntimeFailure(f"pool {pool.name!r} has no pod template")
        if not _valid_label_value(pool.name):
            raise RuntimeFailure(
                f"pool {pool.name!r} is not a valid Kubernetes label value "
                "(at most 63 characters, alphanumeric at both ends)"
            )
        pod = self._worker_pod(worker, pool, template)
        try:
            await self.cluster.create_pod(pod)
        except Conflict as exc:
            # A create retried after a lost answer meets its own success: check whose it is.
            if not await self._is_own_pod(pod.name, worker.id):
                raise RuntimeFailure(f"pod {pod.name} exists and is not this worker's") from exc
        except ClusterError as exc:
            raise RuntimeFailure(f"cannot create pod {pod.name}: {exc}") from exc
        _log("worker_spawned", worker=worker.id, pool=pool.name, pod=pod.name)
        return {"pod": pod.name, "namespace": self.cluster.namespace, "port": template.port}

    def _worker_pod(self, worker: Worker, pool: PoolSpec, template: PodTemplate) -> Pod:
        substitutions = {"{port}": str(template.port), "{worker_id}": worker.id}
        env = {key: _substitute(value, substitutions) for key, value in template.env.items()}
        env.update(
            {
                "STOKER_WORKER_ID": worker.id,
                "STOKER_POOL": pool.name,
                "STOKER_FLEET": self.fleet,
                "STOKER_PORT": str(template.port),
            }
        )
        labels = {
            **template.labels,
            LABEL_MANAGED_BY: "stoker",
            LABEL_FLEET: self.fleet,
            LABEL_POOL: pool.name,
            LABEL_REVISION: pool.revision,
            LABEL_WORKER_ID: worker.id,
            LABEL_INSTANCE: self.instance_id,
        }
        # The do-not-disrupt pin is stoker's to set while a worker is busy: a neutral
        # worker must stay movable, whatever the template says.
        annotations = {k: v for k, v in template.annotations.items() if k != DO_NOT_DISRUPT}
        return Pod(
            name=worker.id,
            labels=labels,
            annotations=annotations,
            spec=PodSpec(
                containers=(
                    Container(
                        name=WORKER_CONTAINER,
                        image=template.image,
                        command=tuple(_substitute(a, substitutions) for a in template.command),
                        args=tuple(_substitute(a, substitutions) for a in template.args),
                        env=env,
                        cpu=template.cpu,
                        memory=template.memory,
                        ports=(template.port,),
                    ),
                ),
                node_selector=dict(template.node_selector),
                tolerations=_tolerations(template.tolerations),
                priority_class_name=template.priority_class,
                service_account_name=template.service_account,
                restart_policy="Never",
                termination_grace_period_s=math.ceil(self._grace(pool.timeouts.stop_grace_s)),
            ),
        )

    async def _is_own_pod(self, name: str, worker_id: str) -> bool:
        try:
            existing = await self.cluster.get_pod(name)
        except ClusterError:
            return False
        return (
            existing is not None
            and existing.labels.get(LABEL_FLEET) == self.fleet
            and existing.labels.get(LABEL_WORKER_ID) == worker_id
        )

    def _grace(self, grace_s: float) -> float:
        grace = max(0.0, grace_s)
        return grace if self.stop_grace_s is None else min(grace, self.stop_grace_s)

    # -- activation -------------------------------------------------------------------------

    async def activate(self, worker: Worker, payload: ActivationPayload, timeout: float) -> None:
        """Hand the worker its org through the activator (default: HTTP `/activate`)."""
        await self._activator(worker, payload, timeout)

    async def _http_activate(
        self, worker: Worker, payload: ActivationPayload, timeout: float
    ) -> None:
        """POST the payload to `{endpoint}/activate` (DESIGN.md §7).

        `ActivationRejected` on 409 (another org, stale epoch); `RuntimeFailure` on any
        other answer, a timeout or a connection error. A refused connection is retried
        until the timeout: a pod can report Ready a moment before its server listens.
        """
        client = self._client
        if client is None:
            raise RuntimeFailure("the kubernetes runtime is not started")
        endpoint = worker.endpoint or self._endpoint_of(worker)
        if not endpoint:
            raise RuntimeFailure(f"worker {worker.id} has no endpoint")
        body = {f.name: getattr(payload, f.name) for f in dataclasses.fields(payload)}
        body["config"] = dict(payload.config)
        url = f"{endpoint}/activate"

        async def post() -> tuple[int, str]:
            timeout_off = aiohttp.ClientTimeout(total=None)  # the clock bounds the call
            async with client.post(url, json=body, timeout=timeout_off) as response:
                return response.status, await response.text()

        deadline = self.clock.monotonic() + timeout
        while True:
            try:
                status, text = await _within(self.clock, post(), deadline - self.clock.monotonic())
                break
            except aiohttp.ClientConnectorError as exc:
                # Nothing reached the worker: trying again cannot activate it twice.
                if deadline - self.clock.monotonic() <= ACTIVATION_RETRY_S:
                    raise RuntimeFailure(
                        f"activation of worker {worker.id} failed: {exc!r}"
                    ) from exc
                await self.clock.sleep(ACTIVATION_RETRY_S)
            except (aiohttp.ClientError, TimeoutError, TypeError, ValueError) as exc:
                # TypeError/ValueError: a config that does not serialise to JSON.
                raise RuntimeFailure(f"activation of worker {worker.id} failed: {exc!r}") from exc
        if status == 409:
            raise ActivationRejected(
                f"worker {worker.id} rejected epoch {payload.epoch}: {_detail(text)}"
            )
        if status != 200:
            raise RuntimeFailure(
                f"worker {worker.id} answered {status} to activation: {_detail(text)}"
            )
        # Debug only: the worker's move to hot and `claim_bound` already say it, at info.
        _log(
            "worker_activated",
            level=logging.DEBUG,
            worker=worker.id,
            org=payload.org,
            epoch=payload.epoch,
        )

    def _endpoint_of(self, worker: Worker) -> str | None:
        entry = self._cache.get(_pod_name(worker))
        return entry.view.endpoint if entry is not None else None

    # -- stop, adopt, busy ------------------------------------------------------------------

    async def stop(self, worker: Worker, grace_s: float) -> None:
        """Delete the worker's pod with `grace_s` (capped by `stop_grace_s`).

        The deletion is not reported as a loss. A pod that is already gone is fine.
        Raises `RuntimeFailure` when the cluster refuses the deletion.
        """
        name = _pod_name(worker)
        self._stopping[name] = self.clock.monotonic()
        entry = self._cache.get(name)
        if entry is not None:
            entry.settled = True
        grace = self._grace(grace_s)
        try:
            await self.cluster.delete_pod(name, grace)
        except ClusterError as exc:
            self._stopping.pop(name, None)
            if entry is not None and self._cache.get(name) is entry:
                entry.settled = False
            raise RuntimeFailure(f"cannot delete pod {name}: {exc}") from exc
        _log("worker_stopped", worker=worker.id, pod=name, grace_s=grace)

    async def adopt(self, worker: Worker) -> bool:
        """True if the worker's pod is alive (after the informer's first list).

        The pod is relabelled with this replica's instance id; that label is a hint for
        people and tools (the store's owner is the authority), so a failed relabel is
        logged, not fatal. Raises `RuntimeFailure` if the informer cannot list in time.
        """
        await self._wait_synced()
        name = _pod_name(worker)
        entry = self._cache.get(name)
        if entry is None or not entry.view.alive or entry.view.worker_id != worker.id:
            _log("worker_adopt_failed", worker=worker.id, pod=name, reason="gone")
            return False
        if entry.view.instance != self.instance_id:
            try:
                await self.cluster.patch_pod(name, labels={LABEL_INSTANCE: self.instance_id})
            except ObjectNotFound:
                return False
            except ClusterError as exc:
                _log("worker_relabel_failed", level=logging.WARNING, worker=worker.id, error=exc)
        _log("worker_adopted", worker=worker.id, pool=worker.pool, pod=name)
        return True

    async def set_busy(self, worker: Worker, busy: bool) -> None:
        """Set (busy) or remove `karpenter.sh/do-not-disrupt` on the worker's pod.

        Nothing is sent when the cached pod already carries the wanted value; a pod that
        is gone needs no protection. Raises `RuntimeFailure` when the patch is refused.
        """
        name = _pod_name(worker)
        wanted = "true" if busy else None
        entry = self._cache.get(name)
        if entry is not None and entry.view.do_not_disrupt == wanted:
            return
        try:
            await self.cluster.patch_pod(name, annotations={DO_NOT_DISRUPT: wanted})
        except ObjectNotFound:
            return
        except ClusterError as exc:
            raise RuntimeFailure(f"cannot mark pod {name} busy={busy}: {exc}") from exc
        _log("worker_disruption", worker=worker.id, do_not_disrupt=wanted or "removed")

    async def list_objects(self) -> list[RuntimeObject]:
        """Every worker pod of this fleet, from the informer's cache (no list call)."""
        await self._wait_synced()
        objects = []
        for entry in self._cache.values():
            view = entry.view
            if view.worker_id is None or view.placeholder is not None:
                continue
            listed = entry.listed
            if listed is None or listed[0] is not view:
                listed = entry.listed = (
                    view,
                    RuntimeObject(
                        worker_id=view.worker_id,
                        pool=view.pool,
                        ref={"pod": view.name, "namespace": self.cluster.namespace},
                        created_at=view.created_at if view.created_at is not None else 0.0,
                        alive=view.alive,
                        ready=view.serving,
                        endpoint=view.endpoint,
                        instance=view.instance,
                    ),
                )
            objects.append(listed[1])
        return objects

    async def _wait_synced(self) -> None:
        if self._synced.is_set():
            return
        if self._informer is None:
            raise RuntimeFailure("the kubernetes runtime is not started")
        try:
            await _within(self.clock, self._synced.wait(), self.sync_timeout_s)
        except TimeoutError:
            raise RuntimeFailure(
                f"no list of the fleet's pods within {self.sync_timeout_s:g}s"
            ) from None

    # -- headroom ---------------------------------------------------------------------------

    async def reconcile_headroom(self, pools: Sequence[PoolSpec]) -> None:
        """Keep exactly `headroom_nodes` placeholder pods per pool; never touch workers.

        Placeholder names are derived from the fleet, the pool, the index and a digest of
        the spec, so two leaders (or a cache that lags a write) create the same names and
        the second create is a harmless conflict. A size change gives new names: the old
        placeholders are deleted and new ones created. 0, or a pool that is gone, deletes
        them. Raises `RuntimeFailure` after the other pools are reconciled when placeholders
        are wanted without `placeholder_priority_class`, or when the cluster refuses a call.
        """
        await self._wait_synced()
        wanted: dict[str, Pod] = {}
        problems: list[str] = []
        for pool in pools:
            if pool.headroom_nodes <= 0 or not isinstance(pool.template, PodTemplate):
                continue
            if self.placeholder_priority_class is None:
                problems.append(
                    f"pool {pool.name!r} wants {pool.headroom_nodes} headroom placeholders, but "
                    "no placeholder priority class is set: they would never be preempted"
                )
                continue
            if not _valid_label_value(pool.name):
                problems.append(f"pool {pool.name!r} is not a valid Kubernetes label value")
                continue
            made_from = (pool.template, pool.headroom_nodes)
            cached = self._placeholder_pods.get(pool.name)
            if cached is not None and cached[0] == made_from:
                pods = cached[1]
            else:
                pods = list(self._placeholders(pool, pool.template))
                self._placeholder_pods[pool.name] = (made_from, pods)
            for pod in pods:
                wanted[pod.name] = pod
        present: set[str] = set()
        doomed: list[str] = []
        for name in self._placeholder_names:
            view = self._cache[name].view
            if view.terminating:
                continue
            if name in wanted and not view.finished:
                present.add(name)
            else:
                # Not wanted any more, or finished (evicted): delete, so that a finished
                # placeholder's name is free to be created again on the next pass.
                doomed.append(name)
        calls: list[Awaitable[Any]] = [self.cluster.delete_pod(name, 0.0) for name in doomed]
        calls += [
            self._create_placeholder(pod) for name, pod in wanted.items() if name not in present
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        for failure in failures:
            if not isinstance(failure, Exception):
                raise failure
            problems.append(str(failure))
        if doomed or len(calls) > len(doomed):
            _log(
                "headroom_reconciled",
                wanted=len(wanted),
                deleted=len(doomed),
                created=len(calls) - len(doomed),
                failed=len(failures),
            )
        if problems:
            raise RuntimeFailure("headroom: " + "; ".join(problems))

    def _placeholders(self, pool: PoolSpec, template: PodTemplate) -> Iterable[Pod]:
        cpu, memory = self.placeholder_size or (template.cpu, template.memory)
        spec = PodSpec(
            containers=(
                Container(name="pause", image=self.placeholder_image, cpu=cpu, memory=memory),
            ),
            # On the workers' nodes: headroom elsewhere would make the wrong node pool grow.
            node_selector=dict(template.node_selector),
            tolerations=_tolerations(template.tolerations),
            priority_class_name=self.placeholder_priority_class,
            restart_policy="Never",
            # A pause container has nothing to flush: preemption frees the node at once.
            termination_grace_period_s=0,
        )
        digest = hashlib.sha256(
            json.dumps(
                [self.fleet, pool.name, dataclasses.asdict(spec)], sort_keys=True, default=str
            ).encode()
        ).hexdigest()[:10]
        stem = _NOT_DNS.sub("-", pool.name.lower()).strip("-")[:30].strip("-") or "pool"
        labels = {
            LABEL_MANAGED_BY: "stoker",
            LABEL_FLEET: self.fleet,
            LABEL_PLACEHOLDER: pool.name,
            LABEL_PLACEHOLDER_SPEC: digest,
        }
        for index in range(pool.headroom_nodes):
            yield Pod(name=f"headroom-{stem}-{digest}-{index}", labels=labels, spec=spec)

    async def _create_placeholder(self, pod: Pod) -> None:
        try:
            await self.cluster.create_pod(pod)
        except Conflict:
            return  # created by another leader, or by us before the cache saw it

    # -- the informer -----------------------------------------------------------------------

    async def _inform(self) -> None:
        """List, watch, resume, relist on Gone, resync periodically: until cancelled."""
        failures = 0
        next_resync = 0.0
        while True:
            try:
                if self._rv is None:
                    await self._relist()
                    failures = 0
                    next_resync = self.clock.monotonic() + self.resync_s
                outcome = await self._watch_until(next_resync)
            except asyncio.CancelledError:
                raise
            except Gone as exc:
                # The history the watch needs is compacted away: only a new list helps.
                _log("informer_relist", level=logging.WARNING, reason="gone", error=exc)
                self._rv = None
                continue
            except Exception as exc:
                # An outage or a bug: back off and resume from the last version seen.
                failures += 1
                delay = min(WATCH_BACKOFF_S * 2 ** (failures - 1), MAX_WATCH_BACKOFF_S)
                _log(
                    "informer_failed",
                    level=logging.WARNING,
                    error=repr(exc),
                    attempt=failures,
                    delay_s=delay,
                )
                await self.clock.sleep(delay)
                continue
            if outcome == "resync":
                self._rv = None
                failures = 0
            elif outcome == "events":
                failures = 0
            else:
                # The stream ended without a single event: do not spin on a server that
                # closes every watch at once.
                failures += 1
                await self.clock.sleep(
                    min(WATCH_BACKOFF_S * 2 ** (failures - 1), MAX_WATCH_BACKOFF_S)
                )

    async def _relist(self) -> None:
        """List the fleet and diff against the cache, emitting what the watch missed."""
        listing = await self.cluster.list_pods(self._selector)
        self.lists += 1
        listed = set()
        for pod in listing.items:
            listed.add(pod.name)
            self._observe(_PodView.of(pod))
        for name in [name for name in self._cache if name not in listed]:
            self._forget(self._cache[name].view)
        # A stop of a pod never seen (its create failed) would otherwise be kept forever.
        horizon = self.clock.monotonic() - self.resync_s
        for name, since in list(self._stopping.items()):
            if name not in self._cache and since < horizon:
                del self._stopping[name]
        self._rv = listing.resource_version
        if not self._synced.is_set():
            _log("informer_synced", pods=len(self._cache), resource_version=self._rv)
        self._synced.set()

    async def _watch_until(self, deadline: float) -> str:
        """Apply watch events until the stream ends or the resync deadline.

        Returns "resync" at the deadline, "events" or "empty" when the stream ended after
        some or no events. The watch runs in a task of its own so that the deadline can
        end it between two events (events are applied without an await, never half-way).
        """
        remaining = deadline - self.clock.monotonic()
        if remaining <= 0 or self._rv is None:
            return "resync"
        stream = self.cluster.watch_pods(self._selector, self._rv)
        self.watches += 1
        consumer = asyncio.ensure_future(self._consume(stream))
        timer = asyncio.ensure_future(self.clock.sleep(remaining))
        try:
            await asyncio.wait((consumer, timer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
            if not consumer.done():
                consumer.cancel()
            await asyncio.gather(consumer, timer, return_exceptions=True)
            await stream.aclose()
        if consumer.cancelled():
            return "resync"
        return "events" if consumer.result() else "empty"

    async def _consume(self, stream: AsyncGenerator[WatchEvent, None]) -> int:
        count = 0
        async for event in stream:
            self._apply(event)
            count += 1
        return count

    def _apply(self, event: WatchEvent) -> None:
        view = _PodView.of(event.pod)
        if event.type is WatchEventType.DELETED:
            self._forget(view)
        else:
            self._observe(view)
        if view.resource_version:
            self._rv = view.resource_version

    def _observe(self, view: _PodView) -> None:
        """A pod was added or changed: remember it and report what it now means."""
        entry = self._cache.get(view.name)
        if entry is None:
            entry = self._cache[view.name] = _Entry(view)
            if view.placeholder is not None and view.worker_id is None:
                self._placeholder_names.add(view.name)
        else:
            entry.view = view
        if view.worker_id is None or view.placeholder is not None or entry.settled:
            return
        if view.name in self._stopping:
            entry.settled = True
            return
        if not view.alive:
            entry.settled = True
            self._report_lost(view)
            return
        if not entry.announced and view.serving:
            entry.announced = True
            endpoint = view.endpoint or ""
            _log(
                "worker_ready",
                level=self._level(view, logging.INFO),
                worker=view.worker_id,
                pool=view.pool,
                endpoint=endpoint,
            )
            if self._listener is not None:
                self._listener.worker_ready(view.worker_id, endpoint)

    def _forget(self, view: _PodView) -> None:
        """A pod is gone from the cluster: drop it and report it if it was a live worker."""
        entry = self._cache.pop(view.name, None)
        self._placeholder_names.discard(view.name)
        stopped = self._stopping.pop(view.name, None) is not None
        if view.worker_id is None or view.placeholder is not None or stopped:
            return
        if entry is not None and entry.settled:
            return
        # `view` is the pod's last state: it tells an eviction from any other end.
        self._report_lost(view)

    def _report_lost(self, view: _PodView) -> None:
        if view.worker_id is None:
            return
        reason = view.loss_reason
        # A pod deleted through the API (another replica's janitor retiring it, or an
        # operator) is no surprise: the pool manager retires its row or fails its claim
        # and says so. Evictions and pods that died on their own are warnings.
        expected = view.terminating and reason != "evicted" and not view.finished
        _log(
            "worker_lost",
            level=self._level(view, logging.INFO if expected else logging.WARNING),
            worker=view.worker_id,
            pool=view.pool,
            phase=view.phase,
            reason=reason,
        )
        if self._listener is not None:
            self._listener.worker_lost(view.worker_id, reason)

    def _level(self, view: _PodView, level: int) -> int:
        """`level` for this replica's own pods; every replica watches the whole fleet, so
        the others' pods (which their own replica reports) are logged at debug level."""
        return level if view.instance == self.instance_id else logging.DEBUG


async def _within(clock: Clock, call: Awaitable[T], seconds: float) -> T:
    """Await `call` for at most `seconds` of `clock` time; `TimeoutError` after that.

    Deadlines run on the injected clock (not `asyncio.timeout`, which reads the loop), so
    they hold on a virtual clock that a test moves forward too.
    """
    work: asyncio.Future[T] = asyncio.ensure_future(call)
    timer = asyncio.ensure_future(clock.sleep(max(seconds, 0.0)))
    try:
        await asyncio.wait((work, timer), return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, timer, return_exceptions=True)
    if work.cancelled():
        raise TimeoutError(f"no answer within {seconds:g}s")
    return work.result()


def _pod_name(worker: Worker) -> str:
    """The pod of a worker: named in its ref, else after the worker (they are the same)."""
    name = worker.runtime_ref.get("pod")
    return name if isinstance(name, str) and name else worker.id


def _substitute(arg: str, substitutions: Mapping[str, str]) -> str:
    # Plain replacement, not str.format: other braces in an argument stay as they are.
    for placeholder, value in substitutions.items():
        arg = arg.replace(placeholder, value)
    return arg


def _tolerations(items: Iterable[Mapping[str, Any]]) -> tuple[Toleration, ...]:
    """Template tolerations (Kubernetes' camelCase or snake_case keys) as the port's type."""
    tolerations = []
    for item in items:
        unknown = set(item) - {
            "key",
            "operator",
            "value",
            "effect",
            "tolerationSeconds",
            "toleration_seconds",
        }
        if unknown:
            raise RuntimeFailure(f"toleration {dict(item)!r} has unknown keys {sorted(unknown)}")
        seconds = item.get("tolerationSeconds", item.get("toleration_seconds"))
        tolerations.append(
            Toleration(
                key=item.get("key"),
                operator=str(item.get("operator", "Equal")),
                value=item.get("value"),
                effect=item.get("effect"),
                toleration_seconds=int(seconds) if seconds is not None else None,
            )
        )
    return tuple(tolerations)


def _detail(text: str) -> str:
    """The `detail` of a problem answer, else the start of the body."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:200]
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        return str(body["detail"])
    return text[:200]
