"""The Kubernetes runtime: every worker is a pod, created and watched through the ClusterAPI port.

A worker is one pod named after the worker id, built from the pool's `PodTemplate`. Its
labels say which fleet, pool, revision, worker and replica it belongs to; the fleet label
scopes every list and watch, so several stoker deployments can share a namespace. What
happens to pods is learned from an informer, never from a list per claim.

`karpenter.sh/do-not-disrupt: "true"` pins a busy worker's node (activating, hot, hot_idle)
so that consolidation moves only neutral workers. Headroom placeholders are low-priority
pause pods that keep the node autoscaler holding spare nodes; a burst of worker pods
preempts them instead of waiting for new nodes.

The parts: `_pods` renders and reads pods, `_informer` keeps the cache and turns pod
changes into runtime events, `_headroom` keeps the placeholders, and `_runtime` is the
`Runtime` port on top of them. Activation is not here: the HTTP activator speaks to pods
and local workers alike.
"""

from stoker.adapters.runtime_kubernetes._pods import (
    DO_NOT_DISRUPT,
    LABEL_FLEET,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_PLACEHOLDER,
    LABEL_PLACEHOLDER_SPEC,
    LABEL_POOL,
    LABEL_REVISION,
    LABEL_WORKER_ID,
    WORKER_CONTAINER,
    placeholder_pods,
    probe_pod,
    refusal,
)
from stoker.adapters.runtime_kubernetes._runtime import KubernetesRuntime

__all__ = [
    "DO_NOT_DISRUPT",
    "LABEL_FLEET",
    "LABEL_INSTANCE",
    "LABEL_MANAGED_BY",
    "LABEL_PLACEHOLDER",
    "LABEL_PLACEHOLDER_SPEC",
    "LABEL_POOL",
    "LABEL_REVISION",
    "LABEL_WORKER_ID",
    "WORKER_CONTAINER",
    "KubernetesRuntime",
    "placeholder_pods",
    "probe_pod",
    "refusal",
]
