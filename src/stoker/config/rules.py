"""Rules that span sections: each pool's template matches the runtime, headroom only where
it can work, leader election only where its lease can live.

Each rule returns its problems under the key to change; `StokerConfig` raises them together.
"""

from __future__ import annotations

from collections.abc import Sequence

from stoker.config.names import (
    DNS_SUBDOMAIN_RULE,
    LABEL_VALUE_RULE,
    is_dns_subdomain,
    is_label_value,
)
from stoker.config.pools import PoolConfig
from stoker.config.problems import Loc, Problem
from stoker.config.sections import KubernetesRuntimeConfig, RuntimeConfig

#: A rule's problems; one that another key's value makes names that key third.
Problems = list[Problem]
#: The key that decides what a pool's template must be.
_RUNTIME_KIND: Loc = ("runtime", "kind")

#: Settings of a local process, and what to set instead with pods.
_LOCAL_ONLY = (
    ("env", "set pod.env"),
    ("cwd", "the image decides"),
    ("memory_mb", "set pod.memory"),
)


def pool_problems(
    runtime: RuntimeConfig, pools: Sequence[PoolConfig], *, pools_given: bool
) -> Problems:
    """Each pool's template matches the runtime; headroom only where it can work.

    `pools_given`: the config names its pools (the built-in demo pool runs a local process).
    """
    kubernetes = isinstance(runtime, KubernetesRuntimeConfig)
    if kubernetes and not pools_given:
        return [
            (
                ("pools",),
                "required with runtime.kind kubernetes (the built-in demo pool runs a "
                "local process): give each pool a pod",
                _RUNTIME_KIND,
            )
        ]
    problems: Problems = []
    headroom: list[str] = []
    headroom_keys: list[Loc] = []
    for i, pool in enumerate(pools):
        at: Loc = ("pools", i)
        problems += _template_problems(at, pool, kubernetes=kubernetes)
        if kubernetes:
            if not is_label_value(pool.name):
                problems.append(
                    ((*at, "name"), f"with runtime.kind kubernetes, must be {LABEL_VALUE_RULE}")
                )
            # Settings of a local process: with pods they would be silently ignored.
            for key, hint in _LOCAL_ONLY:
                if key in pool.model_fields_set:
                    problems.append(((*at, key), f"is for the local runtime only ({hint})"))
            if pool.headroom_nodes > 0:
                headroom.append(pool.name)
                headroom_keys.append((*at, "headroom_nodes"))
        elif pool.headroom_nodes > 0:
            problems.append(
                (
                    (*at, "headroom_nodes"),
                    "needs runtime.kind kubernetes (placeholder pods hold spare nodes)",
                )
            )
    if (
        headroom
        and isinstance(runtime, KubernetesRuntimeConfig)
        and runtime.placeholder_priority_class is None
    ):
        problems.append(
            (
                ("runtime", "placeholder_priority_class"),
                f"required when a pool has headroom_nodes > 0 ({', '.join(headroom)}): "
                "without a class below the workers', no worker could preempt a placeholder",
                headroom_keys[0],
            )
        )
    return problems


def _template_problems(at: Loc, pool: PoolConfig, *, kubernetes: bool) -> Problems:
    """A pool has a command with the local runtime, a pod with the kubernetes one."""
    if pool.command is not None and pool.pod is not None:
        return [(at, "set command (runtime.kind local) or pod (runtime.kind kubernetes), not both")]
    if kubernetes and pool.pod is None:
        if pool.command is None:
            return [((*at, "pod"), "required", _RUNTIME_KIND)]
        return [
            (
                (*at, "command"),
                "runs a local process, but runtime.kind is kubernetes: give the pool a pod instead",
            )
        ]
    if not kubernetes and pool.command is None:
        if pool.pod is None:
            return [((*at, "command"), "required")]
        return [((*at, "pod"), "needs runtime.kind kubernetes; the local runtime runs a command")]
    return []


def election_problems(
    runtime: RuntimeConfig, kind: str, lease_name: str | None, *, lease_name_given: bool
) -> Problems:
    """A Kubernetes Lease needs the kubernetes runtime and a valid object name.

    `kind` is the resolved elector kind, `lease_name` the resolved lease;
    `lease_name_given`: the config names the lease (else it is derived from the fleet).
    """
    if kind == "kubernetes" and not isinstance(runtime, KubernetesRuntimeConfig):
        return [
            (
                ("leader_election", "kind"),
                "kubernetes needs runtime.kind kubernetes (the Lease lives in the "
                "runtime's namespace and is reached with its credentials); with local "
                "workers use store, on a PostgreSQL store",
            )
        ]
    if kind == "kubernetes" and lease_name is not None and not is_dns_subdomain(lease_name):
        suffix = "" if lease_name_given else " (derived from fleet; set leader_election.lease_name)"
        return [
            (
                ("leader_election", "lease_name"),
                f"{lease_name!r} is not {DNS_SUBDOMAIN_RULE}{suffix}",
                ("leader_election", "lease_name") if lease_name_given else ("fleet",),
            )
        ]
    return []
