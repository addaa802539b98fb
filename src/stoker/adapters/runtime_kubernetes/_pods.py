"""The pods of the Kubernetes runtime: their labels, how they are rendered, how they are read.

A worker is one pod named after the worker id, built from the pool's `PodTemplate`
(requests equal limits, `restartPolicy: Never`, no owner references: a worker must outlive
the control-plane replica that created it, to be adopted by the next one). Headroom
placeholders are pause pods named after a digest of their spec.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stoker.domain.activation import MIN_KEY_BYTES, ActivationKey
from stoker.domain.errors import RuntimeFailure
from stoker.domain.records import Worker
from stoker.domain.specs import PodTemplate, PoolSpec
from stoker.domain.states import WorkerState
from stoker.ports.cluster import (
    Condition,
    Container,
    Pod,
    PodPhase,
    PodSpec,
    PreferredNodes,
    Terminated,
    Toleration,
    Waiting,
)
from stoker.ports.runtime import SpawnProgress
from stoker.worker import SECRET_ENV

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
#: The made-up worker of `probe_pod`, and the replica it claims to come from.
PROBE_WORKER = "stoker-config-check"

_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_NOT_DNS = re.compile(r"[^a-z0-9-]+")
_FINISHED = frozenset({PodPhase.FAILED, PodPhase.SUCCEEDED})
#: The PodScheduled condition's reason while no node can take the pod.
UNSCHEDULABLE = "Unschedulable"
#: Waiting reasons of a container whose image cannot be pulled (the kubelet retries).
_PULL_FAILURES = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
)
#: Waiting reasons of a container that cannot be created as specified.
_CREATE_FAILURES = frozenset({"CreateContainerConfigError", "CreateContainerError"})
#: The shortest environment value `refusal` masks.
_MASKED_MIN_CHARS = 4
_TOLERATION_KEYS = frozenset(
    {"key", "operator", "value", "effect", "tolerationSeconds", "toleration_seconds"}
)


def valid_label_value(value: str) -> bool:
    """True when `value` may be a Kubernetes label value (empty included)."""
    return len(value) <= 63 and _LABEL_VALUE.fullmatch(value) is not None


def pod_name(worker: Worker) -> str:
    """The pod of a worker: named in its ref, else after the worker (they are the same)."""
    name = worker.runtime_ref.get("pod")
    return name if isinstance(name, str) and name else worker.id


@dataclass(frozen=True, slots=True)
class PodView:
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
    node_name: str | None = None
    scheduled: Condition | None = None
    nominated_node: str | None = None
    waiting: Waiting | None = None
    started_at: float | None = None
    terminated: Terminated | None = None

    @classmethod
    def of(cls, pod: Pod) -> PodView:
        """The view of `pod`."""
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
            node_name=pod.node_name,
            scheduled=pod.scheduled,
            nominated_node=pod.nominated_node,
            waiting=pod.waiting,
            started_at=pod.started_at,
            terminated=pod.terminated,
        )

    @property
    def is_worker(self) -> bool:
        """A worker pod (not a placeholder, not a pod without stoker's worker label)."""
        return self.worker_id is not None and self.placeholder is None

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
    def progress(self) -> SpawnProgress | None:
        """How the pod gets on towards ready (None once it serves, or when it is gone).

        What the pod object shows, and no more: no events are read. A pod no node fits is
        `unschedulable` (a failure: the pool backs off and says why) yet still waiting: a
        node autoscaler may be bringing a node for it, and its pending pod is what makes
        the autoscaler do so. A nominated pod has room coming (a preemption).
        """
        if not self.alive or self.serving:
            return None
        if self.node_name is None:
            if self.nominated_node:
                return SpawnProgress(
                    "node_coming", waiting=True, detail=f"nominated to {self.nominated_node}"
                )
            scheduled = self.scheduled
            if (
                scheduled is not None
                and scheduled.status == "False"
                and scheduled.reason == UNSCHEDULABLE
            ):
                detail = scheduled.message or "no node fits the pod"
                return SpawnProgress(
                    "unschedulable",
                    waiting=True,
                    failure=f"pod {self.name} unschedulable: {detail}",
                    detail=detail,
                )
            return SpawnProgress("scheduling")
        if self.phase == PodPhase.PENDING:
            waiting = self.waiting
            if waiting is None:
                return SpawnProgress("starting", waiting=True)
            detail = f"{waiting.reason}: {waiting.message}" if waiting.message else waiting.reason
            if waiting.reason in _PULL_FAILURES:
                return SpawnProgress(
                    "image_pull_failing",
                    failure=f"pod {self.name} cannot pull its image: {detail}",
                    detail=detail,
                )
            if waiting.reason in _CREATE_FAILURES:
                return SpawnProgress(
                    "container_failing",
                    failure=f"pod {self.name} cannot start its container: {detail}",
                    detail=detail,
                )
            stage = "pulling" if waiting.reason == "ContainerCreating" else "starting"
            return SpawnProgress(stage, waiting=True, detail=detail)
        return SpawnProgress("not_ready", started_at=self.started_at)

    @property
    def loss_reason(self) -> str:
        """What `worker_lost` says: "evicted" for a kubelet eviction, else "lost"."""
        return "evicted" if self.reason == "Evicted" else "lost"

    @property
    def loss_detail(self) -> str | None:
        """How the pod's worker ended, when its container did (`worker_lost`'s detail: the
        cause a failed spawn shows): its exit code and the kubelet's reason. Never the
        container's message, which may hold what the worker printed."""
        ended = self.terminated
        if ended is None:
            return None
        why = f" ({ended.reason})" if ended.reason else ""
        return f"pod {self.name}: its container exited with code {ended.exit_code}{why}"


def worker_pod(
    worker: Worker,
    pool: PoolSpec,
    template: PodTemplate,
    *,
    fleet: str,
    instance_id: str,
    grace_s: float,
    activation_key: ActivationKey,
    beside: Sequence[tuple[str, int]] = (),
) -> Pod:
    """The pod of `worker`, labelled for `fleet` and the replica `instance_id`, preferring
    the nodes in `beside` (node, sessions it holds; `preferred_nodes`).

    Its environment holds the worker's activation secret, derived from `activation_key`:
    one value per pod, no Secret object per worker; the fleet key stays with the
    control plane.
    """
    substitutions = {"{port}": str(template.port), "{worker_id}": worker.id}
    env = {key: _substitute(value, substitutions) for key, value in template.env.items()}
    env.update(
        {
            "STOKER_WORKER_ID": worker.id,
            "STOKER_POOL": pool.name,
            "STOKER_FLEET": fleet,
            "STOKER_PORT": str(template.port),
            SECRET_ENV: activation_key.worker_secret(worker.id),
        }
    )
    labels = {
        **template.labels,
        LABEL_MANAGED_BY: "stoker",
        LABEL_FLEET: fleet,
        LABEL_POOL: pool.name,
        LABEL_REVISION: pool.revision,
        LABEL_WORKER_ID: worker.id,
        LABEL_INSTANCE: instance_id,
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
            preferred_nodes=preferred_nodes(beside),
            tolerations=tolerations(template.tolerations),
            priority_class_name=template.priority_class,
            service_account_name=template.service_account,
            restart_policy="Never",
            termination_grace_period_s=math.ceil(grace_s),
        ),
    )


def probe_pod(pool: PoolSpec, template: PodTemplate, *, fleet: str) -> Pod:
    """A worker pod of `pool` as the runtime would create it, for a made-up worker
    (`PROBE_WORKER`): what `config check --connect` asks the API server to admit in a
    dry run. Its activation secret comes from a key of zeros: the fleet key stays home.
    """
    worker = Worker(
        id=PROBE_WORKER,
        pool=pool.name,
        revision=pool.revision,
        state=WorkerState.SPAWNING,
        epoch=0,
        owner=PROBE_WORKER,
        created_at=0.0,
        updated_at=0.0,
    )
    return worker_pod(
        worker,
        pool,
        template,
        fleet=fleet,
        instance_id=PROBE_WORKER,
        grace_s=pool.timeouts.stop_grace_s,
        activation_key=ActivationKey(bytes(MIN_KEY_BYTES)),
    )


def refusal(error: Exception, pod: Pod, template: PodTemplate) -> str:
    """Why the API server refused to create `pod`, in its words (the field path and the
    reason, a quota's name and figures), for the pool's status and the log: without the
    request the cluster client prefixes ("create pod <name>: "), and with the values of
    the pod's environment that may be secret (the template's, its activation secret)
    masked, should an admission webhook quote them. Values shorter than
    `_MASKED_MIN_CHARS` are left alone: masking "1" would garble every number.
    """
    text = str(error).removeprefix(f"create pod {pod.name}: ")
    env = pod.spec.containers[0].env if pod.spec.containers else {}
    secret_keys = {*template.env, SECRET_ENV}
    secrets = {value for key, value in env.items() if key in secret_keys}
    for value in sorted(secrets, key=len, reverse=True):
        if len(value) >= _MASKED_MIN_CHARS:
            text = text.replace(value, "***")
    return text


def preferred_nodes(beside: Sequence[tuple[str, int]]) -> tuple[PreferredNodes, ...]:
    """A new worker's preferred nodes: those holding sessions, weighted by how many (the
    most 100, the others their share of it, at least 1), equal weights in one term.

    Sessions pin their node against disruption, so a node goes back only once its last
    session has ended. A warm worker spawned where sessions already are takes its own
    session there; one spawned on the emptiest node (kube-scheduler's default spreads)
    keeps that node for as long as its session lasts.
    """
    top = max((held for _, held in beside), default=0)
    if top <= 0:
        return ()
    by_weight: dict[int, list[str]] = {}
    for node, held in beside:
        if held > 0:
            by_weight.setdefault(max(1, round(100 * held / top)), []).append(node)
    return tuple(
        PreferredNodes(weight, tuple(nodes))
        for weight, nodes in sorted(by_weight.items(), reverse=True)
    )


def placeholder_pods(
    pool: PoolSpec,
    template: PodTemplate,
    *,
    fleet: str,
    image: str,
    priority_class: str | None,
    size: tuple[str, str] | None,
) -> Iterator[Pod]:
    """The pool's `headroom_nodes` pause pods, sized as `size` (cpu, memory) or a worker.

    Their names hold the fleet, the pool, a digest of the spec and an index, so two
    leaders (or a cache that lags a write) create the same names.
    """
    cpu, memory = size or (template.cpu, template.memory)
    spec = PodSpec(
        containers=(Container(name="pause", image=image, cpu=cpu, memory=memory),),
        # On the workers' nodes: headroom elsewhere would make the wrong node pool grow.
        node_selector=dict(template.node_selector),
        tolerations=tolerations(template.tolerations),
        priority_class_name=priority_class,
        restart_policy="Never",
        # A pause container has nothing to flush: preemption frees the node at once.
        termination_grace_period_s=0,
    )
    digest = hashlib.sha256(
        json.dumps(
            [fleet, pool.name, dataclasses.asdict(spec)], sort_keys=True, default=str
        ).encode()
    ).hexdigest()[:10]
    stem = _NOT_DNS.sub("-", pool.name.lower()).strip("-")[:30].strip("-") or "pool"
    labels = {
        LABEL_MANAGED_BY: "stoker",
        LABEL_FLEET: fleet,
        LABEL_PLACEHOLDER: pool.name,
        LABEL_PLACEHOLDER_SPEC: digest,
    }
    for index in range(pool.headroom_nodes):
        yield Pod(name=f"headroom-{stem}-{digest}-{index}", labels=labels, spec=spec)


def tolerations(items: Iterable[Mapping[str, Any]]) -> tuple[Toleration, ...]:
    """Template tolerations (Kubernetes' camelCase or snake_case keys) as the port's type."""
    found = []
    for item in items:
        unknown = set(item) - _TOLERATION_KEYS
        if unknown:
            raise RuntimeFailure(f"toleration {dict(item)!r} has unknown keys {sorted(unknown)}")
        seconds = item.get("tolerationSeconds", item.get("toleration_seconds"))
        found.append(
            Toleration(
                key=item.get("key"),
                operator=str(item.get("operator", "Equal")),
                value=item.get("value"),
                effect=item.get("effect"),
                toleration_seconds=int(seconds) if seconds is not None else None,
            )
        )
    return tuple(found)


def _substitute(arg: str, substitutions: Mapping[str, str]) -> str:
    # Plain replacement, not str.format: other braces in an argument stay as they are.
    for placeholder, value in substitutions.items():
        arg = arg.replace(placeholder, value)
    return arg
