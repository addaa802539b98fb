"""Background workloads: controller-managed pods that share the cluster with the workers.

A cluster never runs stoker's workers alone; the background takes nodes, competes for
the scheduler and gets consolidated too. It is modelled on bigfleet's scale test:

- **Controller-managed** (bigfleet ADR-0038): each workload is a Deployment (its
  ReplicaSet replaces a pod as soon as it is terminating, failed or gone) or a
  StatefulSet (recreates the pod under the same ordinal name once the old one is gone;
  `OrderedReady` creates ordinal i+1 only after ordinal i is Ready). An eviction
  therefore conserves demand, and scale-down stops at the true surplus. `bare_pods`
  switches the controllers off: evicted pods are never replaced, which is the demand
  destruction that drove bigfleet's ~26 machines/s reclaim cascade; it exists only to
  demonstrate that.
- **Archetypes** (bigfleet ADR-0032 catalogue, ADR-0050 machine mix): shape, priority,
  kind, replica-count distribution (bigfleet's `sizing.go` buckets, StatefulSets capped
  at 25), lifetime. The GPU archetypes are left out (the simulated nodes have no GPUs)
  and the CPU machine shares renormalised.
- **Churn**: workloads end when their lifetime is up; a driver tops the demand back up
  to a target profile (constant, diurnal or stepped) every `reconcile_interval_s`, and
  ends random workloads when demand is above the target, so a diurnal background rises
  and falls. Optional pod churn deletes `churn_per_minute` of the pods per minute, to be
  recreated by their controller (bigfleet's load-driver used 0.02, ADR-0035).

Archetypes are drawn so that each one's share of the requested CPU matches its machine
share: the arrival weight is `share / (E[replicas] * E[cpu] * E[lifetime])` (ADR-0050's
`weight ∝ machineShare x podsPerMachine / E[replicas]`, with the lifetime because the
driver keeps a stock; the first fill, which starts from nothing, leaves it out).

Pod creation goes through a controller-manager rate limit (QPS 20, burst 30: the
`--kube-api-qps` / `--kube-api-burst` defaults of kube-controller-manager).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from stoker.ports.cluster import Pod, PodPhase
from stoker.sim.cluster.apiserver import FakeApiServer
from stoker.sim.cluster.disruption import DisruptionBudgets
from stoker.sim.cluster.distributions import (
    BIGFLEET_STATEFUL_REPLICAS,
    Exponential,
)
from stoker.sim.cluster.model import WORKLOAD_LABEL, PodDisruptionBudget, SimPod, Workload
from stoker.sim.cluster.resources import cpu_millis
from stoker.sim.cluster.specs import Archetype, PdbSpec, Shape, WorkloadKind
from stoker.sim.cluster.timeline import Timeline

#: Priority classes of the catalogue; `SimClusterConfig` maps them to bigfleet's values.
BACKGROUND_PRIORITY_CLASSES: Mapping[str, int] = {
    "sim-background-standard": 100,
    "sim-background-high": 1000,
    "sim-background-critical": 1_000_000,
}

# Kubernetes' name-suffix alphabet (no vowels, no confusable digits).
_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_FINISHED = frozenset({PodPhase.FAILED, PodPhase.SUCCEEDED})
_HOUR = 3600.0


_MEMORY_CACHE = Archetype(
    name="memory-cache",
    machine_share=1.5,
    shapes=(Shape("2", "16Gi"),),
    priority_class="sim-background-high",
    kind=WorkloadKind.STATEFULSET,
    replicas=BIGFLEET_STATEFUL_REPLICAS,
    lifetime=Exponential(48 * _HOUR),
    pdb_max_unavailable=1,
    grace_s=60,
)

#: bigfleet's realistic catalogue without the GPU archetypes (see the module docstring).
#: Shapes and priorities are ADR-0032's; machine shares ADR-0050's; lifetimes are
#: assumptions except cpu-batch (`meanLifetimeSeconds: 600` in bigfleet's older profile);
#: the PDBs are assumptions (typical for such services).
BIGFLEET_ARCHETYPES: tuple[Archetype, ...] = (
    Archetype(
        name="tiny-stateless",
        machine_share=66.4,
        shapes=(Shape("300m", "384Mi"), Shape("350m", "448Mi"), Shape("400m", "500Mi")),
        priority_class="sim-background-standard",
        lifetime=Exponential(6 * _HOUR),
    ),
    Archetype(
        name="cpu-service",
        machine_share=11.4,
        shapes=(Shape("2200m", "8704Mi"), Shape("4200m", "16896Mi")),
        priority_class="sim-background-high",
        lifetime=Exponential(12 * _HOUR),
        pdb_max_unavailable="25%",
    ),
    Archetype(
        name="cpu-batch",
        machine_share=5.7,
        shapes=(Shape("4", "8Gi"), Shape("8", "16Gi")),
        priority_class="sim-background-standard",
        lifetime=Exponential(600.0),
    ),
    Archetype(
        name="critical-realtime",
        machine_share=0.95,
        shapes=(Shape("4", "8Gi"),),
        priority_class="sim-background-critical",
        lifetime=Exponential(24 * _HOUR),
        pdb_min_available="50%",
    ),
    _MEMORY_CACHE,
    # A database: the cache's StatefulSet with larger pods and a longer grace.
    replace(_MEMORY_CACHE, name="stateful-db", shapes=(Shape("8", "32Gi"),), grace_s=120),
)


class DemandProfile(Protocol):
    """Requested CPU (cores) the background should hold, as a function of sim time."""

    def at(self, t: float) -> float:
        """The target at `t` seconds after the simulation started."""
        ...

    def peak(self) -> float:
        """The largest target at any time."""
        ...


@dataclass(frozen=True, slots=True)
class ConstantProfile:
    """The same target all the time."""

    cores: float

    def at(self, t: float) -> float:
        """`cores`."""
        return self.cores

    def peak(self) -> float:
        """The largest target."""
        return self.cores


@dataclass(frozen=True, slots=True)
class DiurnalProfile:
    """A cosine day: `low` at the trough, `high` at `peak_s` (seconds into the period)."""

    low: float
    high: float
    peak_s: float = 14 * _HOUR
    period_s: float = 24 * _HOUR

    def at(self, t: float) -> float:
        """The target on the cosine between low and high."""
        phase = 2 * math.pi * (t - self.peak_s) / self.period_s
        return self.low + (self.high - self.low) * (1 + math.cos(phase)) / 2

    def peak(self) -> float:
        """The largest target."""
        return max(self.low, self.high)


@dataclass(frozen=True, slots=True)
class StepProfile:
    """Piecewise constant: `steps` are (from time, cores), sorted; 0 before the first."""

    steps: tuple[tuple[float, float], ...]

    def at(self, t: float) -> float:
        """The value of the last step that has begun."""
        value = 0.0
        for start, cores in self.steps:
            if start > t:
                break
            value = cores
        return value

    def peak(self) -> float:
        """The largest target."""
        return max((cores for _, cores in self.steps), default=0.0)


@dataclass(frozen=True)
class BackgroundConfig:
    """The background load; off (target 0 cores) by default."""

    target: DemandProfile = field(default_factory=lambda: ConstantProfile(0.0))
    archetypes: tuple[Archetype, ...] = BIGFLEET_ARCHETYPES
    reconcile_interval_s: float = 60.0
    hysteresis: float = 0.02
    churn_per_minute: float = 0.0
    bare_pods: bool = False
    #: Place the first fill on Ready nodes at once (bigfleet's `seed.preBind`).
    prebind: bool = False
    namespace: str = "background"


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """kube-controller-manager's API budget for creating pods."""

    qps: float = 20.0
    burst: int = 30


@dataclass(slots=True)
class WorkloadCounters:
    """What the controllers and the driver did, for the cluster snapshot."""

    workloads_started: int = 0
    workloads_ended: int = 0
    pods_created: int = 0
    pods_replaced: int = 0
    pods_destroyed: int = 0  # bare pods lost to eviction or preemption
    churned: int = 0


class WorkloadController:
    """The ReplicaSet and StatefulSet controllers for every background workload."""

    def __init__(
        self,
        *,
        server: FakeApiServer,
        timeline: Timeline,
        rng: random.Random,
        config: ControllerConfig,
        budgets: DisruptionBudgets,
    ) -> None:
        self.server = server
        self.counters = WorkloadCounters()
        self.workloads: dict[str, Workload] = {}
        self.timeline = timeline
        self.rng = rng
        self._config = config
        self._budgets = budgets
        self._seq = 0
        self._tokens = float(config.burst)
        self._stamp: float | None = None
        self._creations: deque[tuple[Workload, str]] = deque()
        self._pump_at: int | None = None
        self._dirty: dict[Workload, None] = {}
        self._reconcile_at: int | None = None

    # -- lifecycle of workloads ----------------------------------------------------------

    def start(
        self, archetype: Archetype, shape: Shape, replicas: int, lifetime_s: float, *, bare: bool
    ) -> Workload:
        """Create a workload; its pods are requested from the rate-limited creator."""
        self._seq += 1
        now = self.timeline.now()
        workload = Workload(
            name=f"{archetype.name}-{self._seq:05d}",
            archetype=archetype,
            shape=shape,
            replicas=replicas,
            bare=bare,
            started_at=now,
            ends_at=now + lifetime_s,
            hash=self._random_name(10),
        )
        self.workloads[workload.name] = workload
        self.counters.workloads_started += 1
        bound = archetype.pdb_min_available, archetype.pdb_max_unavailable
        if bound != (None, None):
            spec = PdbSpec(
                name=workload.name,
                selector={WORKLOAD_LABEL: workload.name},
                min_available=archetype.pdb_min_available,
                max_unavailable=archetype.pdb_max_unavailable,
            )
            workload.pdb = PodDisruptionBudget(
                spec, self.server.namespace, expected=lambda: workload.replicas
            )
            self._budgets.add(workload.pdb, ())
        return workload

    def create_all_now(self, workload: Workload) -> list[Pod]:
        """Create every replica at once, bypassing the rate limit (a pre-bound seed)."""
        if workload.kind is WorkloadKind.STATEFULSET and not workload.bare:
            names = [f"{workload.name}-{i}" for i in range(workload.replicas)]
        else:
            names = [self._deployment_name(workload) for _ in range(workload.replicas)]
        return [self._create(workload, name) for name in names if name not in workload.pods]

    def fill(self, workload: Workload) -> None:
        """Request the workload's missing pods from the rate-limited creator."""
        self._mark_dirty(workload)

    def end(self, workload: Workload) -> None:
        """Delete the workload: its pods terminate gracefully and are not replaced."""
        if workload.ended:
            return
        workload.ended = True
        self.counters.workloads_ended += 1
        workload.requested.clear()
        if workload.pdb is not None:
            self._budgets.remove(self.server.namespace, workload.pdb.name)
            workload.pdb = None
        for name, pod in list(workload.pods.items()):
            if not pod.terminating:
                workload.expected_gone[name] = None
                self.server.delete_pod_nowait(name)
        if not workload.pods:
            self.workloads.pop(workload.name, None)

    def churn(self, workload: Workload) -> None:
        """Delete one random pod (its controller, or the driver for bare pods, replaces it)."""
        live = [name for name, pod in workload.pods.items() if not pod.terminating]
        if not live:
            return
        name = self.rng.choice(live)
        workload.expected_gone[name] = None
        self.counters.churned += 1
        self.server.delete_pod_nowait(name)
        if workload.bare:
            # bigfleet's load-driver deletes and recreates: demand it removed itself returns.
            self._request(workload, self._deployment_name(workload))

    # -- what the cluster tells the controllers --------------------------------------------

    def owner_of(self, labels: Mapping[str, str]) -> Workload | None:
        """The workload a new pod belongs to, from its labels."""
        name = labels.get(WORKLOAD_LABEL)
        return None if name is None else self.workloads.get(name)

    def pod_added(self, pod: SimPod) -> None:
        """A pod of a workload was created."""
        if pod.workload is not None:
            pod.workload.pods[pod.name] = pod

    def pod_changed(self, pod: SimPod, *, became_ready: bool, began_terminating: bool) -> None:
        """Readiness or termination changed: a controller may have work."""
        workload = pod.workload
        if workload is None or workload.bare or workload.ended:
            return
        if pod.phase in _FINISHED or (
            began_terminating and workload.kind is WorkloadKind.DEPLOYMENT
        ):
            # A ReplicaSet replaces a terminating pod at once; a StatefulSet waits until
            # the name is free, and both clear out a failed pod.
            self._mark_dirty(workload)
        elif became_ready and workload.kind is WorkloadKind.STATEFULSET:
            self._mark_dirty(workload)

    def pod_gone(self, pod: SimPod) -> None:
        """A pod of a workload is gone for good."""
        workload = pod.workload
        if workload is None:
            return
        workload.pods.pop(pod.name, None)
        expected = pod.name in workload.expected_gone
        workload.expected_gone.pop(pod.name, None)
        if workload.ended:
            if not workload.pods:
                self.workloads.pop(workload.name, None)
            return
        if workload.bare:
            if not expected:
                self.counters.pods_destroyed += 1
            return
        self._mark_dirty(workload)

    # -- reconciliation --------------------------------------------------------------------

    def _mark_dirty(self, workload: Workload) -> None:
        self._dirty[workload] = None
        if self._reconcile_at is None:
            self._reconcile_at = self.timeline.at(self.timeline.now(), self._reconcile_dirty)

    def _reconcile_dirty(self) -> None:
        self._reconcile_at = None
        dirty, self._dirty = self._dirty, {}
        for workload in dirty:
            if not workload.ended:
                self._reconcile(workload)

    def _reconcile(self, workload: Workload) -> None:
        if workload.kind is WorkloadKind.DEPLOYMENT or workload.bare:
            for name, pod in list(workload.pods.items()):
                if pod.phase in _FINISHED and not pod.terminating:
                    # The ReplicaSet counts a failed pod out and deletes it.
                    workload.expected_gone[name] = None
                    self.server.delete_pod_nowait(name, 0)
            missing = workload.replicas - workload.active_pods() - len(workload.requested)
            if workload.bare:
                missing = min(missing, workload.replicas - len(workload.pods))
            for _ in range(max(0, missing)):
                self._request(workload, self._deployment_name(workload))
            return
        for ordinal in range(workload.replicas):
            name = f"{workload.name}-{ordinal}"
            member = workload.pods.get(name)
            if member is None:
                if name not in workload.requested:
                    self._request(workload, name)
                if workload.archetype.ordered_ready:
                    return
                continue
            if member.phase in _FINISHED and not member.terminating:
                workload.expected_gone[name] = None
                self.server.delete_pod_nowait(name, 0)
                return
            if workload.archetype.ordered_ready and not (member.ready and not member.terminating):
                return  # OrderedReady: the next ordinal waits for this one

    def _deployment_name(self, workload: Workload) -> str:
        return f"{workload.name}-{workload.hash}-{self._random_name(5)}"

    def _random_name(self, length: int) -> str:
        """`length` characters of Kubernetes' suffix alphabet, from one draw."""
        number = self.rng.randrange(len(_ALPHABET) ** length)
        chars = []
        for _ in range(length):
            number, digit = divmod(number, len(_ALPHABET))
            chars.append(_ALPHABET[digit])
        return "".join(chars)

    def _request(self, workload: Workload, name: str) -> None:
        workload.requested[name] = None
        self._creations.append((workload, name))
        self._pump()

    def _pump(self) -> None:
        """Create queued pods as fast as the controller-manager's API budget allows."""
        now = self.timeline.now()
        if self._stamp is not None:
            accrued = (now - self._stamp) * self._config.qps
            self._tokens = min(float(self._config.burst), self._tokens + accrued)
        self._stamp = now
        while self._creations and self._tokens >= 1.0:
            workload, name = self._creations.popleft()
            if name not in workload.requested:
                continue  # cancelled: the workload ended
            del workload.requested[name]
            if workload.ended or name in workload.pods:
                continue
            self._tokens -= 1.0
            self._create(workload, name)
        if self._creations and self._pump_at is None:
            wait = (1.0 - self._tokens) / self._config.qps
            self._pump_at = self.timeline.after(wait, self._pump_later)

    def _pump_later(self) -> None:
        self._pump_at = None
        self._pump()

    def _create(self, workload: Workload, name: str) -> Pod:
        self.counters.pods_created += 1
        workload.created += 1
        if workload.created > workload.replicas:
            self.counters.pods_replaced += 1
        pod = Pod(name=name, labels=workload.labels, spec=workload.spec)
        return self.server.create_pod_nowait(pod)


class BackgroundLoad:
    """Keeps the background's requested CPU on its target profile; see the module docstring.

    `place_now(pods)` binds pods at once (the pre-bound first fill).
    """

    def __init__(
        self,
        *,
        config: BackgroundConfig,
        controller: WorkloadController,
        place_now: Callable[[list[Pod]], None],
    ) -> None:
        self.config = config
        self._controller = controller
        # The controller's clock and random draws: the background and its pods share them.
        self._timeline = controller.timeline
        self._rng = controller.rng
        self._place_now = place_now
        self._t0 = 0.0
        self._active: list[Workload] = []
        self.desired_cpu_m = 0
        self.target_cpu_m = 0
        #: Replicas the active workloads declare.
        self.desired_pods = 0
        archetypes = config.archetypes
        self._fill_weights = [
            a.machine_share / (a.replicas.mean * a.mean_cpu_m) for a in archetypes
        ]
        self._steady_weights = [
            w / max(a.lifetime.mean, 1.0)
            for w, a in zip(self._fill_weights, archetypes, strict=True)
        ]
        self._started = False

    def start(self) -> None:
        """The first fill now, then a reconcile every interval."""
        self._t0 = self._timeline.now()
        self._reconcile()

    @property
    def active_workloads(self) -> int:
        """Workloads not ended."""
        return len(self._active)

    def live_pods(self) -> int:
        """Pods of active workloads that count as replicas."""
        return sum(workload.active_pods() for workload in self._active)

    def _reconcile(self) -> None:
        now = self._timeline.now()
        first = not self._started
        self._started = True
        self.target_cpu_m = round(self.config.target.at(now - self._t0) * 1000)
        seeded: list[Pod] = []
        while self.desired_cpu_m < self.target_cpu_m:
            workload = self._start_one(first)
            if first and self.config.prebind:
                seeded += self._controller.create_all_now(workload)
            else:
                self._controller.fill(workload)
        self._trim()
        if seeded:
            self._place_now(seeded)
        self._churn()
        self._timeline.after(self.config.reconcile_interval_s, self._reconcile)

    def _trim(self) -> None:
        """End random workloads while demand is above the target plus hysteresis.

        Only workloads whose end keeps demand above the target minus hysteresis go, so
        one large workload cannot swing demand far below the target.
        """
        ceiling = self.target_cpu_m * (1 + self.config.hysteresis)
        floor = self.target_cpu_m * (1 - self.config.hysteresis)
        while self._active and self.desired_cpu_m > ceiling:
            for _ in range(8):
                workload = self._active[self._rng.randrange(len(self._active))]
                if self.desired_cpu_m - workload.replicas * workload.cpu_m >= floor:
                    self._end(workload)
                    break
            else:
                return

    def _start_one(self, first: bool) -> Workload:
        archetypes = self.config.archetypes
        weights = self._fill_weights if first else self._steady_weights
        archetype = self._rng.choices(archetypes, weights=weights)[0]
        shape = self._rng.choice(archetype.shapes)
        replicas = max(1, int(archetype.replicas.sample(self._rng)))
        # The last workload of a fill is cut to what the target still lacks, so demand
        # does not overshoot by a whole 400-replica workload.
        lacking = self.target_cpu_m - self.desired_cpu_m
        replicas = min(replicas, max(1, math.ceil(lacking / cpu_millis(shape.cpu))))
        lifetime = archetype.lifetime.sample(self._rng)
        workload = self._controller.start(
            archetype, shape, replicas, lifetime, bare=self.config.bare_pods
        )
        workload.slot = len(self._active)
        self._active.append(workload)
        self.desired_cpu_m += workload.replicas * workload.cpu_m
        self.desired_pods += workload.replicas
        self._timeline.at(workload.ends_at, lambda: self._end(workload))
        return workload

    def _end(self, workload: Workload) -> None:
        if workload.slot < 0:
            return
        # Swap-remove keeps picking a random workload O(1).
        last = self._active.pop()
        if last is not workload:
            self._active[workload.slot] = last
            last.slot = workload.slot
        workload.slot = -1
        self.desired_cpu_m -= workload.replicas * workload.cpu_m
        self.desired_pods -= workload.replicas
        self._controller.end(workload)

    def _churn(self) -> None:
        rate = self.config.churn_per_minute
        if rate <= 0 or not self._active:
            return
        expected = rate * self.config.reconcile_interval_s / 60 * self.live_pods()
        count = int(expected) + (1 if self._rng.random() < expected - int(expected) else 0)
        for _ in range(count):
            workload = self._active[self._rng.randrange(len(self._active))]
            self._controller.churn(workload)
