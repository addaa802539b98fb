"""`stoker config check --connect` against the real API server and its RBAC: the
manifests' Role grants what stoker needs; a ServiceAccount that may only read pods is
told, verb by verb, what it lacks; a token the server does not know is refused. The API
server itself answers the access reviews (nothing is faked here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from e2e_support import pool
from kube_control_plane import NAMESPACE, ControlPlane, kubeconfig

pytestmark = [pytest.mark.e2e_kubernetes, pytest.mark.timeout(120)]


def check(
    kube: ControlPlane, tmp_path: Path, kubeconfig_file: Path, election: str
) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "stoker.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "store": f"sqlite:///{tmp_path / 'stoker.db'}",
                "runtime": {
                    "kind": "kubernetes",
                    "namespace": NAMESPACE,
                    "kubeconfig": str(kubeconfig_file),
                },
                "leader_election": {"kind": election},
                "activation": {"key_file": str(tmp_path / "activation.key")},
                "pools": [pool(kube)],
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


def test_the_manifests_role_grants_what_stoker_needs(kube: ControlPlane, tmp_path: Path) -> None:
    done = check(kube, tmp_path, kube.workdir / "kubeconfig-stoker", "kubernetes")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-2:] == [
        f"connected: runtime: Kubernetes namespace '{NAMESPACE}': "
        "may do what stoker does to leases and pods",
        "connected: runtime: pool 'duck': the API server admits its worker pod (dry run)",
    ]


def test_a_service_account_that_only_reads_pods_is_told_what_it_lacks(
    kube: ControlPlane, tmp_path: Path
) -> None:
    admin = kube.admin
    assert admin is not None
    meta = {"name": "pod-reader", "namespace": NAMESPACE}
    admin.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta})
    rbac = "rbac.authorization.k8s.io/v1"
    admin.apply(
        {
            "apiVersion": rbac,
            "kind": "Role",
            "metadata": meta,
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
            ],
        }
    )
    admin.apply(
        {
            "apiVersion": rbac,
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "pod-reader",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "pod-reader", "namespace": NAMESPACE}],
        }
    )
    token = admin.service_account_token("pod-reader")
    file = tmp_path / "kubeconfig"
    file.write_text(kubeconfig(kube.url, token, "pod-reader"))
    done = check(kube, tmp_path, file, "kubernetes")
    assert done.returncode == 1 and done.stdout == ""
    [line] = [x for x in done.stderr.splitlines() if x.startswith("connect error:")]
    assert line.startswith(
        "connect error: runtime.namespace: these credentials may not create pods, delete pods, "
        "patch pods, create leases, get leases, update leases in namespace 'stoker'"
    ), line
    # Without the Lease election, the leases are not needed: only the pods' verbs.
    without = check(kube, tmp_path, file, "store")
    assert "create leases" not in without.stderr and "create pods" in without.stderr
    assert token not in done.stderr + without.stderr


def test_a_token_the_server_does_not_know_is_refused(kube: ControlPlane, tmp_path: Path) -> None:
    file = tmp_path / "kubeconfig"
    file.write_text(kubeconfig(kube.url, "no-such-token-0123456789", "nobody"))
    done = check(kube, tmp_path, file, "kubernetes")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("connect error: runtime.kubeconfig: the Kubernetes API did not answer")
    assert "no-such-token" not in line
