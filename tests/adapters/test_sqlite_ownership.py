"""One server per SQLite file, and a database file deleted or replaced under a running
store: both noticed, each with one clear message."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stoker.adapters.sqlite import SqliteStore
from stoker.adapters.sqlite.ownership import FileIdentity, hold
from stoker.domain.errors import StoreError


def test_a_second_holder_of_a_file_is_refused_with_the_first_ones_pid(tmp_path: Path) -> None:
    path = str(tmp_path / "stoker.db")
    first = hold(path)
    try:
        with pytest.raises(StoreError, match=rf"another stoker serve \(pid {os.getpid()}\)"):
            hold(path)
        assert oct(os.stat(f"{path}.lock").st_mode & 0o777) == oct(0o600)
    finally:
        first.close()
    # Released with its holder: the next one gets it.
    hold(path).close()


def test_a_lock_file_that_cannot_be_created_is_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r"cannot open sqlite store .*: its lock file"):
        hold(str(tmp_path / "missing" / "stoker.db"))


def test_the_identity_of_a_deleted_or_replaced_file_no_longer_holds(tmp_path: Path) -> None:
    path = tmp_path / "stoker.db"
    path.write_text("x")
    identity = FileIdentity.of(str(path))
    identity.check()
    replacement = tmp_path / "other.db"
    replacement.write_text("y")
    os.replace(replacement, path)
    with pytest.raises(StoreError, match="was replaced"):
        identity.check()
    path.unlink()
    with pytest.raises(StoreError, match="was deleted"):
        identity.check()


async def test_a_heartbeat_finds_the_database_file_deleted(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "stoker.db"))
    await store.open()
    try:
        await store.register_instance("cp-a", now=1.0, meta={})
        assert await store.heartbeat_instance("cp-a", now=2.0)
        (tmp_path / "stoker.db").unlink()
        with pytest.raises(StoreError, match="was deleted while the server ran"):
            await store.heartbeat_instance("cp-a", now=3.0)
    finally:
        await store.close()
