"""A simulated Kubernetes cluster behind the ClusterAPI port, in virtual time.

`SimCluster` composes the parts below on one `Timeline`; give each client (a control-plane
replica, say) its own `SimCluster.client(name, ...)` view. `FakeApiServer` alone is the
in-process API server of tests that need no nodes. Its modules, from the bottom up:

- `resources`, `distributions`, `timeline`, `freeindex`: instance types and quantities,
  seeded random delays, the tick grid everything runs on, the free-capacity index;
- `specs`: what node pools, PodDisruptionBudgets and background workloads are configured
  with; `model`: the working state built from them (pods, nodes, pools, budgets, workloads);
- `apiserver` (with `changes`): pods and leases with resourceVersions, watches, Lease CAS;
  `client`: per-client views with QPS/burst, latency and a schedule of faults;
- `nodes`, `scheduler`, `kubelet`, `autoscaler`, `disruption`, `workloads`: the node fleet,
  binding and preemption, image pulls and container starts, Karpenter-like provisioning and
  consolidation, the Eviction API's verdict, controller-managed background workloads;
- `config`: `SimClusterConfig`, every knob with its documented default, and its YAML form;
- `simcluster` (with `mirror` and `snapshot`): the cluster itself, and what it reports.

Nothing here knows of scenarios, policies or the control plane: the scale test
(`stoker.sim`) sits on top.
"""

from stoker.sim.cluster.apiserver import FakeApiServer
from stoker.sim.cluster.changes import PodChange
from stoker.sim.cluster.client import SimClient
from stoker.sim.cluster.config import SimClusterConfig
from stoker.sim.cluster.simcluster import SimCluster
from stoker.sim.cluster.snapshot import ClusterSnapshot, NodeView, PodUsage, Resources

__all__ = [
    "ClusterSnapshot",
    "FakeApiServer",
    "NodeView",
    "PodChange",
    "PodUsage",
    "Resources",
    "SimClient",
    "SimCluster",
    "SimClusterConfig",
]
