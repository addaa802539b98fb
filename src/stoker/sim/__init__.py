"""The fleet simulator: a fake cluster and virtual time for running the real control plane.

`SimCluster` (in `cluster`) is a simulated Kubernetes cluster behind the ClusterAPI port;
give each control-plane replica its own `SimCluster.client(name, ...)` view. Its parts:

- `apiserver`: `FakeApiServer`, pods and leases with resourceVersions, watches, Lease CAS;
- `clients`: per-client views with QPS/burst, latency and a schedule of faults;
- `scheduler`: binds pods most-allocated first at a bounded rate, preempts placeholders;
- `kubelet`: image pulls (cached per node), container starts, graceful stops;
- `autoscaler`: Karpenter-like provisioning and consolidation;
- `nodes`, `model`, `resources`: node pools, the working state, instance types;
- `disruption`: PodDisruptionBudgets and the Eviction API's verdict;
- `workloads`: controller-managed background workloads (bigfleet's archetypes);
- `distributions`, `timeline`: seeded random delays, the tick grid everything runs on;
- `config`: `SimClusterConfig`, every knob with its documented default, and its YAML form.
"""

from stoker.sim.cluster import (
    ClusterSnapshot,
    NodeView,
    PodUsage,
    Resources,
    SimCluster,
)
from stoker.sim.config import SimClusterConfig

__all__ = [
    "ClusterSnapshot",
    "NodeView",
    "PodUsage",
    "Resources",
    "SimCluster",
    "SimClusterConfig",
]
