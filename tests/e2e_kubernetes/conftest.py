"""Fixtures of the e2e tier: one Kubernetes control plane for the session, and `stoker
serve` processes pointed at it with the ServiceAccount token of the manifests' Role.

The binaries come from `cluster/build.sh`'s cache; a missing cache is built first. Under
`CI=true` a failed build fails the tier; elsewhere the tier is skipped with the reason.
Every test runs its own fleet (a label of its own), so the fleets of different tests
never see each other's pods; the cluster, its nodes and the fake kubelet are shared.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import yaml
from kube_control_plane import ControlPlane, binaries, build, by_stoker, until

from servers import Server, environment, start_server

ADMIN = "e2e-stoker-admin-token-0123456789"
#: Short timings, so that every behaviour shows within seconds.
INTERVALS: dict[str, Any] = {
    "janitor_interval_s": 0.5,
    "reaper_interval_s": 0.5,
    "instance_heartbeat_s": 0.5,
    "instance_expiry_s": 3.0,
    "stranded_grace_s": 5.0,
    "stranded_scan_s": 2.0,
    "shutdown_grace_s": 3.0,
}
#: The janitor Lease's timings (seconds): a survivor leads at most ~5 s after a SIGKILL.
LEASE = {"lease_duration_s": 4.0, "renew_deadline_s": 3.0, "retry_period_s": 0.5}


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd, kube-apiserver, kube-scheduler and three fake-kubelet nodes, for the session."""
    bins = binaries()
    if bins is None:
        try:
            bins = build()
        except (subprocess.CalledProcessError, RuntimeError, OSError) as exc:
            if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
                raise
            pytest.skip(
                f"no Kubernetes binaries and tests/e2e_kubernetes/cluster/build.sh failed: {exc}"
            )
    plane = ControlPlane(tmp_path_factory.mktemp("kube"), bins)
    try:
        plane.start()
    except BaseException:
        logs = "\n".join(f"--- {n}\n{plane.log(n)[-3000:]}" for n in plane.procs)
        plane.stop()
        raise AssertionError(f"the control plane did not start:\n{logs}") from None
    yield plane
    plane.stop()


def pod_template(kube: ControlPlane, **overrides: Any) -> dict[str, Any]:
    """A worker pod running the demo worker (the fake kubelet runs its command)."""
    template: dict[str, Any] = {
        "image": "registry.example/stoker-demo-worker:1",
        "command": [sys.executable, "-m", "stoker.demo_worker"],
        # All interfaces, as in a real pod; the fake kubelet binds the pod's own IP.
        "args": ["--port", "{port}", "--worker-id", "{worker_id}", "--host", "0.0.0.0"],
        "cpu": "250m",
        "memory": "64Mi",
        "port": kube.worker_port,
        "priority_class": "stoker-worker",
        "service_account": "stoker-worker",
    }
    template.update(overrides)
    return template


def pool(kube: ControlPlane, name: str = "duck", **overrides: Any) -> dict[str, Any]:
    """A pool of demo-worker pods with short timeouts."""
    spec: dict[str, Any] = {
        "name": name,
        "pod": pod_template(kube),
        "warm_target": 2,
        "hot_idle_ttl": 60,
        "scale_down_delay": 600,
        "claim_timeout_s": 20,
        "timeouts": {"spawn_s": 30, "stop_grace_s": 1, "activation_s": 10},
        "spawn_backoff": {"initial_s": 1, "max_s": 4},
    }
    spec.update(overrides)
    return spec


class Stoker:
    """One `stoker serve` against the cluster, and what an operator sees of it."""

    def __init__(self, server: Server, fleet: str) -> None:
        self.server = server
        self.fleet = fleet
        self.http = httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30
        )

    def pool(self, name: str = "duck") -> dict[str, Any]:
        """`GET /v1/pools/{name}`."""
        response = self.http.get(f"/v1/pools/{name}")
        response.raise_for_status()
        return dict(response.json())

    def workers(self, **params: str) -> list[dict[str, Any]]:
        """`GET /v1/workers` (every page)."""
        found: list[dict[str, Any]] = []
        query: dict[str, str] = dict(params)
        while True:
            response = self.http.get("/v1/workers", params=query)
            response.raise_for_status()
            body = response.json()
            found.extend(body["workers"])
            if not body.get("next"):
                return found
            query["after"] = body["next"]

    def claim(self, org: str, pool: str = "duck", **extra: Any) -> httpx.Response:
        """`POST /v1/claims`."""
        return self.http.post("/v1/claims", json={"pool": pool, "org": org, **extra})

    def release(self, claim_id: str) -> httpx.Response:
        """`DELETE /v1/claims/{id}`."""
        return self.http.delete(f"/v1/claims/{claim_id}")

    def log(self) -> str:
        """What the server logged so far."""
        return self.server.log()

    def stop(self, *args: Any, **kwargs: Any) -> int:
        """Stop the server (see `Server.stop`)."""
        self.http.close()
        return self.server.stop(*args, **kwargs)


StartStoker = Callable[..., Stoker]


@pytest.fixture
def postgres_url() -> str:
    """A PostgreSQL server for tests of several replicas (STOKER_TEST_POSTGRES_URL, which
    `.ci/run` sets); skipped without one, but under CI=true its absence fails."""
    url = os.environ.get("STOKER_TEST_POSTGRES_URL")
    if not url:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("CI=true and STOKER_TEST_POSTGRES_URL is not set")
        pytest.skip("several replicas need PostgreSQL: set STOKER_TEST_POSTGRES_URL")
    return url


@pytest.fixture
def fleet() -> str:
    """A fleet label of this test's own."""
    return f"e2e-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def start_stoker(kube: ControlPlane, fleet: str, tmp_path: Path) -> Iterator[StartStoker]:
    """Starts `stoker serve` processes of `fleet` (all stopped, and the fleet's pods
    deleted, at the end of the test)."""
    started: list[Stoker] = []
    sqlite = f"sqlite:///{tmp_path / 'stoker.db'}"
    schemas: list[tuple[str, str]] = []

    def start(
        pools: list[dict[str, Any]],
        *,
        name: str = "a",
        runtime: dict[str, Any] | None = None,
        intervals: dict[str, Any] | None = None,
        election: dict[str, Any] | str | None = None,
        args: tuple[str, ...] = (),
        log_level: str = "info",
        store: str | None = None,
    ) -> Stoker:
        """`store`: a PostgreSQL URL (a schema of the test's own) for several replicas;
        the default is a SQLite file of the test's own."""
        store_options: dict[str, Any] = {}
        if store is not None:
            store_options["schema"] = f"stoker_{fleet.replace('-', '_')}"
            schemas.append((store, store_options["schema"]))
        config = {
            "fleet": fleet,
            "store": store or sqlite,
            "store_options": store_options,
            "runtime": {
                "kind": "kubernetes",
                "namespace": "stoker",
                "kubeconfig": str(kube.workdir / "kubeconfig-stoker"),
                "resync_s": 30,
                "placeholder_priority_class": "stoker-placeholder",
                **(runtime or {}),
            },
            "leader_election": election
            if election is not None
            else {"kind": "kubernetes", **LEASE},
            "api": {"host": "127.0.0.1", "port": 0, "admin_tokens": [ADMIN]},
            "activation": {"key_file": str(tmp_path / "activation.key")},
            "intervals": {**INTERVALS, **(intervals or {})},
            "log_level": log_level,
            "pools": pools,
        }
        server = start_server(
            tmp_path / name,
            config=yaml.safe_dump(config),
            args=args,
            env=environment(),
        )
        stoker = Stoker(server, fleet)
        started.append(stoker)
        return stoker

    yield start
    for stoker in started:
        if stoker.server.proc.poll() is None:
            stoker.stop(timeout=30)
        stoker.http.close()
        if stoker.server.proc.stdout is not None:
            stoker.server.proc.stdout.close()  # a killed server's pipe
    for url, schema in set(schemas):
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    admin = kube.admin
    assert admin is not None
    for pod in admin.pods(f"stoker.dev/fleet={fleet}"):
        admin.delete_pod(pod["metadata"]["name"], grace_s=0)
    until(lambda: not admin.pods(f"stoker.dev/fleet={fleet}"), 30, f"fleet {fleet} cleaned up")


def stoker_writes(kube: ControlPlane, since: float) -> list[Any]:
    """The audited writes of stoker's ServiceAccount since `since` (epoch seconds)."""
    return [event for event in by_stoker(kube.audit_events()) if event.at >= since]
