"""Stoker through the API server's outages and its own replicas' deaths: watches that resume
after a restart of kube-apiserver and after a 410 Gone (etcd compacted), and the janitor
Lease moving to a second replica after the leader's SIGKILL, with no pod leaked or
assigned twice.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
from e2e_support import LEASE, StartStoker, Stoker, pool
from kube_control_plane import ControlPlane, until

pytestmark = [pytest.mark.e2e_kubernetes, pytest.mark.timeout(240)]


#: How long stoker may take to be whole again after the API server comes back: its watch
#: retries back off (up to 8 s between tries), a restarted API server refuses the
#: ServiceAccount (403) until its RBAC cache is filled, the janitor Lease is taken again,
#: and a refill cut short by the outage spawns once more. On a loaded machine it once took
#: more than 20 s.
RECOVERY_S = 60


def replace_one_warm(kube: ControlPlane, stoker: Stoker, timeout: float = RECOVERY_S) -> None:
    """Once the pool is at its warm target, delete a warm pod from outside and wait until
    stoker has replaced it: proof that its informer sees the cluster's events again."""
    assert kube.admin is not None
    target = stoker.pool()["warm_target"]
    until(lambda: stoker.pool()["counts"]["warm"] == target, timeout, "the warm target met")
    warm = {w["id"] for w in stoker.workers(pool="duck", state="warm")}
    victim = sorted(warm)[0]
    kube.admin.delete_pod(victim, grace_s=0)
    until(
        lambda: (
            victim not in (now := {w["id"] for w in stoker.workers(pool="duck", state="warm")})
            and len(now) == target
        ),
        timeout,
        f"warm pod {victim} replaced",
    )


def relists(stoker: Stoker) -> int:
    """How many times the informer listed again after a 410 Gone."""
    return sum(
        1
        for line in stoker.log().splitlines()
        if "event=informer_relist" in line and "reason=gone" in line
    )


def test_watches_resume_after_an_apiserver_restart_and_a_compaction(
    kube: ControlPlane, start_stoker: StartStoker
) -> None:
    stoker = start_stoker([pool(kube, warm_target=2)])
    until(lambda: stoker.pool()["counts"]["warm"] == 2, 60, "two warm workers")

    kube.restart_apiserver()
    replace_one_warm(kube, stoker)
    claim = stoker.claim("org-a")
    assert claim.status_code == 201, claim.text

    # The pods' history before now is compacted away, and etcd's revision has moved on
    # since the last pod event: a watch resumed from it gets 410 Gone from the restarted
    # API server, and the informer must list again.
    gone_before = relists(stoker)
    assert kube.admin is not None
    kube.admin.advance_revision()
    kube.stop_apiserver()
    kube.etcd_compact()
    kube.start_apiserver()
    replace_one_warm(kube, stoker)
    until(lambda: relists(stoker) > gone_before, RECOVERY_S, "a relist after 410 Gone")
    assert stoker.claim("org-b").status_code == 201


def holder(kube: ControlPlane, fleet: str) -> str | None:
    """The janitor Lease's holder."""
    assert kube.admin is not None
    lease = kube.admin.lease(f"{fleet}-janitor")
    return None if lease is None else lease["spec"].get("holderIdentity")


def test_the_lease_moves_to_a_second_replica_after_the_leaders_sigkill(
    kube: ControlPlane, start_stoker: StartStoker, fleet: str, postgres_url: str
) -> None:
    assert kube.admin is not None
    first = start_stoker([pool(kube, warm_target=3)], name="a", store=postgres_url)
    until(lambda: first.pool()["counts"]["warm"] == 3, 60, "three warm workers")
    leader = until(lambda: holder(kube, fleet), 15, "a janitor Lease holder")
    second = start_stoker([pool(kube, warm_target=3)], name="b", store=postgres_url)
    hot = first.claim("org-a").json()

    killed = time.monotonic()
    first.server.proc.send_signal(signal.SIGKILL)
    first.server.proc.wait(10)
    successor = until(
        lambda: (h := holder(kube, fleet)) not in (None, leader) and h,
        LEASE["lease_duration_s"] + 10,
        "the Lease taken over",
        interval=0.05,
    )
    takeover_s = time.monotonic() - killed
    assert successor != leader
    assert takeover_s <= LEASE["lease_duration_s"] + LEASE["retry_period_s"] + 3

    # The new leader keeps the pool at its target; every pod is a live worker of the
    # store (none leaked), and no worker serves two claims.
    until(lambda: second.pool()["counts"]["warm"] == 3, 30, "warm target kept by b")

    def pods_match_workers() -> bool:
        pods = {
            p["metadata"]["name"]
            for p in kube.admin.pods(f"stoker.dev/fleet={fleet},stoker.dev/worker-id")  # type: ignore[union-attr]
            if not p["metadata"].get("deletionTimestamp")
        }
        live = {w["id"] for w in second.workers(pool="duck") if w["state"] != "draining"}
        return pods == live

    until(pods_match_workers, 30, "every pod a live worker of the store")
    claims: list[dict[str, Any]] = [second.claim(f"org-{i}").json() for i in range(3)]
    ids = [c["worker"]["id"] for c in claims]
    assert len(set(ids)) == 3 and hot["worker"]["id"] not in ids
    assert second.http.get(f"/v1/claims/{hot['id']}").json()["state"] == "bound"
