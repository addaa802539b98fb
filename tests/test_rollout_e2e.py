"""Rolling a new demo-worker command out under steady claims, end to end: a real
`stoker serve`, real worker processes, the `stoker rollout` command and the SDK (#14).

Claims keep coming from two threads, at a steady rate, while the canary ramps 50 % then
100 %; not one may fail, and once promoted every new worker runs the new command.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from servers import Server, kill_fleet, start_server, wait_until
from stoker.sdk import Client, StokerError
from test_cli import config, run

pytestmark = pytest.mark.processes


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    srv = start_server(
        tmp_path, config=config(fleet, warm_target=2, reuse="never"), args=["--stop-workers"]
    )
    try:
        yield srv
    finally:
        srv.stop()
        kill_fleet(fleet)


#: Seconds between the starts of one org's claims: a steady rate that a loaded machine
#: serves. With `reuse: never` each claim costs a spawn; back to back (or one a second
#: per org, with both cores busy elsewhere) the cold spawns claims wait for, which go
#: first, kept the local start-up slots busy and the new revision's warm spawns never
#: started: the rollout stayed at "preparing step 1".
CLAIM_PERIOD_S = 4.0


def _steady_claims(
    url: str, org: str, stop: threading.Event, seen: list[str], failed: list[str]
) -> None:
    """Claim, hold briefly, release, one claim every `CLAIM_PERIOD_S` (or at once after a
    slower one), until `stop`; record each claim's worker."""
    with Client(url) as client:
        while not stop.is_set():
            began = time.perf_counter()
            try:
                claim = client.create_claim("demo", org, timeout_s=30)
            except StokerError as exc:
                failed.append(f"{org}: {exc}")
                continue
            seen.append(claim.worker.id)
            time.sleep(0.2)
            client.release(claim.id)
            stop.wait(max(0.0, CLAIM_PERIOD_S - (time.perf_counter() - began)))


def test_a_new_command_rolls_out_under_steady_claims_with_no_failed_claim(
    server: Server,
) -> None:
    stop = threading.Event()
    seen: list[str] = []
    failed: list[str] = []
    threads = [
        threading.Thread(target=_steady_claims, args=(server.url, org, stop, seen, failed))
        for org in ("acme", "globex")
    ]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        started = run(
            [
                "rollout",
                "start",
                "demo",
                "--env",
                "DEMO_REVISION=2",
                "--steps",
                "50,100",
                "--step-interval-s",
                "2",
                "--json",
            ],
            url=server.url,
        )
        assert started.returncode == 0, started.stderr
        rollout = json.loads(started.stdout)
        # Preparing: the first step takes effect once the new revision holds its workers.
        assert rollout["state"] == "ramping" and rollout["share"] == 0
        watched = run(
            ["rollout", "status", "demo", rollout["id"], "--watch", "--interval", "0.5"],
            url=server.url,
            timeout=120,
        )
        assert watched.returncode == 0, watched.stderr
        assert "promoted" in watched.stdout.splitlines()[-1], watched.stdout
        before = len(seen)
        # Claims go on after the promotion: one of each org at least (bounded, not timed).
        assert wait_until(lambda: len(seen) >= before + 2, timeout=4 * CLAIM_PERIOD_S + 60)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert failed == []
    assert len(seen) > before > 0
    with Client(server.url) as client:
        done = client.rollout("demo", rollout["id"])
        assert done.state == "promoted" and done.ended
        pool = client.pool("demo")
        assert pool.revision == rollout["revision"]
        late = {w.id: w.revision for w in client.workers()}
    # Every worker claimed after the promotion runs the new revision.
    assert all(late.get(w, rollout["revision"]) == rollout["revision"] for w in seen[before:])
    ended = run(["rollout", "pause", "demo", rollout["id"]], url=server.url)
    assert ended.returncode == 1 and "has ended" in ended.stderr
