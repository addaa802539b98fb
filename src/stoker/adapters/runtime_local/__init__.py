"""The local-process runtime: every worker is a process on this machine.

Workers are started from an argv list (never a shell) in a session of their own, so a
signal aimed at the control plane does not reach them and they outlive a control-plane
restart; the next start adopts them. Each process carries stoker's labels in its
environment (`STOKER_FLEET`, `STOKER_WORKER_ID`, `STOKER_POOL`, `STOKER_INSTANCE`), which
is how `list_objects` finds stranded ones.

The parts: `_processes` starts a worker and names it safely (pid *and* start time),
`_watches` watches exits through pidfds, `_readiness` probes `/healthz`, `_retention`
deletes the logs of ended workers, and `_runtime` is the `Runtime` port on top of them.
Activation is not here: the HTTP activator speaks to local workers and pods alike.
"""

from stoker.adapters.runtime_local._processes import (
    LABEL_ENDPOINT,
    LABEL_FLEET,
    LABEL_INSTANCE,
    LABEL_POOL,
    LABEL_WORKER_ID,
    free_port,
)
from stoker.adapters.runtime_local._retention import LogRetention
from stoker.adapters.runtime_local._runtime import (
    LocalProcessRuntime,
    default_memory_budget_mb,
    memory_cap,
)
from stoker.adapters.runtime_local._startups import default_start_limit

__all__ = [
    "LABEL_ENDPOINT",
    "LABEL_FLEET",
    "LABEL_INSTANCE",
    "LABEL_POOL",
    "LABEL_WORKER_ID",
    "LocalProcessRuntime",
    "LogRetention",
    "default_memory_budget_mb",
    "default_start_limit",
    "free_port",
    "memory_cap",
]
