"""The Runtime port: where workers actually run (local processes, Kubernetes pods).

A runtime creates, watches and stops runtime objects and reports what happens to them
through `RuntimeListener` events. Handing a ready worker its org is the `Activator`'s job
(`stoker.ports.activator`). A runtime never writes the store: the control plane turns its
events into fenced transitions.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from stoker.domain.records import SpawnProgress, Worker
from stoker.domain.specs import PoolSpec

__all__ = ["Runtime", "RuntimeListener", "RuntimeObject", "SpawnProgress"]


@dataclass(frozen=True, slots=True)
class RuntimeObject:
    """A process or pod carrying stoker's labels, as the runtime sees it now."""

    worker_id: str
    pool: str
    ref: Mapping[str, Any]
    created_at: float
    alive: bool
    ready: bool = False
    endpoint: str | None = None
    instance: str | None = None
    #: Its stop is under way (requested by this runtime, or the pod is terminating): no
    #: second stop is needed.
    stopping: bool = False


class RuntimeListener(Protocol):
    """Receives runtime events; implemented by `stoker.control.events.RuntimeEvents`."""

    def worker_ready(self, worker_id: str, endpoint: str) -> None:
        """The worker answers its readiness probe at `endpoint`."""
        ...

    def worker_lost(self, worker_id: str, reason: str, detail: str | None = None) -> None:
        """The worker's process or pod is gone (`lost`, `evicted`, `spawn_failure`, ...).
        `detail`, when the runtime can tell, says how (`exited with code 3`, `not ready
        within 10s`): shown in the API as the cause of a failed spawn, so it never holds
        the worker's output, its environment or its command line."""
        ...

    def worker_stalled(self, worker_id: str, stage: str, error: str) -> None:
        """The spawning worker cannot start as it is (`stage`: `unschedulable`,
        `image_pull_failing`, ...; `error` says why). It is not gone: it may still start
        once the cluster changes (a node comes, the registry answers)."""
        ...

    def worker_gone(self, worker_id: str, at: float) -> None:
        """The object of a worker this runtime stopped holds its node share no more at
        `at` (wall-clock seconds): a pod whose deletion it requested ended or left the
        cluster. Only the replica that stopped it hears of it; a runtime whose stop waits
        for the object's end (local processes) never says it."""
        ...


@dataclass(frozen=True)
class StartSlots:
    """A runtime's bound on start-ups at once (the local runtime's `runtime.start_limit`):
    `limit` slots, each held `hold_s` on average by a start-up (None before one ended)."""

    limit: int
    hold_s: float | None


@runtime_checkable
class StartGated(Protocol):
    """A runtime that starts at most so many workers at once, queueing the rest."""

    def start_slots(self) -> StartSlots:
        """Its slots now."""
        ...


class Runtime(Protocol):
    """Creates and stops workers; reports readiness and loss as events."""

    #: "local" or "kubernetes".
    kind: str
    #: Whether workers run on nodes the cluster can give back, so that `node_sessions`
    #: answers: claims then choose among the warm workers by it (a walk of the ready
    #: queue); without nodes they take the first queued.
    has_nodes: bool

    def subscribe(self, listener: RuntimeListener) -> None:
        """Route events to `listener` (one listener per runtime)."""
        ...

    async def start(self) -> None:
        """Begin watching runtime objects."""
        ...

    async def close(self) -> None:
        """Stop watching; leaves workers running (they are adopted on the next start)."""
        ...

    def derived_cap(self, pool: PoolSpec) -> int:
        """The pool cap when `max_workers` is 0: 0 (unbounded) in cluster modes."""
        ...

    async def spawn(self, worker: Worker, pool: PoolSpec) -> Mapping[str, Any]:
        """Create the runtime object; returns its ref (pid and start time, pod name).

        Readiness arrives later as `worker_ready`; a failure to create raises `RuntimeFailure`.
        """
        ...

    async def stop(self, worker: Worker, grace_s: float) -> None:
        """Stop the worker's runtime object if it is still the one in `worker.runtime_ref`."""
        ...

    async def adopt(self, worker: Worker) -> bool:
        """Resume watching a live worker after a control-plane restart; False if it is gone."""
        ...

    async def list_objects(self) -> list[RuntimeObject]:
        """Every runtime object of this fleet, to find stranded ones."""
        ...

    async def set_busy(self, worker: Worker, busy: bool) -> None:
        """Mark a worker as not to be disrupted by the cluster while bound to an org."""
        ...

    def progress(self, worker: Worker) -> SpawnProgress | None:
        """How the spawning worker's object is getting on, as last seen; None when the
        runtime cannot tell (or sees no object of it)."""
        ...

    def pinned(self, worker: Worker) -> bool | None:
        """Whether the worker's object carries the not-to-be-disrupted mark, as last seen;
        None when the runtime has no such mark or does not see a live object."""
        ...

    def unpinned(self) -> Collection[str]:
        """Ids of the workers whose live object was last seen without the mark: every
        worker `pinned` calls False is among them (a pass looks at these, not the fleet)."""
        ...

    def node_sessions(self, worker: Worker) -> int | None:
        """How many sessions (workers with the not-to-be-disrupted mark) the node of the
        worker's object holds, as last seen; None when the runtime has no nodes or does
        not see the worker's object on one. Claims take the warm worker whose node holds
        the most and scale-down retires those whose node holds the fewest, so sessions
        gather on fewer nodes and the cluster can give back the nodes that hold none."""
        ...

    def gather(self, pool: str, on: bool) -> None:
        """The leader's sizing says, each pass, whether `pool`'s new workers may gather
        beside sessions now (`Sizing.gather`: its forecast expects no growth beyond the warm
        pool within the node lead). A runtime whose new workers prefer the nodes that hold
        the most sessions while that holds (Kubernetes, `prefer_session_nodes: forecast`)
        follows it; others ignore it."""
        ...

    async def reconcile_headroom(self, pools: Sequence[PoolSpec]) -> None:
        """Keep each pool's `headroom_nodes` placeholders (cluster runtimes; leader only)."""
        ...

    def placeholder_slots(self, pool: PoolSpec) -> int:
        """How many of the pool's workers one headroom placeholder makes room for (>= 1)."""
        ...

    def placeholder_requests(self, pool: PoolSpec) -> tuple[float, float]:
        """What one headroom placeholder of the pool requests: (CPUs, GiB); (0, 0) on a
        runtime without placeholders. The ledger prices headroom by it."""
        ...
