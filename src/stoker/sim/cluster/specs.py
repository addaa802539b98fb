"""What the simulated cluster's objects are configured with: plain values, no live state.

Node pools (`NodePoolConfig`, modelled on a Karpenter NodePool, with its taints and
disruption settings), PodDisruptionBudgets (`PdbSpec`) and the archetypes of background
workloads (`Archetype`, `Shape`, `WorkloadKind`). The live objects built from them are
in `model`; the controllers that act on those in `nodes`, `disruption` and `workloads`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from stoker.domain.errors import ConfigError
from stoker.ports.cluster import Toleration
from stoker.sim.cluster.distributions import (
    BIGFLEET_REPLICAS,
    Distribution,
    Exponential,
    LogNormal,
)
from stoker.sim.cluster.resources import DEFAULT_INSTANCE_TYPES, InstanceType, cpu_millis

_HOUR = 3600.0


class ConsolidationPolicy(StrEnum):
    """Karpenter's `spec.disruption.consolidationPolicy`."""

    WHEN_EMPTY = "WhenEmpty"
    WHEN_EMPTY_OR_UNDERUTILIZED = "WhenEmptyOrUnderutilized"


@dataclass(frozen=True, slots=True)
class Taint:
    """A node taint; pods without a matching toleration do not schedule there."""

    key: str
    value: str = ""
    effect: str = "NoSchedule"


def _default_provisioning() -> Distribution:
    return LogNormal(median=60.0, sigma=0.35, cap=600.0)


@dataclass(frozen=True)
class NodePoolConfig:
    """One node pool, modelled on a Karpenter NodePool.

    Defaults and where they come from:

    - `instance_types`: AWS m5/c5/r5 with list prices (`resources.DEFAULT_INSTANCE_TYPES`);
    - `provisioning`: launch to Ready, log-normal with a 60 s median (p99 about 135 s),
      between bigfleet's kwok-measured provisioning p50 of 36.7 s and the 2-3 minutes a
      large node took in duckgres #671;
    - `consolidation_policy`: Karpenter v1's default, `WhenEmptyOrUnderutilized`;
    - `consolidate_after_s`: 30 s (Karpenter's API default is 0 s, which consolidates on
      every pod exit; 30 s is a common production setting, e.g. convox's default);
      None means `Never`;
    - `budget_nodes`: Karpenter's default budget, `nodes: 10%` (a count like "5" works);
    - `daemon_cpu` 125m: the requests of kube-proxy (100m) and the VPC CNI (25m), the
      DaemonSets every EKS node runs, held as a per-node overhead instead of pods;
    - `vm_memory_overhead` 7.5 %: Karpenter's `VM_MEMORY_OVERHEAD_PERCENT` default.
    - `initial_nodes`: instance type name -> count of nodes Ready at start;
    - `launch_failure_rate` 0 (opt-in; the scale test's scenarios set 1 %): the share of
      launches whose instance never joins; Karpenter replaces it once its registration
      TTL (`launch_failure_after_s`, 15 minutes) has passed, so it becomes Ready that
      much later than drawn (and is paid for meanwhile).
    """

    name: str = "default"
    instance_types: tuple[InstanceType, ...] = DEFAULT_INSTANCE_TYPES
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    weight: int = 0
    limit_cpu: float | None = None
    provisioning: Distribution = field(default_factory=_default_provisioning)
    consolidation_policy: ConsolidationPolicy = ConsolidationPolicy.WHEN_EMPTY_OR_UNDERUTILIZED
    consolidate_after_s: float | None = 30.0
    budget_nodes: str = "10%"
    daemon_cpu: str = "125m"
    daemon_memory: str = "0"
    vm_memory_overhead: float = 0.075
    initial_nodes: Mapping[str, int] = field(default_factory=dict)
    launch_failure_rate: float = 0.0
    launch_failure_after_s: float = 900.0

    def __post_init__(self) -> None:
        if not 0 <= self.launch_failure_rate < 1 or self.launch_failure_after_s < 0:
            raise ConfigError(f"node pool {self.name!r}: launch failures out of range")
        if not self.instance_types:
            raise ConfigError(f"node pool {self.name!r}: no instance types")
        names = [itype.name for itype in self.instance_types]
        if len(set(names)) != len(names):
            raise ConfigError(f"node pool {self.name!r}: duplicate instance types")
        unknown = set(self.initial_nodes) - set(names)
        if unknown:
            raise ConfigError(f"node pool {self.name!r}: unknown initial types {sorted(unknown)}")
        budget_of(self.budget_nodes, 10)  # validates the form
        if self.consolidate_after_s is not None and self.consolidate_after_s < 0:
            raise ConfigError(f"node pool {self.name!r}: consolidate_after_s must be >= 0")


def budget_of(budget: str, nodes: int) -> int:
    """How many of `nodes` a budget like "10%" or "5" allows; percentages round up."""
    text = budget.strip()
    try:
        if text.endswith("%"):
            percent = float(text[:-1])
            if percent < 0:
                raise ValueError
            return math.ceil(percent * nodes / 100 - 1e-9)
        count = int(text)
        if count < 0:
            raise ValueError
        return count
    except ValueError:
        raise ConfigError(
            f"invalid disruption budget {budget!r}: a count or a percentage"
        ) from None


def tolerates(tolerations: tuple[Toleration, ...], taint: Taint) -> bool:
    """Whether some toleration matches `taint`, with Kubernetes' matching rules."""
    for toleration in tolerations:
        if toleration.effect and toleration.effect != taint.effect:
            continue
        if toleration.operator == "Exists":
            if not toleration.key or toleration.key == taint.key:
                return True
        elif toleration.key == taint.key and (toleration.value or "") == taint.value:
            return True
    return False


@dataclass(frozen=True, slots=True)
class PdbSpec:
    """A PodDisruptionBudget: a label selector and one of minAvailable / maxUnavailable."""

    name: str
    selector: Mapping[str, str] = field(default_factory=dict)
    min_available: int | str | None = None
    max_unavailable: int | str | None = None

    def __post_init__(self) -> None:
        if (self.min_available is None) == (self.max_unavailable is None):
            raise ConfigError(f"PDB {self.name!r}: set exactly one of min/max")
        value = self.min_available if self.min_available is not None else self.max_unavailable
        assert value is not None
        scaled(value, 1)  # validates the form


def scaled(value: int | str, expected: int) -> int:
    """An int-or-percent against `expected`, rounding a percentage up (as Kubernetes does)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"PDB value {value} must be >= 0")
        return value
    if isinstance(value, str) and value.endswith("%"):
        try:
            percent = float(value[:-1])
        except ValueError:
            raise ConfigError(f"invalid PDB percentage {value!r}") from None
        if percent < 0:
            raise ConfigError(f"PDB percentage {value!r} must be >= 0")
        return math.ceil(percent * expected / 100 - 1e-9)
    raise ConfigError(f"invalid PDB value {value!r}: an integer or a percentage")


class WorkloadKind(StrEnum):
    """Which controller manages the workload's pods."""

    DEPLOYMENT = "Deployment"
    STATEFULSET = "StatefulSet"


@dataclass(frozen=True, slots=True)
class Shape:
    """A pod's requests (equal to its limits), as Kubernetes quantities."""

    cpu: str
    memory: str


@dataclass(frozen=True)
class Archetype:
    """A kind of background workload.

    `machine_share` is its share of the background's requested CPU (relative weights);
    one of `shapes` is picked per workload; `pdb_*` (at most one) gives each workload a
    PodDisruptionBudget over its pods.
    """

    name: str
    machine_share: float
    shapes: tuple[Shape, ...]
    priority_class: str
    kind: WorkloadKind = WorkloadKind.DEPLOYMENT
    replicas: Distribution = BIGFLEET_REPLICAS
    lifetime: Distribution = field(default_factory=lambda: Exponential(6 * _HOUR))
    pdb_max_unavailable: int | str | None = None
    pdb_min_available: int | str | None = None
    grace_s: int = 30
    ordered_ready: bool = True
    image: str = ""

    def __post_init__(self) -> None:
        if self.machine_share <= 0 or not self.shapes:
            raise ConfigError(f"archetype {self.name!r}: needs a share > 0 and shapes")
        if self.pdb_max_unavailable is not None and self.pdb_min_available is not None:
            raise ConfigError(f"archetype {self.name!r}: set at most one PDB bound")

    @property
    def pod_image(self) -> str:
        """The container image (one per archetype, so nodes cache it)."""
        return self.image or f"registry.sim.example/{self.name}:1"

    @property
    def mean_cpu_m(self) -> float:
        """Expected CPU request of one pod, in millicores."""
        return sum(cpu_millis(shape.cpu) for shape in self.shapes) / len(self.shapes)
