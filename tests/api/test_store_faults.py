"""The embedded store failing under a real `stoker serve`: a second server on the same
SQLite file, and the database file deleted while the server runs. Waits are bounded
generously; no test measures a time."""

from __future__ import annotations

import sqlite3
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from servers import (
    DEMO,
    STOKER,
    environment,
    fleet_processes,
    kill_fleet,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.processes

SOON = 30.0


def config(fleet: str) -> str:
    return (
        f"store: sqlite:///./stoker.db\nfleet: {fleet}\napi: {{port: 0}}\n"
        "intervals: {instance_heartbeat_s: 0.2, janitor_interval_s: 0.5}\n"
        f"pools: [{{name: demo, warm_target: 1, command: {DEMO!r}}}]\n"
    )


def test_a_second_server_on_the_same_sqlite_file_refuses_to_start(tmp_path: Path) -> None:
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    srv = start_server(tmp_path, config=config(fleet), args=["--stop-workers"])
    try:
        second = subprocess.run(
            [STOKER, "serve", "-c", "stoker.yaml"],
            cwd=tmp_path,
            env=environment(STOKER_API__PORT="0"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 1
        lines = second.stderr.strip().splitlines()
        assert lines == [
            f"stoker: could not start: another stoker serve (pid {srv.proc.pid}) is using "
            f"{tmp_path / 'stoker.db'}: one server per SQLite file (several replicas share a "
            "PostgreSQL store)"
        ], second.stderr
        # The first one serves on, its worker untouched.
        assert httpx.get(srv.url + "/readyz").status_code == 200
    finally:
        srv.stop()
        kill_fleet(fleet)


def test_a_deleted_database_file_makes_the_server_unready_and_claims_fail_at_once(
    tmp_path: Path,
) -> None:
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    srv = start_server(tmp_path, config=config(fleet), args=["--stop-workers"])
    try:
        assert wait_until(lambda: httpx.get(srv.url + "/readyz").status_code == 200, SOON)
        (tmp_path / "stoker.db").unlink()

        def unready() -> bool:
            answer = httpx.get(srv.url + "/readyz")
            return answer.status_code == 503 and answer.json()["reason"] == "store_unavailable"

        assert wait_until(unready, SOON), srv.log()
        answer = httpx.post(
            srv.url + "/v1/claims", json={"pool": "demo", "org": "acme", "timeout_s": 60}
        )
        assert answer.status_code == 503
        assert answer.headers["Retry-After"] == "5"
        body = answer.json()
        assert body["reason"] == "store_unavailable"
        assert "was deleted while the server ran" in body["detail"]
        # One loud line, not one per failed heartbeat.
        assert srv.log().count("event=store_unavailable") == 1, srv.log()
        assert "Traceback" not in srv.log()
    finally:
        srv.stop()
        kill_fleet(fleet)


def test_a_write_lock_held_by_another_process_never_freezes_the_server(tmp_path: Path) -> None:
    """Another process holds the SQLite write lock past the store's lock wait (5 s):
    `/healthz` answers meanwhile, the server turns unready naming the lock, and a claim
    waiting then gets 503 `store_unavailable` naming it too, not "no worker"; once the lock
    is gone the server is ready and claims bind again."""
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    srv = start_server(tmp_path, config=config(fleet), args=["--stop-workers"])
    try:
        assert wait_until(lambda: httpx.get(srv.url + "/readyz").status_code == 200, SOON)
        holder = sqlite3.connect(tmp_path / "stoker.db", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            with ThreadPoolExecutor(1) as pool:
                body = {"pool": "demo", "org": "acme", "timeout_s": 10}
                waiting = pool.submit(httpx.post, srv.url + "/v1/claims", json=body, timeout=SOON)
                # Well below the lock wait: a loop blocked in SQLite would not answer in time.
                assert httpx.get(srv.url + "/healthz", timeout=4).status_code == 200

                def unready() -> bool:
                    answer = httpx.get(srv.url + "/readyz", timeout=4)
                    return answer.status_code == 503

                assert wait_until(unready, SOON), srv.log()
                ready = httpx.get(srv.url + "/readyz").json()
                assert ready["reason"] == "store_unavailable"
                assert "another process held the write lock" in ready["detail"]
                answer = waiting.result(SOON)
            assert answer.status_code == 503, answer.text
            assert answer.json()["reason"] == "store_unavailable"
            assert "another process held the write lock" in answer.json()["detail"]
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert wait_until(lambda: httpx.get(srv.url + "/readyz").status_code == 200, SOON)
        claimed = httpx.post(srv.url + "/v1/claims", json={"pool": "demo", "org": "acme"})
        assert claimed.status_code == 201, claimed.text
        assert "Traceback" not in srv.log()
    finally:
        srv.stop()
        kill_fleet(fleet)


def test_stop_workers_stops_every_worker_while_the_store_is_locked(tmp_path: Path) -> None:
    """SIGTERM with `--stop-workers` while another process holds the SQLite write lock: the
    retirements cannot be written, and still no worker process outlives the server."""
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    srv = start_server(
        tmp_path,
        config=config(fleet).replace("warm_target: 1", "warm_target: 3"),
        args=["--stop-workers"],
    )
    try:
        assert wait_until(lambda: len(fleet_processes(fleet)) >= 3, SOON)
        claimed = httpx.post(srv.url + "/v1/claims", json={"pool": "demo", "org": "acme"})
        assert claimed.status_code == 201, claimed.text
        assert wait_until(lambda: len(fleet_processes(fleet)) >= 4, SOON)
        holder = sqlite3.connect(tmp_path / "stoker.db", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            assert srv.stop(timeout=120) == 0, srv.tail
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert fleet_processes(fleet) == []
        assert srv.log().count("event=leftover_stopped") >= 4, srv.log()
    finally:
        srv.stop()
        kill_fleet(fleet)


def test_a_start_on_a_new_database_keeps_the_workers_it_cannot_see(tmp_path: Path) -> None:
    """The database is lost while workers run, a hot session among them: the next start
    reports each of them (pid and all) and keeps them; only `--stop-stranded` stops them."""
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    try:
        lose_the_database_under_running_workers(tmp_path, fleet)
    finally:
        # Whatever failed, no worker of the test outlives it.
        kill_fleet(fleet)


def lose_the_database_under_running_workers(tmp_path: Path, fleet: str) -> None:
    fast = config(fleet).replace(
        "janitor_interval_s: 0.5}",
        "janitor_interval_s: 0.5, stranded_grace_s: 0, stranded_scan_s: 0.2}",
    )
    first = start_server(tmp_path, config=fast.replace("warm_target: 1", "warm_target: 2"))
    try:
        assert wait_until(lambda: len(fleet_processes(fleet)) == 2, SOON)
        claimed = httpx.post(first.url + "/v1/claims", json={"pool": "demo", "org": "acme"})
        assert claimed.status_code == 201, claimed.text
        assert wait_until(lambda: len(fleet_processes(fleet)) >= 3, SOON)
    finally:
        assert first.stop() == 0
    # The hot one, and the warm ones (refilled after the claim, perhaps more).
    old = {p.pid for p in fleet_processes(fleet)}
    assert len(old) >= 3
    for name in ("stoker.db", "stoker.db-wal", "stoker.db-shm"):
        (tmp_path / name).unlink(missing_ok=True)
    second = start_server(tmp_path, config=fast.replace("warm_target: 1", "warm_target: 0"))
    try:

        def all_reported() -> bool:
            return second.log().count("event=stranded_unseen") == len(old)

        assert wait_until(all_reported, SOON), second.log()
        for pid in old:
            assert f"pid={pid} " in second.log()
        assert 'action="keep (stoker serve --stop-stranded)"' in second.log()
        # The pass that reported them would have stopped them: they run on.
        assert {p.pid for p in fleet_processes(fleet)} == old
        assert "event=stranded_stopped" not in second.log()
    finally:
        assert second.stop() == 0
    assert {p.pid for p in fleet_processes(fleet)} == old
    third = start_server(
        tmp_path,
        config=fast.replace("warm_target: 1", "warm_target: 0"),
        args=["--stop-stranded"],
    )
    try:
        assert wait_until(lambda: not fleet_processes(fleet), SOON), third.log()
        assert third.log().count("event=stranded_stopped") == len(old)
    finally:
        third.stop()
