"""The SDK as an application uses it, against a real `stoker serve` with real demo workers:
sessions held through a claim storm on the same client, idempotent retries, lost sessions.

Real time, because the subject is the client's connection pools and a real server's
answers under load; every wait is bounded by the sessions' short lease or a claim's
timeout, and the assertions are outcomes (sessions still bound), not durations.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator

import httpx
import pytest

from servers import DEMO, Server, kill_fleet, start_server
from stoker.sdk import (
    AsyncClient,
    AsyncSession,
    CapacityError,
    Client,
    Retries,
    ServerUnreachable,
    SessionLost,
)

pytestmark = pytest.mark.processes

ADMIN = "sdk-admin-token-0123456789"
#: Sessions held through the storm, each on a lease this short (renewed every second).
HELD, LEASE_S = 10, 3.0
#: Claims waiting at once on the full pool, from the same client: more than its
#: connection pool (httpx's default: 100), so some wait for a connection too.
STORM = 120


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("sdk-storm")
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    demo = json.dumps(DEMO)
    config = f"""
store: sqlite:///./stoker.db
fleet: {fleet}
api:
  port: 0
  admin_tokens: [{ADMIN}]
intervals: {{janitor_interval_s: 0.2, reaper_interval_s: 0.5, shutdown_grace_s: 5}}
pools:
  - {{name: full, command: {demo}, warm_target: {HELD}, max_workers: {HELD}}}
  - {{name: demo, command: {demo}, warm_target: 2}}
"""
    srv = start_server(workdir, config=config, args=["--stop-workers"])
    try:
        yield srv
    finally:
        srv.stop()
        kill_fleet(fleet)


async def test_sessions_survive_a_claim_storm_on_the_same_client(server: Server) -> None:
    lost: list[SessionLost] = []
    # The storm's claims give up soon after their wait; the sessions' renewals must not.
    retries = Retries(deadline_s=2.0)
    async with AsyncClient(server.url, token=ADMIN, retries=retries) as client:
        sessions: list[AsyncSession] = []
        for _ in range(HELD):
            sessions.append(
                await client.claim(
                    "full", "acme", lease_s=LEASE_S, timeout_s=30, on_lost=lost.append
                )
            )
        # The pool is full: every claim of the storm waits its whole timeout, holding one of
        # the client's connections (or waiting for one) while the sessions' leases run out
        # twice over unless renewed.
        storm = await asyncio.gather(
            *(client.create_claim("full", "globex", timeout_s=2 * LEASE_S) for _ in range(STORM)),
            return_exceptions=True,
        )
        assert all(isinstance(o, CapacityError | ServerUnreachable) for o in storm), [
            o for o in storm if not isinstance(o, CapacityError | ServerUnreachable)
        ][:3]
        assert sum(isinstance(o, CapacityError) for o in storm) >= 100
        assert lost == []
        for session in sessions:
            assert session.lost is None and session.renewal_error is None
            assert (await client.get_claim(session.id)).state == "bound"
        for session in sessions:
            await session.release()


def test_a_retried_claim_gets_the_same_worker(server: Server) -> None:
    with Client(server.url, token=ADMIN) as client:
        body = {"pool": "demo", "org": "acme", "lease_s": 30}
        key = {"Idempotency-Key": str(uuid.uuid4())}
        first = httpx.post(f"{server.url}/v1/claims", json=body, headers={**key, **auth()})
        again = httpx.post(f"{server.url}/v1/claims", json=body, headers={**key, **auth()})
        assert (first.status_code, again.status_code) == (201, 200)
        assert again.json()["worker"] == first.json()["worker"]
        assert again.headers["idempotent-replayed"] == "true"
        client.release(first.json()["id"])


def test_a_session_whose_claim_ends_on_the_server_raises_at_exit(server: Server) -> None:
    with Client(server.url, token=ADMIN) as client:
        lost: list[SessionLost] = []

        def hold() -> None:
            with client.claim("demo", "acme", lease_s=1.5, on_lost=lost.append) as session:
                # Another hand ends the claim (an operator, the worker's death, ...).
                client.release(session.id)
                for _ in range(100):  # the next renewal, within a second, shows it
                    if session.lost is not None:
                        break
                    session._stop.wait(0.05)

        with pytest.raises(SessionLost, match="was lost"):
            hold()
        assert len(lost) == 1


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}
