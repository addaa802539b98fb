"""`stoker config check --connect`: the store reached with the config's credentials,
changing nothing (a real PostgreSQL server; the Kubernetes half runs against a real API
server in tests/e2e_kubernetes/test_defects.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from stoker.bootstrap import ConnectError, check_connections
from stoker.config import StokerConfig


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
