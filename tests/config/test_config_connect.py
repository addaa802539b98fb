"""`stoker config check --connect`: the store reached with the config's credentials,
changing nothing (a real PostgreSQL server; the Kubernetes half runs against a real API
server in tests/e2e_kubernetes/test_credentials.py and test_admission.py; here its
worker-pod dry run meets a fake API server)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from stoker.bootstrap import ConnectError, check_connections
from stoker.config import StokerConfig
from stoker.domain.activation import ActivationKey
from stoker.ports.cluster import Forbidden, Invalid
from stoker.worker import SECRET_ENV


def config(store: str, **kw: object) -> StokerConfig:
    return StokerConfig.model_validate({"store": store, "activation": {"key": "k" * 40}, **kw})


def test_a_sqlite_file_in_a_folder_that_exists_is_fine_and_is_not_made(tmp_path: Path) -> None:
    [line] = asyncio.run(check_connections(config(f"sqlite:///{tmp_path}/s.db")))
    assert line == f"store: SQLite file {tmp_path}/s.db (is created at the first serve)"
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConnectError, match=r"^connect error: store: the SQLite file's folder"):
        asyncio.run(check_connections(config(f"sqlite:///{tmp_path}/missing/s.db")))


@pytest.mark.postgres
async def test_postgres_is_reached_and_its_schema_left_alone(postgres_url: str) -> None:
    schema = f"connect_{uuid.uuid4().hex[:8]}"
    [line] = await check_connections(config(postgres_url, store_options={"schema": schema}))
    assert line.startswith("store: PostgreSQL ") and f"schema {schema!r} is created" in line
    with psycopg.connect(postgres_url) as conn:
        found = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,))
        assert found.fetchone() is None


@pytest.fixture
def bare_role(postgres_url: str) -> Iterator[str]:
    """A URL of the test server for a role that may log in and do nothing else."""
    role = f"connect_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        yield make_conninfo("", **{**conninfo_to_dict(postgres_url), "user": role})
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f'DROP ROLE "{role}"')


@pytest.mark.postgres
async def test_postgres_that_refuses_or_lacks_privileges_is_named(
    postgres_url: str, bare_role: str
) -> None:
    info = conninfo_to_dict(bare_role)
    url = f"postgresql://{info['user']}@{info.get('host', '127.0.0.1')}:{info.get('port', 5432)}"
    with pytest.raises(ConnectError) as lacking:
        await check_connections(config(f"{url}/{info['dbname']}"))
    assert str(lacking.value).startswith("connect error: store_options.schema: PostgreSQL user")
    assert "lacks CREATE on the database" in str(lacking.value)
    with pytest.raises(ConnectError, match=r"^connect error: store: cannot connect to PostgreSQL"):
        await check_connections(config(f"{url}/no_such_database_here"))


def test_the_command_says_what_answered_on_stderr_and_exits_1_on_what_did_not(
    tmp_path: Path,
) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(f"store: sqlite:///{tmp_path}/s.db\n")
    bad.write_text(f"store: sqlite:///{tmp_path}/missing/s.db\n")
    stoker = [sys.executable, "-m", "stoker"]
    fine = subprocess.run(
        [*stoker, "config", "check", "-c", str(good), "--connect"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert fine.returncode == 0 and fine.stdout.startswith("# effective config")
    assert (
        fine.stderr
        == f"connected: store: SQLite file {tmp_path}/s.db (is created at the first serve)\n"
    )
    refused = subprocess.run(
        [*stoker, "config", "check", "-c", str(bad), "--connect"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.startswith("connect error: store: the SQLite file's folder")
    assert "Traceback" not in refused.stderr


class _AdmittingCluster:
    """The API server as `--connect` asks it: every access granted; `refusals` maps a
    pool (or "<pool> placeholder") to the error its pod's dry run meets."""

    namespace = "workers"

    def __init__(self, refusals: dict[str, Exception]) -> None:
        self.refusals = refusals
        self.admitted: list[Any] = []

    async def denied(self, wanted: object) -> list[object]:
        return []

    async def admit_pod(self, pod: Any) -> None:
        self.admitted.append(pod)
        placeholder = pod.labels.get("stoker.dev/placeholder")
        refusal = self.refusals.get(
            f"{placeholder} placeholder" if placeholder else pod.labels["stoker.dev/pool"]
        )
        if refusal is not None:
            raise refusal

    async def close(self) -> None:
        pass


def kubernetes_config(tmp_path: Path, *pools: str, headroom: int = 0) -> StokerConfig:
    pod = {"image": "registry.example/worker:1", "env": {"API_PASSWORD": "hunter2-secret"}}
    return config(
        f"sqlite:///{tmp_path}/s.db",
        runtime={
            "kind": "kubernetes",
            "namespace": "workers",
            "placeholder_priority_class": "stoker-placeholder",
            "placeholder_size": {"cpu": "3", "memory": "4Gi"},
        },
        pools=[{"name": name, "pod": pod, "headroom_nodes": headroom} for name in pools],
    )


def test_each_pools_worker_pod_is_admitted_by_the_api_server_in_a_dry_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = _AdmittingCluster(
        {"b": Forbidden('create pod stoker-config-check: pods "x" is forbidden: exceeded quota: q')}
    )
    monkeypatch.setattr("stoker.bootstrap.build_cluster", lambda *a, **kw: cluster)
    lines = asyncio.run(check_connections(kubernetes_config(tmp_path, "a", "b")))
    assert lines[2:] == [
        "runtime: pool 'a': the API server admits its worker pod (dry run)",
        "runtime: pool 'b': the API server admits its worker pod, but the namespace's quota "
        """has no room for one now (pods "x" is forbidden: exceeded quota: q)""",
    ]
    # The pod the runtime would create, for a made-up worker with a made-up secret.
    first = cluster.admitted[0]
    env = first.spec.containers[0].env
    assert env["API_PASSWORD"] == "hunter2-secret"
    assert env["STOKER_WORKER_ID"] == first.name == "stoker-config-check"
    assert env[SECRET_ENV] == ActivationKey(bytes(32)).worker_secret(first.name)


def test_a_worker_pod_the_api_server_refuses_names_its_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusal = Invalid(
        'create pod stoker-config-check: Pod "x" is invalid: spec.containers[0].image: '
        'Invalid value: "w:1 ": must not have leading or trailing whitespace '
        "(a webhook quoting API_PASSWORD=hunter2-secret)"
    )
    cluster = _AdmittingCluster({"b": refusal})
    monkeypatch.setattr("stoker.bootstrap.build_cluster", lambda *a, **kw: cluster)
    with pytest.raises(ConnectError) as caught:
        asyncio.run(check_connections(kubernetes_config(tmp_path, "a", "b")))
    assert str(caught.value) == (
        "connect error: pools[1].pod: the API server refuses the worker pod of pool 'b': "
        'Pod "x" is invalid: spec.containers[0].image: Invalid value: "w:1 ": '
        "must not have leading or trailing whitespace (a webhook quoting API_PASSWORD=***)"
    )
    refused = Forbidden('create pod stoker-config-check: pods "x" is forbidden: no PriorityClass')
    cluster.refusals = {"a": refused}
    with pytest.raises(ConnectError, match=r"^connect error: pools\[0\]\.pod: .*no PriorityClass"):
        asyncio.run(check_connections(kubernetes_config(tmp_path, "a", "b")))


def test_a_pools_headroom_placeholder_is_admitted_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = _AdmittingCluster({})
    monkeypatch.setattr("stoker.bootstrap.build_cluster", lambda *a, **kw: cluster)
    lines = asyncio.run(check_connections(kubernetes_config(tmp_path, "a", headroom=2)))
    assert lines[2:] == [
        "runtime: pool 'a': the API server admits its worker pod (dry run)",
        "runtime: pool 'a': the API server admits its headroom placeholder (dry run)",
    ]
    # One placeholder, as the runtime makes them.
    _worker, placeholder = cluster.admitted
    assert placeholder.name.startswith("headroom-a-")
    assert placeholder.spec.priority_class_name == "stoker-placeholder"
    assert placeholder.spec.containers[0].cpu == "3"

    refused = Forbidden(
        'pods "headroom-a" is forbidden: no PriorityClass with name stoker-placeholder was found'
    )
    cluster.refusals = {"a placeholder": refused}
    with pytest.raises(ConnectError) as caught:
        asyncio.run(check_connections(kubernetes_config(tmp_path, "a", headroom=2)))
    assert str(caught.value) == (
        "connect error: pools[0].headroom_nodes: the API server refuses the headroom "
        "placeholder of pool 'a': pods \"headroom-a\" is forbidden: no PriorityClass with "
        "name stoker-placeholder was found"
    )
