"""The `stoker` command as a user runs it: real processes, a real server, real workers.

Client commands print JSON or a table; every failure is one line on stderr with a non-zero
status and no traceback; `serve` refuses what it must refuse, and SIGTERM shuts it down
gracefully, leaving workers for the next start to adopt (or stopping them when asked).
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from servers import (
    DEMO,
    STOKER,
    Server,
    environment,
    fleet_processes,
    kill_fleet,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.processes


def run(
    args: Sequence[str], *, url: str | None = None, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run `stoker ARGS` and return what it did."""
    extra = {"STOKER_URL": url} if url else {}
    return subprocess.run(
        [STOKER, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment(**extra, **env),
        stdin=subprocess.DEVNULL,
        check=False,
    )


def one_line_error(result: subprocess.CompletedProcess[str], status: int) -> str:
    """Assert a failure of exactly one stderr line and no traceback; returns the line."""
    assert result.returncode == status, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert lines[0].startswith("stoker: ")
    return lines[0]


def config(fleet: str, **pool: object) -> str:
    settings = {"name": "demo", "command": DEMO, "warm_target": 1, **pool}
    return (
        f"store: sqlite:///./stoker.db\nfleet: {fleet}\napi: {{port: 0}}\n"
        "intervals: {janitor_interval_s: 0.2, shutdown_grace_s: 5}\n"
        f"pools:\n  - {json.dumps(settings)}\n"
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    srv = start_server(
        tmp_path_factory.mktemp("cli"), config=config(fleet), args=["--stop-workers"]
    )
    try:
        yield srv
    finally:
        srv.stop()
        kill_fleet(fleet)


def test_claim_prints_json_and_release_frees_it(server: Server) -> None:
    claimed = run(
        ["claim", "--pool", "demo", "--org", "acme", "--config", "role=ro", "--config", "n=3"],
        url=server.url,
    )
    assert claimed.returncode == 0, claimed.stderr
    claim = json.loads(claimed.stdout)
    assert claim["state"] == "bound" and claim["org"] == "acme"
    answer = httpx.get(
        claim["worker"]["endpoint"] + "/",
        headers={"Authorization": f"Bearer {claim['worker']['token']}"},
        timeout=5,
    )
    assert answer.json()["config_keys"] == ["n", "role"]
    released = run(["release", claim["id"]], url=server.url)
    assert released.returncode == 0, released.stderr
    assert json.loads(released.stdout)["state"] == "released"


def test_claim_options(server: Server) -> None:
    claimed = run(
        [
            "claim",
            "-p",
            "demo",
            "-o",
            "globex",
            "--mode",
            "cold",
            "--timeout",
            "30",
            "--lease",
            "5",
        ],
        url=server.url,
    )
    assert claimed.returncode == 0, claimed.stderr
    claim = json.loads(claimed.stdout)
    assert claim["source"] == "cold" and claim["mode"] == "cold" and claim["lease_s"] == 5
    assert run(["release", claim["id"]], url=server.url).returncode == 0


def test_status_shows_pools_by_state(server: Server) -> None:
    assert wait_until(lambda: " demo " in run(["status"], url=server.url).stdout, timeout=10)
    result = run(["status"], url=server.url)
    assert result.returncode == 0, result.stderr
    header = next(line for line in result.stdout.splitlines() if "pool" in line)
    for column in ("target", "desired", "demand", "cap", "warm", "hot", "hot_idle"):
        assert column in header
    row = next(line for line in result.stdout.splitlines() if " demo " in line)
    assert row.split("│")[2].strip() == "1"


def test_status_watch_refreshes_until_interrupted(server: Server) -> None:
    proc = subprocess.Popen(
        [STOKER, "status", "--watch", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment(STOKER_URL=server.url),
    )
    time.sleep(1.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert out.count("demo") >= 2, out
    assert "Traceback" not in err


def test_version() -> None:
    result = run(["version"])
    assert result.returncode == 0 and result.stdout.strip() == "stoker 0.1.0"


def test_an_unreachable_server_is_one_line() -> None:
    for args in (["status"], ["claim", "-p", "demo", "-o", "acme"], ["release", "c-1"]):
        line = one_line_error(run(args, url="http://127.0.0.1:9"), 1)
        assert "cannot reach stoker at http://127.0.0.1:9" in line


def test_server_side_errors_are_one_line(server: Server) -> None:
    assert "unknown pool 'nope'" in one_line_error(
        run(["claim", "-p", "nope", "-o", "acme"], url=server.url), 1
    )
    assert "unknown claim" in one_line_error(run(["release", "c-missing"], url=server.url), 1)
    invalid = one_line_error(run(["claim", "-p", "demo", "-o", " padded "], url=server.url), 1)
    assert "422" in invalid and "org" in invalid


@pytest.mark.parametrize(
    "args",
    [
        ["claim", "--pool", "demo"],
        ["claim", "--pool", "demo", "--org", "acme", "--timeout", "-1"],
        ["claim", "--pool", "demo", "--org", "acme", "--mode", "hot"],
        ["claim", "--pool", "demo", "--org", "acme", "--config", "no-equals-sign"],
        ["claim", "--pool", "demo", "--org", "acme", "--lease", "0"],
        ["release"],
        ["status", "--interval", "fast"],
        ["frobnicate"],
        ["serve", "--no-such-flag"],
    ],
)
def test_bad_arguments_are_one_line_and_status_2(args: list[str]) -> None:
    one_line_error(run(args, url="http://127.0.0.1:9"), 2)


def test_serve_rejects_a_bad_config_naming_the_key(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(
        "api: {prot: 80}\npools:\n  - {name: p, command: [x], warm_target: -1}\n"
    )
    result = run(["serve", "-c", str(tmp_path / "bad.yaml")])
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert "config error: api.prot: unknown key" in lines
    assert "config error: pools[0].warm_target: must be >= 0" in lines
    assert "Traceback" not in result.stderr
    missing = run(["serve", "-c", str(tmp_path / "missing.yaml")])
    assert missing.returncode != 0 and "Traceback" not in missing.stderr


def test_serve_announces_its_runtime_and_elector(server: Server) -> None:
    line = server.lines[-1]
    assert "store: sqlite:///./stoker.db; runtime: local; leader election: none;" in line


def test_serve_names_the_key_when_kubernetes_credentials_do_not_load(tmp_path: Path) -> None:
    (tmp_path / "k8s.yaml").write_text(
        f"runtime: {{kind: kubernetes, kubeconfig: {tmp_path}/missing}}\n"
        "api: {port: 0}\npools:\n  - {name: db, pod: {image: 'worker:1'}}\n"
    )
    result = run(["serve", "-c", str(tmp_path / "k8s.yaml")])
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("config error: runtime.kubeconfig: cannot load the Kubernetes")
    assert f"{tmp_path}/missing" in line
    assert "listening" not in result.stdout


def test_serve_refuses_a_public_address_without_tokens(tmp_path: Path) -> None:
    result = subprocess.run(
        [STOKER, "serve"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=environment(STOKER_API__HOST="0.0.0.0", STOKER_API__PORT="0"),
        check=False,
    )
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("config error: api.host: '0.0.0.0' is reachable from other machines")
    assert "no tokens are configured" in line
    assert not (tmp_path / "stoker.db").exists()


def test_serve_on_a_port_in_use_is_one_line(server: Server, tmp_path: Path) -> None:
    port = server.url.rsplit(":", 1)[1]
    result = subprocess.run(
        [STOKER, "serve"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=environment(STOKER_API__PORT=port),
        check=False,
    )
    line = one_line_error(result, 1)
    assert f"cannot listen on 127.0.0.1:{port}" in line


@pytest.mark.parametrize(
    ("key", "says"),
    [
        # The default key file goes next to the database: its directory is missing first.
        (None, "config error: store: the activation key next to the SQLite file: cannot create"),
        ("k" * 40, "stoker: could not start: cannot open sqlite store"),
    ],
)
def test_serve_with_a_store_it_cannot_open_says_why(
    tmp_path: Path, key: str | None, says: str
) -> None:
    env = environment(STOKER_API__PORT="0", STOKER_STORE="sqlite:///./no/such/dir/s.db")
    if key is not None:
        env["STOKER_ACTIVATION__KEY"] = key
    result = subprocess.run(
        [STOKER, "serve"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 1
    assert says in result.stderr and "no/such/dir" in result.stderr
    assert "Traceback" not in result.stderr


def settled(url: str, fleet: str) -> bool:
    """Nothing spawning, the pool at its desired warm count, one process per live worker."""
    pool: dict[str, Any] = httpx.get(f"{url}/v1/pools/demo", timeout=5).json()
    counts = pool["counts"]
    return bool(
        counts["spawning"] == 0
        and counts["warm"] >= pool["desired_warm"]
        and len(fleet_processes(fleet)) == sum(counts.values())
    )


def test_sigterm_drains_and_leaves_workers_for_the_next_start(tmp_path: Path) -> None:
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    try:
        first = start_server(tmp_path, config=config(fleet, warm_target=2))
        claimed = json.loads(run(["claim", "-p", "demo", "-o", "acme"], url=first.url).stdout)
        # Wait for the pool to settle (the claim makes the janitor spawn a replacement),
        # so that the workers counted here are all the workers there will be.
        assert wait_until(lambda: settled(first.url, fleet), timeout=15)
        workers = {p.pid for p in fleet_processes(fleet)}
        assert len(workers) >= 2
        assert first.stop(signal.SIGTERM) == 0
        assert "stoker stopped" in first.tail
        assert "event=control_plane_stopped" in first.log()
        # The workers outlive the server ...
        assert {p.pid for p in fleet_processes(fleet)} == workers

        # ... and the next start adopts them: the session's worker is still bound to it.
        second = start_server(
            tmp_path, config=config(fleet, warm_target=2), args=["--stop-workers"]
        )
        held = json.loads(run(["release", claimed["id"]], url=second.url).stdout)
        assert held["state"] == "released"
        again = json.loads(run(["claim", "-p", "demo", "-o", "acme"], url=second.url).stdout)
        assert again["worker"]["id"] == claimed["worker"]["id"] and again["source"] == "reuse"
        assert "event=worker_adopted" in second.log()

        # --stop-workers: nothing is left behind.
        assert second.stop(signal.SIGTERM) == 0
        assert wait_until(lambda: not fleet_processes(fleet), timeout=15)
    finally:
        kill_fleet(fleet)


def test_a_replica_whose_registration_expired_exits_for_a_fresh_start(tmp_path: Path) -> None:
    # A replica paused (or cut off from the store) for longer than instance_expiry_s is
    # dead to the others: they adopt its workers. When it runs again it must not go on
    # under that identity; it exits, non-zero, so that its supervisor starts a new one.
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    text = config(fleet).replace(
        "intervals: {", "intervals: {instance_heartbeat_s: 0.2, instance_expiry_s: 30, "
    )
    try:
        srv = start_server(tmp_path, config=text)
        assert wait_until(lambda: settled(srv.url, fleet), timeout=15)
        workers = {p.pid for p in fleet_processes(fleet)}
        with sqlite3.connect(tmp_path / "stoker.db") as db:
            # What another replica's janitor does to an instance whose heartbeat is stale.
            db.execute("UPDATE instances SET state = 'expired' WHERE state = 'active'")
        assert wait_until(lambda: srv.proc.poll() is not None, timeout=20)
        assert srv.stop() == 1
        log = srv.log()
        assert "event=instance_expired_while_alive" in log
        problem = [line for line in log.splitlines() if line.startswith("stoker: ")]
        assert len(problem) == 1 and "expired while running" in problem[0], log
        assert "Traceback" not in log
        # Its workers are left for the next start (or the other replicas) to adopt.
        assert {p.pid for p in fleet_processes(fleet)} == workers
    finally:
        kill_fleet(fleet)
