"""Fixtures of the e2e tier: one Kubernetes control plane for the session, and `stoker
serve` processes pointed at it with the ServiceAccount token of the manifests' Role.

The binaries come from `cluster/build.sh`'s cache; a missing cache is built first. Under
`CI=true` a failed build fails the tier; elsewhere the tier is skipped with the reason.
Every test runs its own fleet (a label of its own), so the fleets of different tests
never see each other's pods; the cluster, its nodes and the fake kubelet are shared.
The helpers the tests import are in e2e_support.py.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from e2e_support import ADMIN, INTERVALS, LEASE, StartStoker, Stoker
from kube_control_plane import ControlPlane, binaries, build, until

from servers import environment, start_server

#: The lines of each server's log a failed test prints (its report shows them).
FAILURE_LOG_LINES = 120
_CALL_REPORT = pytest.StashKey[pytest.TestReport]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each test's call report, so that its fixtures know at teardown whether it failed."""
    report = yield
    if report.when == "call":
        item.stash[_CALL_REPORT] = report
    return report


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


@pytest.fixture
def fleet() -> str:
    """A fleet label of this test's own."""
    return f"e2e-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def start_stoker(
    kube: ControlPlane, fleet: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[StartStoker]:
    """Starts `stoker serve` processes of `fleet` (all stopped, and the fleet's pods
    deleted, at the end of the test). After a failed test each server's last log lines are
    printed, so that the failure's report shows what stoker did."""
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
    report = request.node.stash.get(_CALL_REPORT, None)
    failed = report is not None and report.failed
    for stoker in started:
        if stoker.server.proc.poll() is None:
            stoker.stop(timeout=30)
        if failed:
            tail = "\n".join(stoker.log().splitlines()[-FAILURE_LOG_LINES:])
            print(f"--- stoker {stoker.server.workdir.name}: its last log lines\n{tail}")
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
