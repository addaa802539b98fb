"""A one-machine Kubernetes control plane for the e2e tier: etcd, kube-apiserver and
kube-scheduler from the binaries `cluster/build.sh` caches, plus the fake kubelet.

`ControlPlane.start(workdir)` runs them on free loopback ports in `workdir`, with RBAC,
a token file holding one admin token (for the tests and the fake kubelet only), the
service-account issuer and key (so that stoker gets a TokenRequest token of the
ServiceAccount `stoker`, bound by the manifests' Role and nothing else), and an audit log
of every request of stoker's ServiceAccount and every pod and Lease write in stoker's
namespace, the kubelet's pod status writes included (`audit_events` reads it back, to
count creates and deletes and to time them). No controller-manager runs: nothing
garbage-collects, nothing marks nodes NotReady; the admission plugins that would wait for
one are off.

`Admin` is a small synchronous client with the admin token for what the tests do from
outside, as an operator would: read pods, delete one, apply manifests.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BUILD_SCRIPT = HERE / "cluster" / "build.sh"
KUBE_VERSION = "1.20.2"
NAMESPACE = "stoker"
ADMIN_TOKEN = "e2e-admin-token-not-secret-0123456789"
#: The nodes the fake kubelet registers (each one's allocatable resources).
NODE_NAMES = ("node-a", "node-b", "node-c")
NODE_CPU = "4"
NODE_MEMORY = "8Gi"


def cache_dir() -> Path:
    """The versioned directory `build.sh` fills (bin/ holds the binaries)."""
    override = os.environ.get("STOKER_KUBE_E2E_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "stoker" / "kube-e2e" / f"v1-{KUBE_VERSION}"


def binaries() -> dict[str, Path] | None:
    """The three binaries, or None when one of them is not built yet."""
    bin_dir = cache_dir() / "bin"
    found = {name: bin_dir / name for name in ("etcd", "kube-apiserver", "kube-scheduler")}
    return found if all(os.access(path, os.X_OK) for path in found.values()) else None


def build() -> dict[str, Path]:
    """Run `build.sh` (a no-op when cached) and return the binaries; raises on failure."""
    subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, stdout=subprocess.DEVNULL)
    found = binaries()
    if found is None:
        raise RuntimeError(f"{BUILD_SCRIPT} ran but {cache_dir()}/bin is incomplete")
    return found


def free_port() -> int:
    """A TCP port free on all interfaces right now."""
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        return int(sock.getsockname()[1])


def until(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll `condition` until it returns something truthy (returned) or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = condition()
        except (httpx.HTTPError, OSError, KeyError, ValueError) as exc:
            value, last_error = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise AssertionError(f"not within {timeout:g}s: {what}{detail}")
        time.sleep(interval)


AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        # Every request of stoker's ServiceAccount (reads too: a 403 anywhere shows).
        {"level": "Metadata", "users": [f"system:serviceaccount:{NAMESPACE}:stoker"]},
        {
            "level": "Metadata",
            "verbs": ["create", "delete", "deletecollection", "patch", "update"],
            "resources": [
                # Status too: when the kubelet reported a pod Ready, to the microsecond.
                {"group": "", "resources": ["pods", "pods/status"]},
                {"group": "coordination.k8s.io", "resources": ["leases"]},
            ],
            "namespaces": [NAMESPACE],
        },
        {"level": "None"},
    ],
}


@dataclass(frozen=True)
class AuditEvent:
    """One audited write: who, what, when (seconds since the epoch: received, and
    answered), and its status."""

    verb: str
    resource: str
    name: str
    user: str
    status: int
    at: float
    subresource: str = ""
    answered: float = 0.0


def _rfc3339(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class Admin:
    """The API server with the admin token: what the tests read and do from outside."""

    def __init__(self, url: str, token: str = ADMIN_TOKEN) -> None:
        self.url = url
        self.http = httpx.Client(
            base_url=url,
            verify=False,
            headers={"Authorization": f"Bearer {token}"},
            timeout=10.0,
        )

    def close(self) -> None:
        """Close the connections."""
        self.http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request; raises for an error status other than 404 and 409."""
        response = self.http.request(method, path, **kwargs)
        if response.status_code >= 400 and response.status_code not in (404, 409):
            raise httpx.HTTPStatusError(
                f"{method} {path}: {response.status_code} {response.text[:300]}",
                request=response.request,
                response=response,
            )
        return response

    def apply(self, manifest: Mapping[str, Any]) -> None:
        """Create the object (a 409 leaves the existing one as it is)."""
        api = manifest["apiVersion"]
        prefix = "/api/v1" if api == "v1" else f"/apis/{api}"
        plural = {
            "Namespace": "namespaces",
            "ServiceAccount": "serviceaccounts",
            "Role": "roles",
            "RoleBinding": "rolebindings",
            "PriorityClass": "priorityclasses",
        }[manifest["kind"]]
        namespace = manifest["metadata"].get("namespace")
        path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
        self.request("POST", path, json=manifest)

    def pods(self, selector: str = "", namespace: str = NAMESPACE) -> list[dict[str, Any]]:
        """The pods of `namespace` that `selector` (a label selector) matches."""
        params = {"labelSelector": selector} if selector else {}
        response = self.request("GET", f"/api/v1/namespaces/{namespace}/pods", params=params)
        items: list[dict[str, Any]] = response.json()["items"]
        return items

    def pod(self, name: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
        """One pod, or None when it does not exist."""
        response = self.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        return None if response.status_code == 404 else dict(response.json())

    def delete_pod(self, name: str, grace_s: int | None = None) -> None:
        """Delete a pod as `kubectl delete pod` would."""
        params = {} if grace_s is None else {"gracePeriodSeconds": str(grace_s)}
        self.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}", params=params)

    def advance_revision(self, writes: int = 3) -> None:
        """Write something no pod watch sees (an annotation of namespace `default`), so
        that etcd's revision moves past every pod watcher's last resourceVersion."""
        for index in range(writes):
            self.request(
                "PATCH",
                "/api/v1/namespaces/default",
                json={"metadata": {"annotations": {"e2e.stoker.dev/tick": str(index)}}},
                headers={"Content-Type": "application/merge-patch+json"},
            )

    def lease(self, name: str) -> dict[str, Any] | None:
        """One Lease of stoker's namespace, or None."""
        response = self.request(
            "GET", f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{name}"
        )
        return None if response.status_code == 404 else dict(response.json())

    def service_account_token(self, name: str, seconds: int = 3600) -> str:
        """A TokenRequest token of the ServiceAccount `name` in stoker's namespace."""
        response = self.request(
            "POST",
            f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{name}/token",
            json={
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": seconds},
            },
        )
        token: str = response.json()["status"]["token"]
        return token


def manifests(*names: str) -> Iterator[dict[str, Any]]:
    """The objects of `deploy/kubernetes/base/<name>.yaml`, as the kustomization has them."""
    for name in names:
        text = (REPO / "deploy" / "kubernetes" / "base" / f"{name}.yaml").read_text()
        for document in yaml.safe_load_all(text):
            if document:
                yield document


def kubeconfig(url: str, token: str, user: str) -> str:
    """A kubeconfig for `url` with a bearer token (the serving certificate is self-signed)."""
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "e2e", "cluster": {"server": url, "insecure-skip-tls-verify": True}}
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [
                {
                    "name": user,
                    "context": {"cluster": "e2e", "user": user, "namespace": NAMESPACE},
                }
            ],
            "current-context": user,
        }
    )


@dataclass
class ControlPlane:
    """etcd, kube-apiserver, kube-scheduler and the fake kubelet, in `workdir`."""

    workdir: Path
    bins: Mapping[str, Path]
    etcd_port: int = field(default_factory=free_port)
    etcd_peer_port: int = field(default_factory=free_port)
    api_port: int = field(default_factory=free_port)
    #: The port every worker pod listens on, each on its own loopback IP.
    worker_port: int = field(default_factory=free_port)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    admin: Admin | None = None
    #: The token of the ServiceAccount `stoker`, bound by the Role only.
    stoker_token: str = ""

    @property
    def url(self) -> str:
        """The API server's URL."""
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def audit_log(self) -> Path:
        """The API server's audit log (JSON lines)."""
        return self.workdir / "audit.log"

    def log(self, name: str) -> str:
        """What component `name` wrote so far (its last 20 000 characters)."""
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-20_000:] if path.exists() else ""

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start everything, apply stoker's namespace, RBAC and PriorityClasses, and wait
        until three nodes are Ready and schedulable."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._write_files()
        self.start_etcd()
        self.start_apiserver()
        self.admin = Admin(self.url)
        self._bootstrap()
        self.start_scheduler()
        self.start_kubelet()
        until(self._nodes_ready, 60, "three Ready nodes")

    def stop(self) -> None:
        """Stop every component (the kubelet first: it stops the worker processes)."""
        for name in ("kubelet", "kube-scheduler", "kube-apiserver", "etcd"):
            self._stop(name)
        if self.admin is not None:
            self.admin.close()

    def _stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def _spawn(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> None:
        with open(self.workdir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                argv,
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                start_new_session=True,
            )

    def _alive(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{name} exited with {proc.returncode}:\n{self.log(name)}")

    def _write_files(self) -> None:
        (self.workdir / "tokens.csv").write_text(
            f'{ADMIN_TOKEN},e2e-admin,e2e-admin,"system:masters"\n'
        )
        (self.workdir / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
        key = self.workdir / "sa.key"
        if not key.exists():
            subprocess.run(
                ["openssl", "genrsa", "-out", str(key), "2048"],
                check=True,
                capture_output=True,
            )
        (self.workdir / "kubeconfig-admin").write_text(
            kubeconfig(self.url, ADMIN_TOKEN, "e2e-admin")
        )

    def start_etcd(self) -> None:
        """Start etcd (its data survives a restart of the API server)."""
        self._spawn(
            "etcd",
            [
                str(self.bins["etcd"]),
                "--name=e2e",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{self.etcd_peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{self.etcd_peer_port}",
                f"--initial-cluster=e2e=http://127.0.0.1:{self.etcd_peer_port}",
                "--log-level=warn",
                "--unsafe-no-fsync",
            ],
        )

        def healthy() -> bool:
            self._alive("etcd")
            url = f"http://127.0.0.1:{self.etcd_port}/health"
            return httpx.get(url, timeout=2).status_code == 200

        until(healthy, 30, "etcd healthy")

    def start_apiserver(self) -> None:
        """Start kube-apiserver on `api_port` and wait until it is ready."""
        work = self.workdir
        self._spawn(
            "kube-apiserver",
            [
                str(self.bins["kube-apiserver"]),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.api_port}",
                "--insecure-port=0",
                f"--cert-dir={work / 'certs'}",
                f"--token-auth-file={work / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-signing-key-file={work / 'sa.key'}",
                f"--service-account-key-file={work / 'sa.key'}",
                "--api-audiences=https://kubernetes.default.svc.cluster.local",
                "--service-cluster-ip-range=10.96.0.0/24",
                "--endpoint-reconciler-type=none",
                "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
                f"--audit-policy-file={work / 'audit-policy.yaml'}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-maxsize=500",
                "--v=0",
            ],
        )

        def ready() -> bool:
            self._alive("kube-apiserver")
            response = httpx.get(
                f"{self.url}/readyz",
                verify=False,
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                timeout=2,
            )
            return response.status_code == 200

        until(ready, 90, "kube-apiserver ready", interval=0.25)
        if "kube-scheduler" in self.procs:
            # Back from an outage: client-go's reflectors in the scheduler back off up to
            # 30 s (jittered to 60 s) after repeated failures, and a later test's pods would
            # wait that long to be bound. A fresh scheduler lists at once.
            self._stop("kube-scheduler", timeout=5.0)
            self.start_scheduler()

    def stop_apiserver(self, sig: int = signal.SIGTERM) -> None:
        """Stop the API server (etcd and everything else keep running).

        It stops listening at once on SIGTERM but then waits for its open watches; after
        3 s it is killed, so that an outage lasts as long as the test means it to.
        """
        self._stop("kube-apiserver", sig, timeout=3.0)

    def restart_apiserver(self) -> None:
        """Stop and start the API server on the same port."""
        self.stop_apiserver()
        self.start_apiserver()

    def start_scheduler(self) -> None:
        """Start kube-scheduler (no serving ports, no leader election)."""
        self._spawn(
            "kube-scheduler",
            [
                str(self.bins["kube-scheduler"]),
                f"--kubeconfig={self.workdir / 'kubeconfig-admin'}",
                "--leader-elect=false",
                "--port=0",
                "--secure-port=0",
                "--v=0",
            ],
        )

    def start_kubelet(self) -> None:
        """Start the fake kubelet (tests/e2e_kubernetes/fake_kubelet.py)."""
        self._spawn(
            "kubelet",
            [
                sys.executable,
                str(HERE / "fake_kubelet.py"),
                "--server",
                self.url,
                "--token",
                ADMIN_TOKEN,
                "--nodes",
                ",".join(NODE_NAMES),
                "--cpu",
                NODE_CPU,
                "--memory",
                NODE_MEMORY,
                "--workdir",
                str(self.workdir / "kubelet"),
            ],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def _bootstrap(self) -> None:
        admin = self.admin
        assert admin is not None
        for manifest in manifests("namespace", "priorityclasses", "serviceaccounts", "rbac"):

            def applied(m: dict[str, Any] = manifest) -> bool:
                admin.apply(m)
                return True

            until(applied, 30, f"apply {manifest['kind']}")
        self.stoker_token = admin.service_account_token("stoker")
        (self.workdir / "kubeconfig-stoker").write_text(
            kubeconfig(self.url, self.stoker_token, "stoker")
        )

    def _nodes_ready(self) -> bool:
        self._alive("kubelet")
        assert self.admin is not None
        nodes = self.admin.request("GET", "/api/v1/nodes").json()["items"]
        ready = [
            node
            for node in nodes
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in node.get("status", {}).get("conditions", [])
            )
        ]
        return len(ready) == len(NODE_NAMES)

    # -- faults and observations ------------------------------------------------------------

    def etcd_compact(self) -> int:
        """Compact etcd to its current revision (through its HTTP gateway); returns it."""
        base = f"http://127.0.0.1:{self.etcd_port}/v3"
        key = base64.b64encode(b"/registry").decode()
        revision = int(
            httpx.post(f"{base}/kv/range", json={"key": key}).json()["header"]["revision"]
        )
        response = httpx.post(
            f"{base}/kv/compaction", json={"revision": revision, "physical": True}, timeout=30
        )
        response.raise_for_status()
        return revision

    def audit_events(self) -> list[AuditEvent]:
        """Every audited write so far (pods and Leases of stoker's namespace)."""
        if not self.audit_log.exists():
            return []
        events = []
        with self.audit_log.open() as lines:
            for line in lines:
                with contextlib.suppress(ValueError):
                    raw = json.loads(line)
                    ref = raw.get("objectRef", {})
                    events.append(
                        AuditEvent(
                            verb=raw["verb"],
                            resource=ref.get("resource", ""),
                            subresource=ref.get("subresource", ""),
                            name=ref.get("name", ""),
                            user=raw.get("user", {}).get("username", ""),
                            status=int(raw.get("responseStatus", {}).get("code", 0)),
                            at=_rfc3339(raw["requestReceivedTimestamp"]),
                            answered=_rfc3339(raw.get("stageTimestamp") or "1970-01-01T00:00:00Z"),
                        )
                    )
        return events


def stoker_user() -> str:
    """The username the API server gives the ServiceAccount `stoker`."""
    return f"system:serviceaccount:{NAMESPACE}:stoker"


def by_stoker(events: Iterable[AuditEvent]) -> list[AuditEvent]:
    """The events of `events` that stoker's ServiceAccount caused."""
    user = stoker_user()
    return [event for event in events if event.user == user]
