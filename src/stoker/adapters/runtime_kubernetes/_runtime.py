"""The Kubernetes runtime itself: spawn, stop, adopt, pin and list worker pods."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

from stoker.adapters._logs import EventLog
from stoker.adapters.runtime_kubernetes._headroom import Headroom, Placeholders
from stoker.adapters.runtime_kubernetes._informer import PodInformer
from stoker.adapters.runtime_kubernetes._pods import (
    DO_NOT_DISRUPT,
    LABEL_FLEET,
    LABEL_INSTANCE,
    LABEL_WORKER_ID,
    pod_name,
    refusal,
    valid_label_value,
    worker_pod,
)
from stoker.domain.activation import ActivationKey
from stoker.domain.errors import RuntimeFailure
from stoker.domain.records import Worker
from stoker.domain.specs import PodTemplate, PoolSpec
from stoker.ports.clock import Clock
from stoker.ports.cluster import ClusterAPI, ClusterError, Conflict, ObjectNotFound
from stoker.ports.runtime import RuntimeListener, RuntimeObject, SpawnProgress

_log = EventLog("stoker.runtime.kubernetes")

#: How long `adopt` and `list_objects` wait for the informer's first list.
SYNC_TIMEOUT_S = 60.0
#: A new worker pod prefers at most this many nodes: those holding the most sessions.
PREFERRED_NODES = 16


class KubernetesRuntime:
    """Runs workers as pods through a `ClusterAPI`; implements the `Runtime` port.

    `fleet` labels every pod (and scopes the informer); `instance_id` is this replica's id,
    stamped on the pods it creates or adopts. `resync_s` is the informer's list-and-diff
    period. Placeholders use `placeholder_priority_class` (required for headroom: without a
    class below the workers' they would never be preempted), `placeholder_image`, and
    `placeholder_size` = (cpu, memory), else the pool worker's size. `stop_grace_s`, when
    set, caps the grace of every stop and the pods' terminationGracePeriodSeconds; by
    default both are the pool's `timeouts.stop_grace_s`. Each pod's environment holds its
    worker's activation secret, derived from `activation_key`.
    """

    kind = "kubernetes"
    has_nodes = True

    def __init__(
        self,
        *,
        cluster: ClusterAPI,
        clock: Clock,
        fleet: str,
        instance_id: str,
        activation_key: ActivationKey,
        resync_s: float = 300.0,
        placeholder_priority_class: str | None = None,
        placeholder_image: str = "registry.k8s.io/pause:3.10",
        placeholder_size: tuple[str, str] | None = None,
        stop_grace_s: float | None = None,
        sync_timeout_s: float = SYNC_TIMEOUT_S,
        prefer_session_nodes: bool | Literal["forecast"] = False,
    ) -> None:
        """With `prefer_session_nodes`, a new worker pod prefers the nodes that hold the
        most sessions (`preferred_nodes`): always (`True`), or while the leader's sizing
        says its pool may gather (`"forecast"`, `gather`)."""
        if not valid_label_value(fleet) or not fleet:
            raise ValueError(f"fleet {fleet!r} is not a valid Kubernetes label value")
        if not valid_label_value(instance_id) or not instance_id:
            raise ValueError(f"instance_id {instance_id!r} is not a valid Kubernetes label value")
        if resync_s <= 0 or sync_timeout_s <= 0:
            raise ValueError("resync_s and sync_timeout_s must be > 0")
        if stop_grace_s is not None and stop_grace_s < 0:
            raise ValueError("stop_grace_s must be >= 0")
        self.cluster = cluster
        self.clock = clock
        self.fleet = fleet
        self._preferred_nodes = PREFERRED_NODES if prefer_session_nodes is True else 0
        self._follows_sizing = prefer_session_nodes == "forecast"
        #: The pools whose new workers gather beside sessions now (`gather`).
        self._gathering: set[str] = set()
        self.instance_id = instance_id
        self.stop_grace_s = stop_grace_s
        self._key = activation_key
        #: The pods of the fleet as last seen (listed and watched); it reports the events.
        self.informer = PodInformer(
            cluster,
            clock,
            {LABEL_FLEET: fleet},
            instance_id=instance_id,
            resync_s=resync_s,
            sync_timeout_s=sync_timeout_s,
        )
        placeholders = Placeholders(
            priority_class=placeholder_priority_class,
            image=placeholder_image,
            size=placeholder_size,
        )
        self.headroom = Headroom(
            cluster, self.informer, clock=clock, fleet=fleet, placeholders=placeholders
        )

    # -- lifecycle of the runtime itself ----------------------------------------------------

    def subscribe(self, listener: RuntimeListener) -> None:
        """Route readiness and loss events to `listener` (before `start`)."""
        self.informer.listener = listener

    async def start(self) -> None:
        """Start the informer (it lists in the background)."""
        self.informer.start()

    async def close(self) -> None:
        """Stop the informer; the pods keep running, to be adopted by the next start."""
        await self.informer.close()

    def derived_cap(self, pool: PoolSpec) -> int:
        """0: the cluster and its node autoscaler bound the fleet, not this machine."""
        return 0

    def placeholder_slots(self, pool: PoolSpec) -> int:
        """Workers of `pool` that fit in one placeholder (by CPU and memory; at least 1)."""
        return self.headroom.slots(pool)

    def placeholder_requests(self, pool: PoolSpec) -> tuple[float, float]:
        """(CPUs, GiB) one placeholder of `pool` requests."""
        return self.headroom.requests(pool)

    def gather(self, pool: str, on: bool) -> None:
        """With `prefer_session_nodes="forecast"`: while `on`, `pool`'s new worker pods
        prefer the nodes that hold the most sessions, as with `True`."""
        if not self._follows_sizing:
            return
        if on:
            self._gathering.add(pool)
        else:
            self._gathering.discard(pool)

    # -- spawn, stop, adopt, busy -----------------------------------------------------------

    async def spawn(self, worker: Worker, pool: PoolSpec) -> Mapping[str, Any]:
        """Create the worker's pod; readiness is reported later by `worker_ready`.

        Returns the ref `{pod, namespace, port}`. Raises `RuntimeFailure` when the pool
        has no pod template or the cluster refuses the pod (with its reason, `refusal`).
        Creations are not serialised here: a burst fans out in parallel, paced only by the
        cluster client's budget.
        """
        template = pool.template
        if not isinstance(template, PodTemplate):
            raise RuntimeFailure(f"pool {pool.name!r} has no pod template")
        if not valid_label_value(pool.name):
            raise RuntimeFailure(
                f"pool {pool.name!r} is not a valid Kubernetes label value "
                "(at most 63 characters, alphanumeric at both ends)"
            )
        pod = worker_pod(
            worker,
            pool,
            template,
            fleet=self.fleet,
            instance_id=self.instance_id,
            grace_s=self._grace(pool.timeouts.stop_grace_s),
            activation_key=self._key,
            beside=self.informer.pinned_by_node.most(
                PREFERRED_NODES if pool.name in self._gathering else self._preferred_nodes
            ),
        )
        try:
            await self.cluster.create_pod(pod)
        except Conflict as exc:
            # A create retried after a lost answer meets its own success: check whose it is.
            if not await self._is_own_pod(pod.name, worker.id):
                raise RuntimeFailure(f"pod {pod.name} exists and is not this worker's") from exc
        except ClusterError as exc:
            # Not chained: the cluster's error may quote the pod's secrets.
            raise RuntimeFailure(
                f"cannot create pod {pod.name}: {refusal(exc, pod, template)}"
            ) from None
        _log("worker_spawned", worker=worker.id, pool=pool.name, pod=pod.name)
        return {"pod": pod.name, "namespace": self.cluster.namespace, "port": template.port}

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

    async def stop(self, worker: Worker, grace_s: float) -> None:
        """Delete the worker's pod with `grace_s` (capped by `stop_grace_s`).

        The deletion is not reported as a loss. A pod that is already gone is fine, and
        one this runtime deleted already is not deleted again (a retirement's stop, then a
        stranded scan from a snapshot taken before it). Raises `RuntimeFailure` when the
        cluster refuses the deletion.
        """
        name = pod_name(worker)
        if self.informer.deletion_requested(name):
            return
        entry = self.informer.expect_deletion(name)
        grace = self._grace(grace_s)
        try:
            await self.cluster.delete_pod(name, grace)
        except ClusterError as exc:
            self.informer.deletion_failed(name, entry)
            raise RuntimeFailure(f"cannot delete pod {name}: {exc}") from exc
        _log("worker_stopped", worker=worker.id, pod=name, grace_s=grace)

    async def adopt(self, worker: Worker) -> bool:
        """True if the worker's pod is alive (after the informer's first list).

        The pod is relabelled with this replica's instance id; that label is a hint for
        people and tools (the store's owner is the authority), so a failed relabel is
        logged, not fatal. Raises `RuntimeFailure` if the informer cannot list in time.
        """
        await self.informer.wait_synced()
        name = pod_name(worker)
        entry = self.informer.entry(name)
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
        name = pod_name(worker)
        wanted = "true" if busy else None
        entry = self.informer.entry(name)
        if entry is not None and entry.view.do_not_disrupt == wanted:
            return
        try:
            await self.cluster.patch_pod(name, annotations={DO_NOT_DISRUPT: wanted})
        except ObjectNotFound:
            return
        except ClusterError as exc:
            raise RuntimeFailure(f"cannot mark pod {name} busy={busy}: {exc}") from exc
        _log("worker_disruption", worker=worker.id, do_not_disrupt=wanted or "removed")

    def progress(self, worker: Worker) -> SpawnProgress | None:
        """How the worker's cached pod gets on towards ready (`PodView.progress`); None
        when no pod of the worker is cached, or it serves."""
        entry = self.informer.entry(pod_name(worker))
        if entry is None or entry.view.worker_id != worker.id:
            return None
        return entry.view.progress

    def pinned(self, worker: Worker) -> bool | None:
        """Whether the worker's cached pod carries `karpenter.sh/do-not-disrupt: "true"`;
        None when no live pod of the worker is cached."""
        entry = self.informer.entry(pod_name(worker))
        if entry is None or not entry.view.alive or entry.view.worker_id != worker.id:
            return None
        return entry.view.do_not_disrupt == "true"

    def unpinned(self) -> Collection[str]:
        """Ids of the workers with a live cached pod without the pin (an index the
        informer keeps, `UnpinnedPods`): the only ones `pinned` may call False."""
        return self.informer.unpinned.workers()

    def node_sessions(self, worker: Worker) -> int | None:
        """How many live pinned worker pods (sessions) the node of the worker's cached pod
        holds, the worker's own included; None when no live pod of the worker is cached
        on a node."""
        entry = self.informer.entry(pod_name(worker))
        if entry is None or entry.view.worker_id != worker.id:
            return None
        view = entry.view
        if not view.alive or view.node_name is None:
            return None
        return self.informer.pinned_by_node.on(view.node_name)

    async def list_objects(self) -> list[RuntimeObject]:
        """Every worker pod of this fleet, from the informer's cache (no list call); a pod
        this runtime deleted, or that is terminating, is `stopping`."""
        await self.informer.wait_synced()
        objects = []
        for entry in self.informer.worker_entries():
            view = entry.view
            listed = entry.listed
            stopping = view.terminating or self.informer.deletion_requested(view.name)
            if listed is None or listed[0] is not view or listed[1].stopping is not stopping:
                listed = entry.listed = (
                    view,
                    RuntimeObject(
                        worker_id=view.worker_id or "",
                        pool=view.pool,
                        ref={"pod": view.name, "namespace": self.cluster.namespace},
                        created_at=view.created_at if view.created_at is not None else 0.0,
                        alive=view.alive,
                        ready=view.serving,
                        endpoint=view.endpoint,
                        instance=view.instance,
                        stopping=stopping,
                    ),
                )
            objects.append(listed[1])
        return objects

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
        await self.headroom.reconcile(pools)
