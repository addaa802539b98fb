"""What every scenario's cluster and control plane start from, each default with its source.

`BASE_CLUSTER` is laid under every scenario's `cluster` section (a scenario overrides any
of it), and `with_node_pool_defaults` fills each of its node pools. The simulated cluster
on its own (`stoker.sim.cluster`) has none of these latencies: they are opt-in there, for
its tests; a scale test measures what users feel, so its scenarios have them by default:

- **watch latency** 10 ms: a change reaches a watching client that long after its write
  (etcd's commit, the watch cache, the stream). Measured by
  `python benchmarks/kube_timings.py`: a pod create's ADDED event reached a watch 7-11 ms
  (p50) and 32-58 ms (p99) after the create was sent, before the create's own answer
  about half the time (kube-apiserver 1.20 on loopback, three runs); every event is
  delayed by the median here, in order (a watch stream never reorders), so a change can
  reach the watches before the call that made it has answered. A scenario sets a slower
  one (`cluster.api.watch_latency_s: 0.05`, the measured p99) to model a loaded cluster.
  Well within the Kubernetes SIG Scalability watch-latency SLO (work in progress: p99
  <= 5 s) and the "tens of ms" that agent-sandbox's informer-lag issues imply;
- **readiness-probe period** 10 s: Kubernetes' default `periodSeconds`. The kubelet's
  prober ticks on its own schedule, so a pod turns Ready at the first tick after its
  process is up: a uniform 0-10 s after the container start (whose 3-5 s, duckgres #761,
  end when the process answers);
- **scoring**: kube-scheduler's defaults, `NodeResourcesFit` with `LeastAllocated` (pods
  spread over the emptiest nodes) plus `ImageLocality`, worth about a quarter of the
  resource score for a node that holds the pod's image (both plugins weigh 1; a ~500 MB
  image scores ~0.5 of ImageLocality's range, before its spread factor);
- **launch failures** 1 % of node launches never join; Karpenter replaces such a
  NodeClaim after its 15-minute registration TTL (the Karpenter docs' "disruption"
  page), so it is Ready 15 minutes late and paid for meanwhile. The 1 % is an assumption.

The control plane's API-client latency (log-normal, median 10 ms, sigma 0.6) and store-write
latency (median 2 ms) are `ControlPlaneConfig` defaults (`stoker.sim.scenario`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Priority classes of stoker's pods, laid under every scenario's cluster. The background
#: uses bigfleet's 100 / 1000 / 1,000,000 (`stoker.sim.cluster.workloads`). Workers serve
#: interactive sessions: as important as the background's services (1000), above batch
#: and stateless pods (100), below critical real-time ones. Placeholders are the lowest
#: of all, so any pod preempts them; -1 is the cluster-overprovisioner chart's value,
#: above the cluster autoscaler's expendable cutoff of -10.
WORKER_PRIORITY_CLASS = "stoker-worker"
PLACEHOLDER_PRIORITY_CLASS = "stoker-placeholder"
BASE_CLUSTER: Mapping[str, Any] = {
    "priority_classes": {WORKER_PRIORITY_CLASS: 1000, PLACEHOLDER_PRIORITY_CLASS: -1},
    # Pod labels the Kubernetes runtime sets: requested CPU of workers and placeholders.
    "track_labels": ["stoker.dev/pool", "stoker.dev/placeholder"],
    # Measured: `python benchmarks/kube_timings.py` (see the module docstring).
    "api": {"watch_latency_s": 0.01},
    "kubelet": {"ready_delay": {"kind": "uniform", "low": 0.0, "high": 10.0}},
    "scheduler": {"scoring": "least_allocated", "image_locality_weight": 0.5},
}

#: Filled into every node pool of a scenario that does not set them.
NODE_POOL_DEFAULTS: Mapping[str, Any] = {"launch_failure_rate": 0.01}


def with_node_pool_defaults(cluster: Mapping[str, Any]) -> dict[str, Any]:
    """`cluster` with `NODE_POOL_DEFAULTS` under each of its node pools (if it has any)."""
    filled = dict(cluster)
    pools = cluster.get("node_pools")
    if isinstance(pools, list | tuple):
        filled["node_pools"] = [
            {**NODE_POOL_DEFAULTS, **pool} if isinstance(pool, Mapping) else pool for pool in pools
        ]
    return filled
