"""What the e2e tier's tests share: stoker's config for the cluster, and a `stoker serve`
as an operator sees it (its HTTP API and its log)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import httpx
from kube_control_plane import AuditEvent, ControlPlane, by_stoker

from servers import Server

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


def stoker_writes(kube: ControlPlane, since: float) -> list[AuditEvent]:
    """The audited writes of stoker's ServiceAccount since `since` (epoch seconds)."""
    return [event for event in by_stoker(kube.audit_events()) if event.at >= since]
