"""Shared test plumbing: the event loop of sync tests and the PostgreSQL server of the tests
that need one. Fixtures specific to one subsystem live in that subsystem's file."""

from __future__ import annotations

import asyncio
import inspect
import os
import uuid
from collections.abc import AsyncIterator, Generator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from stoker.adapters.postgres import PostgresStore
from stoker.adapters.sqlite import SqliteStore
from stoker.ports.store import Store


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, Any, Any]:
    """Give a sync test an event loop of its own and close it afterwards.

    looptime (0.9) asks the policy for the current loop around every test; for a sync test
    that would create a loop nobody closes, whose socket pair surfaces later as a
    ResourceWarning (an error under `filterwarnings = error`) in an unrelated test.
    """
    # pytest-asyncio wraps coroutine tests and marks them; leave their loops to it.
    if pyfuncitem.get_closest_marker("asyncio") or inspect.iscoroutinefunction(pyfuncitem.obj):
        return (yield)
    policy = asyncio.get_event_loop_policy()
    loop = policy.new_event_loop()
    policy.set_event_loop(loop)
    try:
        return (yield)
    finally:
        policy.set_event_loop(None)
        loop.close()


#: The PostgreSQL tests' server unless STOKER_TEST_POSTGRES_URL says otherwise.
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"


def _where(url: str) -> str:
    """The server a URL points at, without its password."""
    try:
        info = conninfo_to_dict(url)
    except psycopg.Error:
        return "an unparsable STOKER_TEST_POSTGRES_URL"
    host, port, db = info.get("host", "localhost"), info.get("port", 5432), info.get("dbname")
    return f"{host}:{port}/{db}"


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """The test server's URL; skips (or, under CI=true, fails) when it is unreachable."""
    url = os.environ.get("STOKER_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)
    try:
        with psycopg.connect(url, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        reason = (
            f"PostgreSQL is not reachable at {_where(url)} "
            f"(set STOKER_TEST_POSTGRES_URL): {str(exc).strip()}"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason}; with CI=true the PostgreSQL tests must run", pytrace=False)
        pytest.skip(reason)
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[list[Store]]:
    """Two stores on one database, as two replicas hold them (the control plane's tests): a
    SQLite file or a fresh PostgreSQL schema (dropped after), both opened before either
    replica starts (a replica's writes in flight never meet the other store's migration)."""
    schema = f"stoker_test_{uuid.uuid4().hex[:12]}"
    url = ""
    made: list[Store]
    if request.param == "sqlite":
        made = [SqliteStore(str(tmp_path / "stoker.db")) for _ in range(2)]
    else:
        url = request.getfixturevalue("postgres_url")
        made = [PostgresStore(url, schema=schema) for _ in range(2)]
    try:
        for store in made:
            await store.open()
        yield made
    finally:
        for store in made:
            await store.close()
        if url:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
