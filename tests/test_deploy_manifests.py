"""The Kubernetes manifests in deploy/kubernetes/: valid objects, consistent, least privilege.

The manifests are a kustomize base and two overlays (`single`, `ha`); every test reads
what `kubectl kustomize` renders for an overlay, as `kubectl apply -k` would apply it.
Without kubectl these tests are skipped, except under CI=true, where a missing kubectl
fails them.

No Kubernetes cluster can run where these tests run, so the rendered objects are
validated against the API's own JSON schema (kubernetes-validate, strict: unknown fields
are errors), and the Role is checked against the calls the code makes: derived from the
source of the runtime and the elector, and recorded while they run against the fake
cluster. A Role that grants a verb nobody calls, or misses one that is called, fails here
instead of in production.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import json
import pkgutil
import sys
from collections import Counter
from collections.abc import AsyncGenerator, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

import stoker.adapters.elector_k8s as elector_k8s
import stoker.adapters.runtime_kubernetes as runtime_kubernetes
from fakes import TEST_ACTIVATION_KEY
from kustomize import OVERLAYS, ROOT, documents, kubectl, one, stoker_yaml
from stoker.adapters.elector_k8s import KubernetesLeaseElector
from stoker.adapters.runtime_kubernetes import KubernetesRuntime
from stoker.domain.records import Worker
from stoker.domain.specs import PodTemplate, PoolSpec
from stoker.domain.states import WorkerState
from stoker.ports.clock import LoopClock
from stoker.ports.cluster import ClusterAPI, Lease, Pod, PodList, PodPhase, Selector, WatchEvent
from stoker.sim.cluster import FakeApiServer

KUBERNETES_VERSION = "1.37"
#: Custom resources of the Prometheus Operator: not in the Kubernetes schema
#: (tests/test_deploy_monitoring.py checks them).
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule"}

#: How each ClusterAPI operation reaches the API server (see cluster_lightkube): the
#: (API group, resource, verb) that RBAC must allow for it.
RBAC_OF: dict[str, tuple[str, str, str]] = {
    "create_pod": ("", "pods", "create"),
    "delete_pod": ("", "pods", "delete"),
    "patch_pod": ("", "pods", "patch"),
    "get_pod": ("", "pods", "get"),
    "list_pods": ("", "pods", "list"),
    "watch_pods": ("", "pods", "watch"),
    "get_lease": ("coordination.k8s.io", "leases", "get"),
    "create_lease": ("coordination.k8s.io", "leases", "create"),
    "update_lease": ("coordination.k8s.io", "leases", "update"),
}
Grant = tuple[str, str, str]


def role_grants() -> set[Grant]:
    grants = set()
    for rule in one("Role")["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    grants.add((group, resource, verb))
    return grants


# -- every object is valid -------------------------------------------------------------------


#: What each overlay adds to the base's objects.
BASE_KINDS = {
    "Namespace": 1,
    "PriorityClass": 2,
    "ServiceAccount": 2,
    "Role": 1,
    "RoleBinding": 1,
    "ConfigMap": 2,  # stoker-config, and the Grafana dashboard (components/monitoring)
    "Deployment": 1,
    "Service": 1,
    "PodDisruptionBudget": 1,
    "NetworkPolicy": 1,
    "ServiceMonitor": 1,
    "PrometheusRule": 1,
}
OVERLAY_KINDS = {
    "single": {"PersistentVolumeClaim": 1},
    "ha": {},
}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_holds_every_object_the_deployment_needs(overlay: str) -> None:
    """Namespace, accounts, Role and binding, priority classes, config, Deployment, PDB,
    Service, NetworkPolicy, monitoring (and the overlay's own): each once, all in one namespace
    (PriorityClasses are cluster-scoped)."""
    kinds = Counter(doc["kind"] for doc in documents(overlay))
    assert kinds == Counter(BASE_KINDS) + Counter(OVERLAY_KINDS[overlay])
    namespace = one("Namespace", overlay=overlay)["metadata"]["name"]
    for doc in documents(overlay):
        if doc["kind"] not in ("Namespace", "PriorityClass"):
            assert doc["metadata"]["namespace"] == namespace, doc["metadata"]["name"]
    # `kubectl apply -k` creates the namespace before what lives in it.
    assert documents(overlay)[0]["kind"] == "Namespace"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_object_is_valid_against_the_kubernetes_schema(overlay: str) -> None:
    """Strict validation: a misspelt or misplaced field is an error, not silently dropped
    (the Prometheus Operator's custom resources are checked by their own tests)."""
    for document in documents(overlay):
        if document["kind"] in CUSTOM_KINDS:
            continue
        name = f"{document['kind']}/{document['metadata']['name']}"
        try:
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{overlay}: {name}: {exc}")


def test_an_invalid_object_is_caught() -> None:
    """The validator does reject what the API server would (a test that can fail)."""
    broken = one("Deployment")
    broken = {**broken, "spec": {**broken["spec"], "replica": 3}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_a_missing_kubectl_skips_only_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without kubectl on PATH the rendering tests skip with the reason, and fail under
    CI=true (CI must have kubectl)."""
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="kubectl is not installed"):
        kubectl()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="kubectl is not installed"):
        kubectl()


def test_the_overlays_differ_only_where_they_mean_to() -> None:
    """Every object but the Deployment (and the single overlay's volume claim) renders the
    same in both overlays: the base is shared, not copied."""

    def keyed(overlay: str) -> dict[str, dict[str, Any]]:
        return {f"{d['kind']}/{d['metadata']['name']}": d for d in documents(overlay)}

    single, ha = keyed("single"), keyed("ha")
    assert set(single) - set(ha) == {"PersistentVolumeClaim/stoker-data"}
    assert set(ha) <= set(single)
    differing = {key for key in ha if ha[key] != single[key]}
    assert differing == {"Deployment/stoker"}


# -- the Role grants exactly what the code calls ---------------------------------------------


def port_operations() -> set[str]:
    """The ClusterAPI port's request-making operations."""
    members = {
        name
        for name, member in inspect.getmembers(ClusterAPI)
        if not name.startswith("_") and callable(member)
    }
    return members - {"close"}


def with_submodules(module: Any) -> list[Any]:
    """`module` and, for a package, every module inside it."""
    if not hasattr(module, "__path__"):
        return [module]
    prefix = module.__name__ + "."
    inside = [
        importlib.import_module(m.name) for m in pkgutil.iter_modules(module.__path__, prefix)
    ]
    return [module, *inside]


def called_operations(*modules: Any) -> set[str]:
    """ClusterAPI operations called anywhere in the source of `modules` and the modules of
    packages among them (`x.create_pod(...)`)."""
    operations = port_operations()
    called = set()
    for module in (m for given in modules for m in with_submodules(given)):
        tree = ast.parse(inspect.getsource(module))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in operations
            ):
                called.add(node.func.attr)
    return called


def test_every_port_operation_has_its_rbac_verb() -> None:
    """A new ClusterAPI operation must say which verb it needs before it can be used."""
    assert set(RBAC_OF) == port_operations()


def test_the_role_grants_exactly_the_verbs_the_code_calls() -> None:
    """Derived from the source of the runtime and the elector: no more, no less."""
    called = called_operations(runtime_kubernetes, elector_k8s)
    assert role_grants() == {RBAC_OF[operation] for operation in called}


class RecordingCluster:
    """The fake cluster, recording which port operations are called."""

    def __init__(self, server: FakeApiServer) -> None:
        self.server = server
        self.called: set[str] = set()

    @property
    def namespace(self) -> str:
        return self.server.namespace

    async def create_pod(self, pod: Pod) -> Pod:
        self.called.add("create_pod")
        return await self.server.create_pod(pod)

    async def delete_pod(self, name: str, grace_s: float | None = None) -> None:
        self.called.add("delete_pod")
        await self.server.delete_pod(name, grace_s)

    async def patch_pod(
        self,
        name: str,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> Pod:
        self.called.add("patch_pod")
        return await self.server.patch_pod(name, labels, annotations)

    async def get_pod(self, name: str) -> Pod | None:
        self.called.add("get_pod")
        return await self.server.get_pod(name)

    async def list_pods(self, selector: Selector) -> PodList:
        self.called.add("list_pods")
        return await self.server.list_pods(selector)

    def watch_pods(
        self, selector: Selector, resource_version: str
    ) -> AsyncGenerator[WatchEvent, None]:
        self.called.add("watch_pods")
        return self.server.watch_pods(selector, resource_version)

    async def get_lease(self, name: str) -> Lease | None:
        self.called.add("get_lease")
        return await self.server.get_lease(name)

    async def create_lease(self, lease: Lease) -> Lease:
        self.called.add("create_lease")
        return await self.server.create_lease(lease)

    async def update_lease(self, lease: Lease) -> Lease:
        self.called.add("update_lease")
        return await self.server.update_lease(lease)

    async def close(self) -> None:
        await self.server.close()


@pytest.mark.looptime
async def test_everything_the_runtime_and_elector_do_is_granted() -> None:
    """Run every path (spawn and its retry, busy, adopt, stop, headroom, informer, elect,
    renew, resign) against the fake cluster: each call made is granted by the Role, and
    every grant is used."""
    clock = LoopClock(epoch=1_700_000_000.0)
    server = FakeApiServer(clock=clock, namespace="stoker")
    cluster = RecordingCluster(server)
    template = PodTemplate(image="worker:1", cpu="1", memory="1Gi")
    pool = PoolSpec(name="duck", template=template, headroom_nodes=1)

    runtime = KubernetesRuntime(
        cluster=cluster,
        clock=clock,
        fleet="stoker",
        instance_id="cp-new",
        activation_key=TEST_ACTIVATION_KEY,
        placeholder_priority_class="stoker-placeholder",
    )
    elector = KubernetesLeaseElector(cluster=cluster, clock=clock, identity="cp-new")
    worker = Worker(
        id="w-1",
        pool="duck",
        revision=pool.revision,
        state=WorkerState.SPAWNING,
        epoch=0,
        owner="cp-old",
        created_at=0.0,
        updated_at=0.0,
    )
    await runtime.start()
    electing = asyncio.create_task(elector.run())
    try:
        await runtime.spawn(worker, pool)
        await runtime.spawn(worker, pool)  # a retried create meets its own pod
        server.set_pod_status(
            "w-1", node_name="n", phase=PodPhase.RUNNING, ready=True, pod_ip="10.0.0.1"
        )
        await asyncio.sleep(3)  # elected, and renewed once
        assert await runtime.adopt(worker)
        await runtime.set_busy(worker, True)
        await runtime.reconcile_headroom([pool])
        await runtime.stop(worker, 0)
        await elector.resign()
    finally:
        electing.cancel()
        await asyncio.gather(electing, return_exceptions=True)
        await runtime.close()
        await server.close()
    called = {RBAC_OF[operation] for operation in cluster.called}
    assert called == role_grants()


# -- the objects fit together ----------------------------------------------------------------


def test_the_role_is_bound_to_the_control_planes_account() -> None:
    """The binding names the Role and the account the Deployment runs as."""
    binding = one("RoleBinding")
    deployment = one("Deployment")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": one("Role")["metadata"]["name"],
    }
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account,
            "namespace": deployment["metadata"]["namespace"],
        }
    ]
    one("ServiceAccount", account)


def container(overlay: str) -> dict[str, Any]:
    """The Deployment's one container."""
    (only,) = one("Deployment", overlay=overlay)["spec"]["template"]["spec"]["containers"]
    found: dict[str, Any] = only
    return found


def secret_refs(overlay: str) -> dict[str, dict[str, Any]]:
    """Environment variable -> secretKeyRef, for the variables read from a Secret."""
    return {
        env["name"]: env["valueFrom"]["secretKeyRef"]
        for env in container(overlay)["env"]
        if "secretKeyRef" in env.get("valueFrom", {})
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_deployment_is_probed_and_reads_its_secrets_from_the_secret(overlay: str) -> None:
    """Readiness on /readyz and liveness on /healthz of the API port; the tokens and the
    activation key from the Secret, never inline."""
    deployment = one("Deployment", overlay=overlay)
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"] == deployment["spec"]["selector"]["matchLabels"]
    stoker = container(overlay)
    assert stoker["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert stoker["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert [p["name"] for p in stoker["ports"]] == ["http"]
    secrets = secret_refs(overlay)
    assert set(secrets) >= {"STOKER_API__ADMIN_TOKENS", "STOKER_ACTIVATION__KEY"}
    assert not secrets["STOKER_ACTIVATION__KEY"].get("optional", False)
    assert secrets["STOKER_ACTIVATION__KEY"]["key"] == "activation-key"
    assert {ref["name"] for ref in secrets.values()} == {"stoker-secrets"}
    # The server drains claims for 30 s on SIGTERM; the kubelet must wait longer.
    assert pod["spec"]["terminationGracePeriodSeconds"] > 30


def test_ha_runs_three_replicas_on_postgresql_from_the_secret() -> None:
    """Three rolling replicas; the store URL (with its password) only from the Secret."""
    deployment = one("Deployment", overlay="ha")
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert secret_refs("ha")["STOKER_STORE"]["key"] == "store-url"
    assert all("value" not in env for env in container("ha")["env"])


def test_single_runs_one_replica_on_sqlite_on_its_volume_claim() -> None:
    """One replica, recreated (the claim mounts on one node, SQLite has one writer); the
    store is a file on a mounted volume backed by the overlay's PersistentVolumeClaim."""
    deployment = one("Deployment", overlay="single")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    [store] = [env for env in container("single")["env"] if env["name"] == "STOKER_STORE"]
    path = Path(store["value"].removeprefix("sqlite:///"))
    assert store["value"].startswith("sqlite:////") and path.name == "stoker.db"
    mounts = {m["mountPath"]: m["name"] for m in container("single")["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    claim = volumes[mounts[str(path.parent)]]["persistentVolumeClaim"]["claimName"]
    pvc = one("PersistentVolumeClaim", claim, overlay="single")
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    # The non-root user can write there: the volume belongs to its group.
    assert deployment["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 10001


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_image_runs_the_mounted_configuration_as_the_pods_user(overlay: str) -> None:
    """The Dockerfile's entry point (`stoker serve`) with the container's args reads the
    mounted ConfigMap, and the image's user is the one the pod's securityContext names."""
    dockerfile = (ROOT / "Dockerfile").read_text().splitlines()
    [entrypoint] = [
        json.loads(x.split(" ", 1)[1]) for x in dockerfile if x.startswith("ENTRYPOINT")
    ]
    [user] = [x.split()[1] for x in dockerfile if x.startswith("USER ")]
    spec = one("Deployment", overlay=overlay)["spec"]["template"]["spec"]
    stoker = container(overlay)
    assert "command" not in stoker
    argv = [*entrypoint, *stoker["args"]]
    assert argv[:3] == ["stoker", "serve", "--config"]
    config_path = Path(argv[3])
    [mount] = [m for m in stoker["volumeMounts"] if m["mountPath"] == str(config_path.parent)]
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    config_map = one("ConfigMap", "stoker-config", overlay)
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert config_path.name in config_map["data"]
    context = spec["securityContext"]
    assert user == f"{context['runAsUser']}:{context['runAsGroup']}"
    assert context["runAsNonRoot"] is True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_configuration_each_overlay_runs_is_valid(overlay: str, tmp_path: Path) -> None:
    """stoker's own loader accepts the mounted stoker.yaml with the container's
    environment (the Secret's values filled in): a store of the overlay's kind, the
    Kubernetes runtime, the Lease elector, listening on all interfaces with tokens."""
    from stoker.config import KubernetesRuntimeConfig, load_config

    filled = {
        "store-url": "postgresql://stoker:pw@postgres:5432/stoker",
        "admin-tokens": "admin-token-0123456789",
        "activation-key": "k" * 64,
    }
    environ: dict[str, str] = {}
    for env in container(overlay)["env"]:
        if "value" in env:
            environ[env["name"]] = env["value"]
        elif env["valueFrom"]["secretKeyRef"]["key"] in filled:
            environ[env["name"]] = filled[env["valueFrom"]["secretKeyRef"]["key"]]
    path = tmp_path / "stoker.yaml"
    path.write_text(one("ConfigMap", "stoker-config", overlay)["data"]["stoker.yaml"])
    config = load_config(path, environ).config
    assert isinstance(config.runtime, KubernetesRuntimeConfig)
    assert config.is_postgres == (overlay == "ha")
    assert config.elector_kind() == "kubernetes"
    assert config.api.host == "0.0.0.0" and config.api.has_tokens


def test_the_service_and_the_budget_select_the_control_plane() -> None:
    """Service and PodDisruptionBudget select exactly the Deployment's pods."""
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert one("Service")["spec"]["selector"] == labels
    assert one("Service")["spec"]["ports"][0]["targetPort"] == "http"
    budget = one("PodDisruptionBudget")["spec"]
    assert budget["selector"]["matchLabels"] == labels
    assert budget["maxUnavailable"] == 1


def test_placeholders_give_way_to_workers_and_stay_visible_to_the_autoscaler() -> None:
    """worker > 0 > placeholder >= -10 (Cluster Autoscaler's expendable cutoff); a
    placeholder never preempts anything."""
    worker = one("PriorityClass", "stoker-worker")
    placeholder = one("PriorityClass", "stoker-placeholder")
    assert worker["value"] > 0 > placeholder["value"] >= -10
    assert placeholder["preemptionPolicy"] == "Never"
    assert not worker["globalDefault"] and not placeholder["globalDefault"]


def test_the_configuration_refers_to_objects_that_exist() -> None:
    """The config runs on Kubernetes with a Lease elector, and every priority class and
    account it names is one of these manifests; the workers' account has no token."""
    config = stoker_yaml()
    assert config["runtime"]["kind"] == "kubernetes"
    assert config["leader_election"] == "kubernetes"
    assert config["api"]["host"] == "0.0.0.0"
    classes = {doc["metadata"]["name"] for doc in documents() if doc["kind"] == "PriorityClass"}
    assert config["runtime"]["placeholder_priority_class"] in classes
    for pool in config["pools"]:
        assert pool["pod"]["priority_class"] in classes
        account = one("ServiceAccount", pool["pod"]["service_account"])
        assert account["automountServiceAccountToken"] is False
        assert pool["max_workers"] == 0
    budget = config["runtime"]
    assert (config["intervals"]["spawn_rate"], config["intervals"]["spawn_burst"]) == (
        budget["qps"],
        budget["burst"],
    )


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """True when a label selector (matchLabels, matchExpressions) matches `labels`."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        matched = {
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
        }[operator]
        if not matched:
            return False
    return True


def test_only_the_control_plane_and_labelled_clients_reach_the_workers() -> None:
    """The NetworkPolicy selects every worker pod the runtime renders (not placeholders),
    and admits on the pool's port only the control plane's pods and pods labelled as
    worker clients: a neighbour on the pod network cannot reach `/activate`."""
    from stoker.adapters.runtime_kubernetes._pods import placeholder_pods, worker_pod
    from stoker.config import StokerConfig, to_domain

    policy = one("NetworkPolicy")["spec"]
    config = StokerConfig.model_validate(stoker_yaml() | {"store": "postgresql://stoker@db/stoker"})
    (pool,) = to_domain(config).pools
    assert isinstance(pool.template, PodTemplate)
    worker = Worker(
        id="w-1",
        pool=pool.name,
        revision=pool.revision,
        state=WorkerState.SPAWNING,
        epoch=0,
        owner="cp-a",
        created_at=0.0,
        updated_at=0.0,
    )
    pod = worker_pod(
        worker,
        pool,
        pool.template,
        fleet="stoker",
        instance_id="cp-a",
        grace_s=30,
        activation_key=TEST_ACTIVATION_KEY,
    )
    assert _selects(policy["podSelector"], pod.labels)
    placeholders = placeholder_pods(
        pool,
        pool.template,
        fleet="stoker",
        image="pause",
        priority_class=None,
        size=None,
    )
    assert not any(_selects(policy["podSelector"], p.labels) for p in placeholders)
    assert policy["policyTypes"] == ["Ingress"]
    control_plane = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    rules = policy["ingress"]
    for rule in rules:
        # No rule admits everyone: each names who, and only the pool's port.
        assert rule["from"] and [p["port"] for p in rule["ports"]] == [pool.template.port]
        for peer in rule["from"]:
            selector = peer["podSelector"]
            assert selector["matchLabels"] in (control_plane, {"stoker.dev/worker-client": "true"})
    assert any(
        peer["podSelector"]["matchLabels"] == control_plane for r in rules for peer in r["from"]
    )
