"""The Python SDK against a real `stoker serve` with real demo workers (one per module).

Sessions release on exit (also on an exception), renewal keeps a session past its lease,
and every kind of error answer maps onto its exception with the problem details.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import pytest

import stoker
from servers import DEMO, Server, kill_fleet, start_server, wait_until
from stoker.sdk import (
    AsyncClient,
    CapacityError,
    ClaimConflict,
    Client,
    Forbidden,
    InvalidRequest,
    NotFound,
    OrgCapError,
    Retries,
    ServerUnreachable,
    StaleGeneration,
    StokerError,
    Unauthorized,
    Unavailable,
)

pytestmark = pytest.mark.processes

ADMIN = "sdk-admin-token-0123456789"
ACME = "sdk-acme-token-0123456789"
GLOBEX = "sdk-globex-token-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("sdk")
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    demo = json.dumps(DEMO)
    config = f"""
store: sqlite:///./stoker.db
fleet: {fleet}
api:
  port: 0
  admin_tokens: [{ADMIN}]
  org_tokens: {{{ACME}: acme, {GLOBEX}: globex}}
intervals: {{janitor_interval_s: 0.2, reaper_interval_s: 0.5, shutdown_grace_s: 5}}
pools:
  - {{name: demo, command: {demo}, warm_target: 2}}
  - {{name: capped, command: {demo}, warm_target: 1, max_workers_per_org: 1}}
  - {{name: tiny, command: {demo}, warm_target: 0, max_workers: 1}}
"""
    srv = start_server(workdir, config=config, args=["--stop-workers"])
    try:
        yield srv
    finally:
        srv.stop()
        kill_fleet(fleet)


@pytest.fixture
def admin(server: Server) -> Iterator[Client]:
    with Client(server.url, token=ADMIN) as client:
        yield client


@pytest.fixture
def acme(server: Server) -> Iterator[Client]:
    with Client(server.url, token=ACME) as client:
        yield client


def test_a_session_gives_the_worker_and_releases_on_exit(acme: Client) -> None:
    with acme.claim(pool="demo", org="acme", config={"role": "ro"}) as session:
        assert session.claim.bound and session.claim.org == "acme"
        assert session.endpoint.startswith("http://127.0.0.1:") and session.token
        answer = httpx.get(session.endpoint + "/", headers=session.headers, timeout=5)
        assert answer.status_code == 200
        assert answer.json()["org"] == "acme" and answer.json()["config_keys"] == ["role"]
        # Without the session token the worker refuses.
        assert httpx.get(session.endpoint + "/", timeout=5).status_code == 401
        claim_id = session.id
    released = acme.get_claim(claim_id)
    assert released.state == "released" and released.ended_at is not None


def test_a_session_is_released_when_the_block_raises(acme: Client) -> None:
    claim_id = ""
    with (  # noqa: PT012 - the block under test raises on purpose
        pytest.raises(RuntimeError, match="tenant code failed"),
        acme.claim(pool="demo", org="acme") as session,
    ):
        claim_id = session.id
        raise RuntimeError("tenant code failed")
    assert acme.get_claim(claim_id).state == "released"


def test_renewal_keeps_a_session_alive_past_its_lease(acme: Client) -> None:
    lease = 1.0
    with acme.claim(pool="demo", org="acme", lease_s=lease) as session:
        first_expiry = session.claim.expires_at
        # Hold the session for three leases; the janitor expires unrenewed leases every 0.2 s.
        assert not wait_until(lambda: not acme.get_claim(session.id).bound, timeout=3 * lease)
        current = acme.get_claim(session.id)
        assert current.bound and current.expires_at > first_expiry
        assert session.renewal_error is None
        answer = httpx.get(session.endpoint + "/", headers=session.headers, timeout=5)
        assert answer.status_code == 200
    assert acme.get_claim(session.id).state == "released"


def test_without_renewal_the_lease_expires(acme: Client) -> None:
    claim = acme.create_claim("demo", "acme", lease_s=1)
    assert wait_until(lambda: acme.get_claim(claim.id).state == "expired", timeout=10)


def test_a_session_without_renewal_expires_while_held(acme: Client) -> None:
    session = acme.claim(pool="demo", org="acme", lease_s=1, renew=False)
    assert wait_until(lambda: acme.get_claim(session.id).state == "expired", timeout=10)
    # Releasing an expired claim returns it as it is.
    assert session.release().state == "expired"


def test_errors_map_to_exceptions_with_problem_details(server: Server, acme: Client) -> None:
    with pytest.raises(NotFound) as not_found:
        acme.create_claim("no-such-pool", "acme")
    assert not_found.value.status == 404 and not_found.value.problem["code"] == "not-found"

    with pytest.raises(InvalidRequest) as invalid:
        acme.create_claim("demo", "acme", lease_s=0)
    assert invalid.value.status == 422 and invalid.value.problem["errors"]

    with pytest.raises(Forbidden) as forbidden:
        acme.create_claim("demo", "globex")
    assert forbidden.value.status == 403

    with (
        Client(server.url, token="not-a-real-token-000") as stranger,
        pytest.raises(Unauthorized) as unauthorized,
    ):
        stranger.pools()
    assert unauthorized.value.status == 401

    with pytest.raises(Forbidden):
        acme.workers()

    released = acme.create_claim("demo", "acme")
    acme.release(released.id)
    with pytest.raises(ClaimConflict) as conflict:
        acme.renew(released.id)
    assert conflict.value.status == 409 and conflict.value.code == "claim-conflict"


def test_org_cap_raises_with_retry_after(acme: Client) -> None:
    with acme.claim(pool="capped", org="acme"), pytest.raises(OrgCapError) as capped:
        acme.create_claim("capped", "acme", timeout_s=0.5)
    assert capped.value.status == 429 and capped.value.retry_after == 45.0


def test_no_capacity_raises_with_the_reason(admin: Client) -> None:
    with admin.claim(pool="tiny", org="acme"):
        # The pool's only worker is taken: no warm one can come, and no cold one may spawn.
        with pytest.raises(CapacityError) as no_warm:
            admin.create_claim("tiny", "globex", mode="require_warm", timeout_s=0.5)
        with pytest.raises(CapacityError) as at_cap:
            admin.create_claim("tiny", "globex", timeout_s=0.5)
    assert no_warm.value.status == 503 and no_warm.value.reason == "no_capacity"
    assert at_cap.value.reason == "pool_cap" and at_cap.value.code == "no-capacity"
    assert isinstance(no_warm.value, StokerError)


def test_an_unreachable_server_raises_server_unreachable() -> None:
    # Retried (a refused connection may be a restart) until the deadline: 1 s here, not
    # the default 30 s (`Retries.delay` is tested on its own).
    with (
        Client("http://127.0.0.1:9", timeout=2, retries=Retries(deadline_s=1.0)) as client,
        pytest.raises(ServerUnreachable) as unreachable,
    ):
        client.pools()
    assert unreachable.value.status == 0 and "cannot reach stoker" in str(unreachable.value)
    with Client("http://127.0.0.1:9", timeout=2) as client:
        assert not client.ready()


def test_pools_and_workers_are_typed(admin: Client) -> None:
    pools = {p.name: p for p in admin.pools()}
    assert set(pools) == {"demo", "capped", "tiny"}
    assert pools["tiny"].cap == 1 and pools["capped"].max_workers_per_org == 1
    assert admin.pool("demo").warm_target == 2
    with admin.claim(pool="demo", org="globex") as session:
        [worker] = admin.workers(state="hot", org="globex")
        assert worker.id == session.worker_id and worker.claim_id == session.id
        assert worker.activated and worker.state == "hot"
        assert session.id in {c.id for c in admin.claims()}
    assert session.id not in {c.id for c in admin.claims()}
    released = admin.claims(state="released", limit=10000)
    assert [c.org for c in released if c.id == session.id] == ["globex"]
    assert admin.ready()


def test_the_package_root_exposes_the_sdk() -> None:
    assert stoker.Client is Client
    assert stoker.CapacityError is CapacityError
    with pytest.raises(AttributeError):
        _ = stoker.NoSuchThing


async def test_async_session_renews_and_releases_on_exception(server: Server) -> None:
    async with AsyncClient(server.url, token=ACME) as client:
        with pytest.raises(ValueError, match="boom"):  # noqa: PT012
            async with client.claim(pool="demo", org="acme", lease_s=1) as session:
                claim_id = session.id
                async with httpx.AsyncClient(timeout=5) as http:
                    answer = await http.get(session.endpoint + "/", headers=session.headers)
                assert answer.json()["org"] == "acme"
                first_expiry = session.claim.expires_at
                await _sleep(2.5)
                current = await client.get_claim(claim_id)
                assert current.bound and current.expires_at > first_expiry
                raise ValueError("boom")
        assert (await client.get_claim(claim_id)).state == "released"
        with pytest.raises(NotFound):
            await client.get_claim("c-missing")


async def test_async_claim_can_be_awaited(server: Server) -> None:
    async with AsyncClient(server.url, token=ACME) as client:
        session = await client.claim(pool="demo", org="acme", renew=False)
        assert session.claim.bound
        assert (await session.release()).state == "released"
        assert (await session.release()).state == "released"


def test_an_admin_changes_and_drains_a_pool(admin: Client, acme: Client) -> None:
    before = admin.pool("tiny")
    assert before.generation is not None and before.draining is False
    assert [r["state"] for r in before.revisions] == ["stable"]
    with pytest.raises(Forbidden):
        acme.update_pool("tiny", lease_s=45)
    try:
        changed = admin.update_pool("tiny", lease_s=45, generation=before.generation)
        assert (
            changed.generation == before.generation + 1 and changed.raw["settings"]["lease_s"] == 45
        )
        with pytest.raises(StaleGeneration):
            admin.update_pool("tiny", lease_s=30, generation=before.generation)
        assert admin.drain_pool("tiny").draining is True
        # A 503 is retried until the call's deadline: 1 s here, not the default 30 s.
        with (
            Client(acme.url, token=ACME, retries=Retries(deadline_s=1.0)) as hurried,
            pytest.raises(Unavailable, match="draining"),
        ):
            hurried.create_claim("tiny", "acme", timeout_s=1)
    finally:
        admin.drain_pool("tiny", draining=False)
        admin.update_pool("tiny", lease_s=60)
    assert admin.pool("tiny").draining is False


def test_a_template_the_server_refuses_names_the_field_and_starts_nothing(
    admin: Client,
) -> None:
    before = admin.pool("tiny")
    with pytest.raises(InvalidRequest, match="`command`"):
        admin.start_rollout("tiny", {"argv": ["python"]})
    with pytest.raises(InvalidRequest, match="memory_mb"):
        admin.start_rollout("tiny", {"memory_mb": "x"})
    with pytest.raises(InvalidRequest, match="step"):
        admin.start_rollout("tiny", {"env": {"V": "2"}}, strategy={"step": [50]})
    with pytest.raises(ClaimConflict, match="serves this template already"):
        admin.start_rollout("tiny", {"command": list(DEMO)})
    assert before.generation is not None
    with pytest.raises(StaleGeneration):
        admin.start_rollout("tiny", {"env": {"V": "2"}}, generation=before.generation + 5)
    after = admin.pool("tiny")
    assert after.generation == before.generation and after.raw["rollout"] is None


async def test_the_async_client_changes_a_pool(server: Server) -> None:
    async with AsyncClient(server.url, token=ADMIN) as client:
        generation = (await client.pool("capped")).generation
        assert generation is not None
        # Its warm target is 1 already: a change to what it has keeps the generation.
        same = await client.update_pool("capped", warm_target=1, generation=generation)
        assert same.generation == generation
        changed = await client.update_pool("capped", warm_target=2, generation=generation)
        assert changed.generation == generation + 1
        restored = await client.update_pool("capped", warm_target=1)
        assert restored.generation == generation + 2
        assert (await client.drain_pool("capped", draining=False)).draining is False


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)
