"""What the API server refuses on its own, which stoker's config cannot know: a namespace
ResourceQuota with no room for another worker, and a pod template that only the API
server's admission catches (a PriorityClass that does not exist, a LimitRange's maximum).
The typos the config can see (a trailing space in the image) it refuses itself. A running
pool says why in the API server's words and backs off; `config check --connect` has the
API server admit each pool's worker pod and headroom placeholder in a dry run.

No controller-manager runs, so no quota controller: the `quota` fixture writes the quota's
status itself (the admission plugin refuses a quota whose usage is unknown, and counts
each admitted pod in it from there on).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_support import ADMIN, StartStoker, pod_template, pool, stoker_writes
from kube_control_plane import NAMESPACE, ControlPlane, until

pytestmark = [pytest.mark.e2e_kubernetes, pytest.mark.timeout(120)]

QUOTAS = f"/api/v1/namespaces/{NAMESPACE}/resourcequotas"
QUOTA = "worker-pods"
#: An environment value of the template that must never show in an error or the log.
SECRET = "s3cret-api-token-4f1d"


@pytest.fixture
def quota(kube: ControlPlane) -> Iterator[Callable[[int], None]]:
    """Sets the namespace's ResourceQuota on pods (created at the first call, deleted at
    the end of the test), its status as the quota controller would keep it."""
    admin = kube.admin
    assert admin is not None

    def set_pods(hard: int) -> None:
        found = admin.request("GET", f"{QUOTAS}/{QUOTA}")
        if found.status_code == 404:
            body = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": QUOTA}}
            found = admin.request("POST", QUOTAS, json={**body, "spec": {}})
        current = found.json()
        current["spec"] = {"hard": {"pods": str(hard)}}
        current = admin.request("PUT", f"{QUOTAS}/{QUOTA}", json=current).json()
        used = (current.get("status") or {}).get("used") or {"pods": str(len(admin.pods()))}
        current["status"] = {"hard": {"pods": str(hard)}, "used": used}
        admin.request("PUT", f"{QUOTAS}/{QUOTA}/status", json=current)

    yield set_pods
    admin.request("DELETE", f"{QUOTAS}/{QUOTA}")


@pytest.fixture
def cpu_limit(kube: ControlPlane) -> Iterator[None]:
    """A LimitRange of the namespace: at most 1 CPU per container (for the test)."""
    admin = kube.admin
    assert admin is not None
    ranges = f"/api/v1/namespaces/{NAMESPACE}/limitranges"
    limit = {"type": "Container", "max": {"cpu": "1"}}
    body = {"apiVersion": "v1", "kind": "LimitRange", "metadata": {"name": "cpu-limit"}}
    admin.request("POST", ranges, json={**body, "spec": {"limits": [limit]}})
    yield
    admin.request("DELETE", f"{ranges}/cpu-limit")


def pod_creates(kube: ControlPlane, since: float) -> list[float]:
    """When stoker asked for a pod since `since` (admitted or refused)."""
    return [
        e.at
        for e in stoker_writes(kube, since)
        if e.verb == "create" and e.resource == "pods" and not e.subresource
    ]


def test_a_namespace_quota_without_room_shows_why_and_backs_off(
    kube: ControlPlane, start_stoker: StartStoker, quota: Callable[[int], None]
) -> None:
    quota(1)
    started = time.time()
    stoker = start_stoker(
        [
            pool(
                kube,
                warm_target=3,
                claim_timeout_s=3,
                spawn_backoff={"initial_s": 2, "max_s": 4},
            )
        ]
    )
    status = until(
        lambda: (p := stoker.pool())["last_spawn_error"] and p,
        15,
        "the pool names why its pods are not created",
        interval=0.05,
    )
    # The API server's words, once: "cannot create pod w-…: pods "w-…" is forbidden:
    # exceeded quota: worker-pods, requested: pods=1, used: pods=1, limited: pods=1".
    error = status["last_spawn_error"]
    assert f"is forbidden: exceeded quota: {QUOTA}, requested: pods=1" in error
    assert error.count("create pod") == 1, error
    assert status["spawn_failing"] is True
    # The pod the quota admits gets ready a moment (some 80 ms) after the refusals: its
    # readiness ends the back-off, not the trouble (the quota is as full as before). Every
    # read from the first refusal on says the spawns fail, through that readiness, up to
    # the refusals after it: the steady state, one warm worker whose spawns are refused.
    # (It said all was well from the readiness to the next refusal.)
    seen = [status]

    def refused_after_the_admitted_one() -> bool:
        seen.append(p := stoker.pool())
        return bool(p["counts"]["warm"] == 1 and p["spawn_failures"] > 2)

    until(
        refused_after_the_admitted_one,
        20,
        "the worker the quota admits, and the refusals after it",
        interval=0.05,
    )
    reads = [(p["spawn_failing"], p["spawn_failures"], p["counts"]["warm"]) for p in seen]
    assert all(failing for failing, _, _ in reads), reads
    assert all(f"exceeded quota: {QUOTA}" in p["last_spawn_error"] for p in seen)
    shown = subprocess.run(
        [sys.executable, "-m", "stoker", "status", "--url", stoker.server.url, "--token", ADMIN],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    # The status line wraps at the terminal's width: read it as one line.
    line = " ".join(shown.stdout.split())
    assert "spawns failing" in line and f"exceeded quota: {QUOTA}" in line, shown.stdout

    # The one pod the quota admits serves a claim; the next claim is told why it waits.
    assert stoker.claim("org-a").status_code == 201
    refused = stoker.claim("org-b")
    assert refused.status_code == 503, refused.text
    assert f"exceeded quota: {QUOTA}" in refused.json()["detail"]

    # Backing off: after the first burst, a probe every 2-4 s (2 in 6 s), where a pool
    # that does not back off would create 2 pods per janitor tick (0.5 s): some 24.
    first = min(pod_creates(kube, started))
    until(lambda: time.time() > first + 7.5, 15, "6 s of back-off", interval=0.5)
    probes = [t for t in pod_creates(kube, started) if first + 1 <= t < first + 7]
    assert len(probes) <= 5, f"{len(probes)} creates in 6 s"

    # Room in the quota: the pool fills without a restart.
    quota(10)
    until(lambda: stoker.pool()["counts"]["warm"] == 3, 30, "the pool filled")
    assert stoker.pool()["spawn_failing"] is False


def test_a_template_only_the_api_server_refuses_shows_its_reason(
    kube: ControlPlane, start_stoker: StartStoker, cpu_limit: None
) -> None:
    """A PriorityClass the cluster does not have (a typo) and a worker larger than the
    namespace's LimitRange allows (admission's 403s): each pool says why, in the API
    server's words, and keeps the template's secrets to itself. The headroom placeholder
    (a worker's size) is refused too, and asked for again after a pause, not every pass."""
    started = time.time()
    too_big = pod_template(kube, cpu="2")
    typo = pod_template(kube, priority_class="stoker-wroker", env={"API_TOKEN": SECRET})
    stoker = start_stoker(
        [
            pool(kube, pod=typo),
            pool(
                kube, name="goose", pod=too_big, headroom_nodes=1, demand={"headroom": "constant"}
            ),
        ]
    )
    said = until(lambda: stoker.pool()["last_spawn_error"], 15, "duck says why")
    assert "is forbidden: no PriorityClass with name stoker-wroker was found" in said
    refused = until(lambda: stoker.pool("goose")["last_spawn_error"], 15, "goose says why")
    assert "is forbidden: maximum cpu usage per Container is 1, but limit is 2" in refused
    assert SECRET not in str(stoker.pool()) + stoker.log()

    # The placeholder: the first create, then one after the 5 s pause, where a create
    # every janitor pass (0.5 s) would be a dozen.
    def placeholder_creates() -> list[float]:
        return [
            e.at
            for e in stoker_writes(kube, started)
            if e.verb == "create" and e.resource == "pods" and e.name.startswith("headroom-")
        ]

    first = min(until(placeholder_creates, 15, "a placeholder asked for"))
    until(lambda: time.time() > first + 6.5, 15, "6 s of the placeholder's refusals")
    assert len([t for t in placeholder_creates() if t < first + 6]) <= 3
    assert "maximum cpu usage per Container is 1" in stoker.log()


def config_check(
    kube: ControlPlane, tmp_path: Path, pools: list[dict[str, Any]], **runtime: Any
) -> subprocess.CompletedProcess[str]:
    """`stoker config check --connect` of a config with `pools` (and `runtime`'s keys),
    with stoker's ServiceAccount."""
    config = tmp_path / "stoker.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "store": f"sqlite:///{tmp_path / 'stoker.db'}",
                "runtime": {
                    "kind": "kubernetes",
                    "namespace": NAMESPACE,
                    "kubeconfig": str(kube.workdir / "kubeconfig-stoker"),
                    **runtime,
                },
                "activation": {"key_file": str(tmp_path / "activation.key")},
                "pools": pools,
            }
        )
    )
    return subprocess.run(
        [sys.executable, "-m", "stoker", "config", "check", "-c", str(config), "--connect"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_config_check_connect_has_the_api_server_admit_each_worker_pod(
    kube: ControlPlane, tmp_path: Path
) -> None:
    typo = pod_template(kube, priority_class="stoker-wroker", env={"API_TOKEN": SECRET})
    done = config_check(kube, tmp_path, [pool(kube), pool(kube, name="goose", pod=typo)])
    assert done.returncode == 1 and done.stdout == "", done.stderr
    assert done.stderr.splitlines()[-1] == (
        "connect error: pools[1].pod: the API server refuses the worker pod of pool 'goose': "
        'pods "stoker-config-check" is forbidden: no PriorityClass with name stoker-wroker '
        "was found"
    )
    assert SECRET not in done.stderr and "Traceback" not in done.stderr

    # Admission's refusals too, and of the headroom placeholder: a PriorityClass the
    # cluster does not have.
    done = config_check(
        kube,
        tmp_path,
        [pool(kube, headroom_nodes=1)],
        placeholder_priority_class="stoker-placehodler",
    )
    assert done.returncode == 1
    line = done.stderr.splitlines()[-1]
    assert line.startswith(
        "connect error: pools[0].headroom_nodes: the API server refuses the headroom "
        "placeholder of pool 'duck': pods \"headroom-duck-"
    ), line
    assert line.endswith("is forbidden: no PriorityClass with name stoker-placehodler was found")
    assert kube.admin is not None
    assert kube.admin.pod("stoker-config-check") is None  # a dry run stores nothing
