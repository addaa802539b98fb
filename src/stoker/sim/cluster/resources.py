"""Resource quantities and the instance types a simulated node can be.

CPU is kept in integer millicores and memory in integer bytes, so the scheduler's sums
are exact and a simulation never depends on float rounding. `cpu_millis("500m")` and
`memory_bytes("1Gi")` parse Kubernetes quantities the way the API server does, rounding
up to the unit (a request of 0.0001 cores takes one millicore); the parser is the
domain's (`stoker.domain.quantities`), shared with the Kubernetes runtime.

The default catalogue is three AWS general-purpose, compute and memory families with
their us-east-1 on-demand Linux list prices; allocatable capacity follows the formulas
Karpenter uses to predict a node before it exists (see `InstanceType.allocatable`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stoker.domain.errors import ConfigError
from stoker.domain.quantities import cpu_millis, memory_bytes, parse_quantity

MIB = 1 << 20
GIB = 1 << 30

__all__ = [
    "GIB",
    "MIB",
    "Allocatable",
    "InstanceType",
    "cpu_millis",
    "memory_bytes",
    "parse_quantity",
]


@dataclass(frozen=True, slots=True)
class Allocatable:
    """What the scheduler may place on a node: millicores, bytes and a pod count."""

    cpu_m: int
    memory_b: int
    pods: int


@dataclass(frozen=True, slots=True)
class InstanceType:
    """A machine shape a node pool can launch.

    `cpu` in cores and `memory_gib` in GiB are the nominal capacity; `price_per_hour`
    is in USD; `max_pods` is the kubelet's `maxPods` (its default is 110).
    """

    name: str
    cpu: float
    memory_gib: float
    price_per_hour: float
    max_pods: int = 110

    def __post_init__(self) -> None:
        if self.cpu <= 0 or self.memory_gib <= 0 or self.price_per_hour < 0 or self.max_pods < 1:
            raise ConfigError(f"instance type {self.name!r}: invalid capacity or price")

    def allocatable(
        self, *, vm_memory_overhead: float = 0.075, daemon_cpu_m: int = 0, daemon_memory_b: int = 0
    ) -> Allocatable:
        """Capacity minus what the node keeps for itself, as Karpenter predicts it.

        - memory: the hypervisor's share (Karpenter's `vmMemoryOverheadPercent`, 7.5 %),
          kube-reserved `11 MiB * maxPods + 255 MiB` and the 100 MiB hard eviction
          threshold (the EKS AMI and Karpenter defaults);
        - cpu: kube-reserved 6 % of the first core, 1 % of the second, 0.5 % of the
          third and fourth and 0.25 % of every further core (same source);
        - DaemonSet pods (CNI, kube-proxy, log agents) as a flat per-node overhead.
        """
        cores = self.cpu
        reserved_cpu = 60 * min(cores, 1) + 10 * min(max(cores - 1, 0), 1)
        reserved_cpu += 5 * min(max(cores - 2, 0), 2) + 2.5 * max(cores - 4, 0)
        cpu_m = int(cores * 1000) - math.ceil(reserved_cpu) - daemon_cpu_m
        memory = math.floor(self.memory_gib * GIB * (1 - vm_memory_overhead))
        memory -= (11 * self.max_pods + 255) * MIB + 100 * MIB + daemon_memory_b
        return Allocatable(cpu_m=max(cpu_m, 0), memory_b=max(memory, 0), pods=self.max_pods)


def _vcpus(size: str) -> int:
    """The vCPUs an AWS size name stands for: `large` 2, `xlarge` 4, `<n>xlarge` 4n."""
    if size == "large":
        return 2
    return 4 * int(size.removesuffix("xlarge") or 1)


def _family(
    prefix: str, gib_per_vcpu: int, usd_per_vcpu_hour: float, sizes: str
) -> list[InstanceType]:
    """The sizes of one family: memory and price grow with the vCPUs, in proportion."""
    return [
        InstanceType(
            f"{prefix}.{size}",
            _vcpus(size),
            _vcpus(size) * gib_per_vcpu,
            round(_vcpus(size) * usd_per_vcpu_hour, 4),
        )
        for size in sizes.split()
    ]


#: AWS m5 / c5 / r5, us-east-1 on-demand Linux list prices (USD per hour): general
#: purpose (4 GiB per vCPU), compute (2) and memory optimised (8).
DEFAULT_INSTANCE_TYPES: tuple[InstanceType, ...] = (
    *_family("m5", 4, 0.048, "large xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge"),
    *_family("c5", 2, 0.0425, "large xlarge 2xlarge 4xlarge 9xlarge"),
    *_family("r5", 8, 0.063, "large xlarge 2xlarge 4xlarge 8xlarge"),
)

INSTANCE_TYPES_BY_NAME = {itype.name: itype for itype in DEFAULT_INSTANCE_TYPES}
