"""What the real kube-scheduler and the API server's answers do to stoker's pods: placeholders
preempted for workers, the client's create budget (counted in the audit log), pods that
cannot be scheduled, and pods that take long to start.

The nodes are the fake kubelet's three (4 CPUs each); every test's pods are its own
fleet's and are deleted at its end, so each test starts on empty nodes.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from e2e_support import StartStoker, pod_template, pool, stoker_writes
from fake_kubelet import PULL_SECONDS
from kube_control_plane import NODE_NAMES, ControlPlane, until

pytestmark = [pytest.mark.e2e_kubernetes, pytest.mark.timeout(180)]

PLACEHOLDER = "stoker.dev/placeholder"
PIN = "karpenter.sh/do-not-disrupt"


def fleet_pods(kube: ControlPlane, fleet: str, extra: str = "") -> list[dict[str, Any]]:
    """The pods of `fleet` (narrowed by the label selector `extra`)."""
    assert kube.admin is not None
    selector = f"stoker.dev/fleet={fleet}" + (f",{extra}" if extra else "")
    return kube.admin.pods(selector)


def pod_creates(kube: ControlPlane, since: float, names: set[str]) -> list[float]:
    """When stoker created the pods called `names` (audit timestamps, sorted)."""
    return sorted(
        event.at
        for event in stoker_writes(kube, since)
        if event.verb == "create"
        and event.resource == "pods"
        and not event.subresource
        and event.name in names
        and event.status == 201
    )


def test_workers_preempt_the_headroom_placeholder(
    kube: ControlPlane, start_stoker: StartStoker, fleet: str
) -> None:
    # A placeholder fills a whole node's spare room (3.5 of 4 CPUs); workers take 1.5.
    stoker = start_stoker(
        [
            pool(
                kube,
                warm_target=0,
                headroom_nodes=1,
                # No claim goes cold here: only a constant headroom holds the node.
                demand={"headroom": "constant"},
                pod=pod_template(kube, cpu="1500m", memory="64Mi"),
            )
        ],
        runtime={"placeholder_size": {"cpu": "3500m", "memory": "64Mi"}},
    )

    def bound_placeholder() -> dict[str, Any] | None:
        found = [p for p in fleet_pods(kube, fleet, PLACEHOLDER) if p["spec"].get("nodeName")]
        return found[0] if found else None

    held = until(bound_placeholder, 30, "the placeholder bound to a node")
    held_node = held["spec"]["nodeName"]

    # Five workers need all three nodes (two fit on each), the placeholder's too.
    assert stoker.http.patch("/v1/pools/duck", json={"warm_target": 5}).status_code == 200
    until(lambda: stoker.pool()["counts"]["warm"] == 5, 60, "five warm workers")
    workers = fleet_pods(kube, fleet, "stoker.dev/worker-id")
    assert len(workers) == 5
    assert held_node in {w["spec"]["nodeName"] for w in workers}
    assert {w["spec"]["nodeName"] for w in workers} == set(NODE_NAMES)
    # The scheduler evicted the placeholder; stoker's new one waits for a node.
    assert kube.admin is not None
    assert (
        kube.admin.pod(held["metadata"]["name"]) is None
        or (kube.admin.pod(held["metadata"]["name"]) or {})["metadata"].get("uid")
        != held["metadata"]["uid"]
    )
    waiting = until(
        lambda: [p for p in fleet_pods(kube, fleet, PLACEHOLDER) if not p["spec"].get("nodeName")],
        30,
        "a new placeholder pending",
    )
    assert len(waiting) == 1


def test_pod_creates_keep_to_the_client_budget(
    kube: ControlPlane, start_stoker: StartStoker, fleet: str
) -> None:
    """qps 5 / burst 40: a burst of 50 spawns sends ~40 creates at once, the rest as the
    bucket refills at 5/s, never faster."""
    qps, burst, count = 5.0, 40, 50
    started = time.time()
    # Containers that never listen: the creates are what is measured, not start-ups.
    template = pod_template(kube, command=["sleep", "600"], args=[], cpu="100m", memory="16Mi")
    stoker = start_stoker(
        [pool(kube, warm_target=count, pod=template, timeouts={"spawn_s": 120})],
        runtime={"qps": qps, "burst": burst},
        election="none",
    )

    def all_created() -> set[str] | None:
        found = {p["metadata"]["name"] for p in fleet_pods(kube, fleet)}
        return found if len(found) >= count else None

    names = until(all_created, 60, f"{count} pods created")
    times = pod_creates(kube, started, names)
    assert len(times) == count, "one create per pod, none retried"
    first = times[0]
    # The burst goes out at once, not at qps (which would allow 5 in that second; a few
    # tokens went to the informer's list and watch, and a loaded machine is slow).
    assert sum(1 for t in times if t - first < 1.0) >= burst - 10
    # Never faster than the bucket allows: by t seconds, at most burst + qps * t creates.
    # The audit log stamps a request when the API server receives it, up to some 0.5 s
    # after its token was taken on a loaded machine.
    for index, at in enumerate(times):
        assert index + 1 <= burst + qps * (at - first + 0.5) + 1, (index, at - first)
    # And no slower than the refill: the creates past the burst take about
    # (count - burst) / qps (some tokens went to the informer's list and watch).
    expected_s = (count - burst) / qps
    assert times[-1] - first <= 1.5 * expected_s + 2, f"{times[-1] - first:.2f} s"
    stoker.stop()


def test_an_unschedulable_pool_shows_why_and_backs_off(
    kube: ControlPlane, start_stoker: StartStoker, fleet: str
) -> None:
    """Defect 2 (issue #24): an Unschedulable pod is a spawn failure with its reason, the
    pool backs off, and its pods wait instead of churning through create-retire-create."""
    started = time.time()
    template = pod_template(kube, node_selector={"e2e.stoker.dev/no-such-node": "true"})
    stoker = start_stoker(
        [
            pool(
                kube,
                warm_target=2,
                pod=template,
                timeouts={"spawn_s": 4, "stop_grace_s": 1},
                spawn_backoff={"initial_s": 4, "max_s": 30},
            )
        ]
    )
    status = until(
        lambda: (p := stoker.pool())["last_spawn_error"] and p,
        10,
        "the pool names why its pods do not start",
    )
    # The scheduler's own words: "0/3 nodes are available: 3 node(s) didn't match ...".
    assert "unschedulable" in status["last_spawn_error"]
    assert "0/3 nodes are available" in status["last_spawn_error"]
    assert status["spawn_failing"] is True
    assert status["spawn_failures"] >= 1
    # 16 s with a 4 s spawn timeout: a churning pool creates 2 pods every 4 s (8 or more);
    # a backing-off one its first 2 and a probe per back-off interval.
    deadline = started + 16
    until(lambda: time.time() >= deadline, 20, "16 s of the pool's life", interval=0.5)
    creates = [
        e for e in stoker_writes(kube, started) if e.verb == "create" and e.resource == "pods"
    ]
    assert len(creates) <= 5, f"{len(creates)} creates in 16 s"
    # The pods wait (a node autoscaler may bring a node): none retired and recreated.
    deletes = [
        e for e in stoker_writes(kube, started) if e.verb == "delete" and e.resource == "pods"
    ]
    assert deletes == []


def test_a_pod_still_pulling_its_image_is_not_recreated(
    kube: ControlPlane, start_stoker: StartStoker, fleet: str
) -> None:
    """Defect 2 (issue #24): a scheduled pod that is progressing (its image pulling for
    longer than spawn_s) is waited for, not retired as stuck and created again."""
    started = time.time()
    template = pod_template(kube, annotations={PULL_SECONDS: "10"})
    stoker = start_stoker(
        [pool(kube, warm_target=2, pod=template, timeouts={"spawn_s": 4, "stop_grace_s": 1})]
    )
    until(lambda: stoker.pool()["counts"]["warm"] == 2, 25, "two warm workers after the pull")
    creates = [
        e for e in stoker_writes(kube, started) if e.verb == "create" and e.resource == "pods"
    ]
    assert len(creates) == 2, [e.name for e in creates]
    retired = stoker.workers(pool="duck", state="retired")
    assert retired == []


def test_new_workers_are_scheduled_beside_the_sessions(
    kube: ControlPlane, start_stoker: StartStoker, fleet: str
) -> None:
    """kube-scheduler's default profile spreads pods (LeastAllocated): without a preference,
    new workers would go to the two empty nodes (checked by hand with the preference off).
    With `prefer_session_nodes`, spawned while a session runs, they prefer its node
    (preferred node affinity on the hostname), so their sessions gather there and the
    other nodes stay empty for the node autoscaler to take back."""
    stoker = start_stoker([pool(kube, warm_target=1)], runtime={"prefer_session_nodes": True})
    until(lambda: stoker.pool()["counts"]["warm"] == 1, 60, "one warm worker")
    response = stoker.claim("org-a")
    assert response.status_code == 201, response.text
    session = response.json()["worker"]["id"]
    assert kube.admin is not None

    def pinned_node() -> str | None:
        pod = kube.admin.pod(session) if kube.admin is not None else None
        meta = (pod or {}).get("metadata", {})
        if (meta.get("annotations") or {}).get(PIN) != "true":
            return None
        return str((pod or {}).get("spec", {}).get("nodeName") or "") or None

    node = until(pinned_node, 20, "the session's pod pinned on a node")

    # The refill spawned at the claim may have gone out before the pin was seen; wait for
    # it (and any the claim's demand asked for), then ask for two more workers: they are
    # spawned with the session's node known.
    def settled() -> int | None:
        counts = stoker.pool()["counts"]
        return counts["warm"] if counts["warm"] >= 1 and not counts["spawning"] else None

    warm = until(settled, 60, "the refill warm")
    before = {p["metadata"]["name"] for p in fleet_pods(kube, fleet, "stoker.dev/worker-id")}
    patched = stoker.http.patch("/v1/pools/duck", json={"warm_target": warm + 2})
    assert patched.status_code == 200
    until(lambda: stoker.pool()["counts"]["warm"] >= warm + 2, 60, "two more warm workers")
    new = [
        p
        for p in fleet_pods(kube, fleet, "stoker.dev/worker-id")
        if p["metadata"]["name"] not in before
    ]
    assert len(new) >= 2
    for pod in new:
        terms = pod["spec"]["affinity"]["nodeAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        assert terms == [
            {
                "weight": 100,
                "preference": {
                    "matchExpressions": [
                        {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}
                    ]
                },
            }
        ]
    assert {pod["spec"]["nodeName"] for pod in new} == {node}
    stoker.stop()
