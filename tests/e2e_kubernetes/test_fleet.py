"""Stoker's Kubernetes runtime against a real kube-apiserver and kube-scheduler: warm pods,
claims, reuse, isolation, deleted pods, adoption, and the Role's permissions.

Each test runs `stoker serve` as an operator would (config file, the ServiceAccount
token of `deploy/kubernetes/base/rbac.yaml`'s Role) and observes the API server (pods,
audit log) and stoker's HTTP API. The fake kubelet turns bound pods into local demo-worker
processes on loopback addresses (see fake_kubelet.py for what it does not model).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from e2e_support import ADMIN, StartStoker, pool, stoker_writes
from kube_control_plane import ControlPlane, until

pytestmark = [pytest.mark.e2e_kubernetes, pytest.mark.timeout(180)]


def serving_pods(kube: ControlPlane, fleet: str) -> list[dict[str, Any]]:
    """The fleet's worker pods that are Running and Ready, with an IP."""
    assert kube.admin is not None
    found = []
    for pod in kube.admin.pods(f"stoker.dev/fleet={fleet},stoker.dev/worker-id"):
        status = pod.get("status", {})
        ready = any(
            c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", [])
        )
        if status.get("phase") == "Running" and ready and status.get("podIP"):
            found.append(pod)
    return found


def test_warm_pods_are_scheduled_and_ready(
    kube: ControlPlane, start_stoker: StartStoker, fleet: str
) -> None:
    started = time.time()
    stoker = start_stoker([pool(kube, warm_target=3)])
    until(lambda: stoker.pool()["counts"]["warm"] == 3, 60, "three warm workers")
    pods = serving_pods(kube, fleet)
    assert len(pods) == 3
    # The real scheduler placed them on the fake kubelet's nodes.
    assert {pod["spec"]["nodeName"] for pod in pods} <= {"node-a", "node-b", "node-c"}
    warm = stoker.workers(pool="duck", state="warm")
    assert {w["endpoint"] for w in warm} == {
        f"http://{pod['status']['podIP']}:{kube.worker_port}" for pod in pods
    }
    # Created with the Role's token: no 403 anywhere, all writes by stoker's account.
    writes = stoker_writes(kube, started)
    assert [w for w in writes if w.verb == "create" and w.resource == "pods"]
    assert not [w for w in writes if w.status == 403]
    log = stoker.log()
    assert "forbidden" not in log.lower()
    # A refusal is logged as a warning or an error; 403 in an info line is a timestamp's
    # digits (12:24:28.403), a worker id's or a resource version (resource_version=403).
    after_times = [line.split(" level=", 1)[-1] for line in log.splitlines()]
    refused = [
        rest for rest in after_times if "403" in rest and not rest.startswith(("info", "debug"))
    ]
    assert not refused, log


def test_claim_use_release_reuse_and_isolation(
    kube: ControlPlane, start_stoker: StartStoker, fleet: str
) -> None:
    stoker = start_stoker([pool(kube, warm_target=2)])
    until(lambda: stoker.pool()["counts"]["warm"] == 2, 60, "two warm workers")

    first = stoker.claim("org-a")
    assert first.status_code == 201, first.text
    claim = first.json()
    worker = claim["worker"]
    # The claimant reaches its pod with the session token, and nobody else does.
    used = httpx.get(
        worker["endpoint"] + "/", headers={"Authorization": f"Bearer {worker['token']}"}
    )
    assert used.status_code == 200 and used.json()["org"] == "org-a"
    assert httpx.get(worker["endpoint"] + "/").status_code == 401
    # The hot pod is pinned against node consolidation.
    admin = kube.admin
    assert admin is not None
    until(
        lambda: (
            (admin.pod(worker["id"]) or {})["metadata"]
            .get("annotations", {})
            .get("karpenter.sh/do-not-disrupt")
            == "true"
        ),
        10,
        "the hot pod carries do-not-disrupt",
    )

    assert stoker.release(claim["id"]).status_code in (200, 204)
    again = stoker.claim("org-a").json()
    assert again["source"] == "reuse" and again["worker"]["id"] == worker["id"]
    # The old token is revoked by the reuse's new one.
    assert (
        httpx.get(
            worker["endpoint"] + "/", headers={"Authorization": f"Bearer {worker['token']}"}
        ).status_code
        == 401
    )

    other = stoker.claim("org-b").json()
    assert other["worker"]["id"] != worker["id"]
    assert other["source"] in ("warm", "cold")
    assert stoker.release(again["id"]).status_code in (200, 204)
    third = stoker.claim("org-b").json()
    # org-b never gets the pod org-a used, even while it sits idle.
    assert third["worker"]["id"] != worker["id"]
    assert ADMIN not in stoker.log()


def test_a_deleted_hot_pod_fails_its_claim_and_a_deleted_warm_pod_is_replaced(
    kube: ControlPlane, start_stoker: StartStoker, fleet: str
) -> None:
    assert kube.admin is not None
    stoker = start_stoker([pool(kube, warm_target=2)])
    until(lambda: stoker.pool()["counts"]["warm"] == 2, 60, "two warm workers")
    claim = stoker.claim("org-a").json()
    until(lambda: stoker.pool()["counts"]["warm"] == 2, 30, "the warm target refilled")

    # An operator (or a node drain) deletes the hot pod: the claim fails with a reason,
    # and the worker is never swapped for another under the session.
    kube.admin.delete_pod(claim["worker"]["id"])
    failed = until(
        lambda: (
            (c := stoker.http.get(f"/v1/claims/{claim['id']}").json())["state"] == "failed" and c
        ),
        15,
        "the claim of the deleted pod failed",
    )
    assert failed["reason"] and failed["worker"]["id"] == claim["worker"]["id"]
    until(
        lambda: claim["worker"]["id"] not in {w["id"] for w in stoker.workers(pool="duck")},
        15,
        "the lost worker retired",
    )

    # A warm pod deleted from outside is replaced (demand is conserved).
    warm = {w["id"] for w in stoker.workers(pool="duck", state="warm")}
    victim = sorted(warm)[0]
    deleted_at = time.monotonic()
    kube.admin.delete_pod(victim, grace_s=0)
    until(
        lambda: (
            victim not in (now := {w["id"] for w in stoker.workers(pool="duck", state="warm")})
            and len(now) == 2
        ),
        20,
        "the deleted warm pod replaced",
    )
    replaced_s = time.monotonic() - deleted_at
    assert replaced_s < 20
    assert len(serving_pods(kube, fleet)) == 2


def test_a_restarted_server_adopts_its_pods(
    kube: ControlPlane, start_stoker: StartStoker, fleet: str
) -> None:
    first = start_stoker([pool(kube, warm_target=2)])
    until(lambda: first.pool()["counts"]["warm"] == 2, 60, "two warm workers")
    hot = first.claim("org-a").json()
    until(lambda: first.pool()["counts"]["warm"] == 2, 30, "the warm target refilled")
    before = {pod["metadata"]["name"] for pod in serving_pods(kube, fleet)}
    assert first.stop() == 0
    # Without --stop-workers the pods outlive the server.
    assert {pod["metadata"]["name"] for pod in serving_pods(kube, fleet)} == before

    restarted_at = time.time()
    second = start_stoker([pool(kube, warm_target=2)], name="b")
    until(lambda: second.pool()["counts"]["warm"] == 2, 30, "the warm pods adopted")
    assert {w["id"] for w in second.workers(pool="duck")} == before
    # No pod was created again: adoption relabels, it does not respawn.
    creates = [
        w for w in stoker_writes(kube, restarted_at) if w.verb == "create" and w.resource == "pods"
    ]
    assert creates == []
    # The session survived the restart: its token still reaches its pod.
    used = httpx.get(
        hot["worker"]["endpoint"] + "/",
        headers={"Authorization": f"Bearer {hot['worker']['token']}"},
    )
    assert used.status_code == 200 and used.json()["org"] == "org-a"
    assert second.http.get(f"/v1/claims/{hot['id']}").json()["state"] == "bound"
