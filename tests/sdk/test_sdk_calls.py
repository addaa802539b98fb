"""The SDK without a server: both clients over `httpx.MockTransport`.

`Client` and `AsyncClient` send what one sans-I/O core builds, so the same call must put
the same request on the wire and read the same answer into the same result or exception.
Sessions renew on the schedule their lease sets and stop when the server ended them.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from stoker.sdk import (
    AsyncClient,
    AsyncSession,
    CapacityError,
    ClaimConflict,
    ClaimInfo,
    Client,
    DeletedPool,
    InvalidRequest,
    NotFound,
    OrgCapError,
    PoolInfo,
    PoolInUse,
    Retries,
    ServerUnreachable,
    Session,
    SessionLost,
    StokerError,
    TemplateChanges,
    Unavailable,
    WorkerInfo,
)

NOW = "2026-11-26T10:00:00Z"
WORKER = {"id": "w-1", "endpoint": "http://127.0.0.1:9001", "token": "tok", "epoch": 3}
POOL = {
    "name": "demo",
    "revision": "r1",
    "warm_target": 2,
    "desired_warm": 3,
    "demand": 1,
    "cap": 0,
    "max_workers_per_org": 4,
    "reuse": "org",
    "counts": {"warm": 2, "hot": 1},
}
WORKER_ROW = {
    "id": "w-1",
    "pool": "demo",
    "revision": "r1",
    "state": "hot",
    "epoch": 3,
    "org": "acme",
    "claim_id": "c/1",
    "endpoint": "http://127.0.0.1:9001",
    "owner": "replica-a",
    "activated": True,
    "created_at": NOW,
    "updated_at": NOW,
    "idle_since": None,
    "ttl_s": 60,
    "reason": None,
}


def claim_body(state: str = "bound", lease_s: float = 30.0) -> dict[str, Any]:
    return {
        "id": "c/1",
        "pool": "demo",
        "org": "acme",
        "state": state,
        "source": "warm",
        "mode": "prefer_warm",
        "worker": WORKER,
        "lease_s": lease_s,
        "expires_at": NOW,
        "created_at": NOW,
        "ended_at": None if state == "bound" else NOW,
        "reason": None,
        "ttl_s": None,
    }


class Server:
    """Answers by (method, path) and records every request it is sent."""

    def __init__(self, answers: dict[tuple[str, str], Callable[[], httpx.Response]]) -> None:
        self.answers = answers
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.get((request.method, request.url.path))
        if answer is None:
            return httpx.Response(404, json={"code": "not-found", "detail": "no such thing"})
        return answer()


def ok(body: Any, status: int = 200) -> Callable[[], httpx.Response]:
    return lambda: httpx.Response(status, json=body)


def every_call_server() -> Server:
    return Server(
        {
            ("POST", "/v1/claims"): ok(claim_body(), 201),
            ("GET", "/v1/claims/c/1"): ok(claim_body()),
            ("POST", "/v1/claims/c/1/renew"): ok(claim_body()),
            ("DELETE", "/v1/claims/c/1"): ok(claim_body("released")),
            ("GET", "/v1/pools"): ok({"pools": [POOL]}),
            ("GET", "/v1/pools/demo"): ok(POOL),
            ("GET", "/v1/workers"): ok({"workers": [WORKER_ROW]}),
            ("GET", "/v1/claims"): ok({"claims": [claim_body()]}),
            ("GET", "/readyz"): ok({"status": "ready"}),
        }
    )


def wire(request: httpx.Request) -> tuple[Any, ...]:
    """What a request puts on the wire, but for the client's own headers."""
    timeout = request.extensions.get("timeout", {})
    return (
        request.method,
        str(request.url),
        request.headers.get("authorization"),
        request.headers.get("accept"),
        json.loads(request.content) if request.content else None,
        timeout.get("read"),
    )


def sync_calls(client: Client) -> list[Any]:
    return [
        client.create_claim("demo", "acme", lease_s=30, config={"role": "ro"}, mode=None),
        client.get_claim("c/1"),
        client.renew("c/1", lease_s=60),
        client.renew("c/1"),
        client.release("c/1"),
        client.pools(),
        client.pool("demo"),
        client.workers(state="hot", org="acme", pool=None),
        client.claims(state="expired", limit=5),
        client.ready(),
    ]


async def async_calls(client: AsyncClient) -> list[Any]:
    return [
        await client.create_claim("demo", "acme", lease_s=30, config={"role": "ro"}, mode=None),
        await client.get_claim("c/1"),
        await client.renew("c/1", lease_s=60),
        await client.renew("c/1"),
        await client.release("c/1"),
        await client.pools(),
        await client.pool("demo"),
        await client.workers(state="hot", org="acme", pool=None),
        await client.claims(state="expired", limit=5),
        await client.ready(),
    ]


def paging_server() -> Callable[[httpx.Request], httpx.Response]:
    """Listings of three pages of one row each: `next` names the page after."""
    rows = {"/v1/claims": "claims", "/v1/workers": "workers"}
    body = {"/v1/claims": claim_body(), "/v1/workers": WORKER_ROW}

    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        page = int(request.url.params.get("after", "0"))
        item = {**body[path], "id": f"{rows[path]}-{page}"}
        more = str(page + 1) if page < 2 else None
        return httpx.Response(200, json={rows[path]: [item], "next": more})

    return handle


async def test_one_page_carries_the_cursor_of_the_next() -> None:
    # A caller paging by hand gets each page as a list, with the `after` of the next one.
    url = "http://stoker.test:8080/"
    with Client(url, transport=httpx.MockTransport(paging_server())) as client:
        first = client.claims(state="released", limit=1)
        assert isinstance(first, list) and first.next == "1"
        second = client.claims(state="released", limit=1, after=first.next)
        assert [c.id for c in second] == ["claims-1"] and second.next == "2"
        last = client.workers(limit=1, after="2")
        assert [w.id for w in last] == ["workers-2"] and last.next is None
        # Still the list it was: equal to one, and copied as one.
        assert last == list(last) and [*last] == list(last)
    async with AsyncClient(url, transport=httpx.MockTransport(paging_server())) as aclient:
        page = await aclient.workers(pool="demo", limit=1)
        assert [w.id for w in page] == ["workers-0"] and page.next == "1"
        assert (await aclient.claims(after=page.next)).next == "2"


async def test_both_clients_iterate_over_every_page() -> None:
    url = "http://stoker.test:8080/"
    with Client(url, transport=httpx.MockTransport(paging_server())) as client:
        claims = client.iter_claims(state="released", limit=1)
        # Lazily: the first page is fetched by the first step.
        assert next(claims).id == "claims-0"
        assert [c.id for c in claims] == ["claims-1", "claims-2"]
        assert [w.id for w in client.iter_workers(after="1")] == ["workers-1", "workers-2"]
        one = client.claims(limit=1, after="2")
        assert [c.id for c in one] == ["claims-2"]
    requests: list[httpx.Request] = []
    handle = paging_server()

    def recorded(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return handle(request)

    async with AsyncClient(url, transport=httpx.MockTransport(recorded)) as aclient:
        got = [c.id async for c in aclient.iter_claims(state="released", limit=1)]
        assert got == ["claims-0", "claims-1", "claims-2"]
        assert [w.id async for w in aclient.iter_workers(pool="demo")] == [
            "workers-0",
            "workers-1",
            "workers-2",
        ]
    assert [dict(r.url.params) for r in requests[:3]] == [
        {"state": "released", "limit": "1"},
        {"state": "released", "limit": "1", "after": "1"},
        {"state": "released", "limit": "1", "after": "2"},
    ]
    assert dict(requests[4].url.params) == {"pool": "demo", "after": "1"}


async def test_both_clients_send_the_same_requests_and_read_the_same_results() -> None:
    sync_server, async_server = every_call_server(), every_call_server()
    url = "http://stoker.test:8080/"
    with Client(url, token="t0k", transport=httpx.MockTransport(sync_server)) as client:
        sync_results = sync_calls(client)
    transport = httpx.MockTransport(async_server)
    async with AsyncClient(url, token="t0k", transport=transport) as aclient:
        async_results = await async_calls(aclient)

    assert async_results == sync_results
    assert [wire(r) for r in async_server.requests] == [wire(r) for r in sync_server.requests]
    claim, *_, pools, pool, workers, claims, ready = sync_results
    assert isinstance(claim, ClaimInfo) and claim.worker.epoch == 3 and claim.bound
    assert claim.raw["id"] == "c/1" and claim.expires_at.tzinfo is not None
    assert pools == [pool] and isinstance(pool, PoolInfo) and pool.counts == {"warm": 2, "hot": 1}
    assert isinstance(workers[0], WorkerInfo) and workers[0].ttl_s == 60.0
    assert workers[0].raw == WORKER_ROW and pool.raw == POOL
    assert claims == [claim] and claims[0].raw["state"] == "bound"
    assert ready is True

    create, get, renew, renew_default, *_, list_workers, list_claims, _ = sync_server.requests
    # The claim's body holds the options that are set; its read waits out the claim's wait
    # (the pools' default claim timeout when none is given), not an hour.
    assert wire(create) == (
        "POST",
        "http://stoker.test:8080/v1/claims",
        "Bearer t0k",
        "application/json, application/problem+json",
        {"pool": "demo", "org": "acme", "lease_s": 30, "config": {"role": "ro"}},
        30.0 + 10.0,
    )
    # Each claim carries a key of its own (a UUID4), so that it is safe to send again.
    keys = {r.headers["idempotency-key"] for r in (create, async_server.requests[0])}
    assert len(keys) == 2 and all(len(k) == 36 for k in keys)
    assert "idempotency-key" not in get.headers
    # A claim id is one path segment, whatever it holds.
    assert get.url.raw_path == b"/v1/claims/c%2F1"
    assert json.loads(renew.content) == {"lease_s": 60} and renew_default.content == b""
    assert wire(renew)[-1] == 10.0
    assert dict(list_workers.url.params) == {"state": "hot", "org": "acme"}
    assert dict(list_claims.url.params) == {"state": "expired", "limit": "5"}


@pytest.mark.parametrize("claim_id", ["", ".", ".."])
async def test_an_id_that_is_no_path_segment_is_refused_before_anything_is_sent(
    claim_id: str,
) -> None:
    server = every_call_server()
    with Client("http://s", transport=httpx.MockTransport(server)) as client:
        for call in (client.get_claim, client.renew, client.release):
            with pytest.raises(InvalidRequest, match=f"invalid claim id {claim_id!r}"):
                call(claim_id)
    async with AsyncClient("http://s", transport=httpx.MockTransport(server)) as aclient:
        with pytest.raises(InvalidRequest, match="invalid claim id"):
            await aclient.release(claim_id)
    assert server.requests == []


def test_a_redirect_says_the_url_is_not_the_api() -> None:
    moved = Server(
        {("GET", "/v1/pools"): lambda: httpx.Response(307, headers={"Location": "/login"})}
    )
    with (
        Client("http://s", transport=httpx.MockTransport(moved)) as client,
        pytest.raises(StokerError) as error,
    ):
        client.pools()
    assert error.value.status == 307
    assert str(error.value) == (
        "307 Temporary Redirect: the server sent /v1/pools to /login; "
        "is the URL the base URL of the stoker API?"
    )


async def test_both_clients_map_answers_onto_the_same_exceptions() -> None:
    answers = {
        ("GET", "/v1/claims/capped"): lambda: httpx.Response(
            429, json={"code": "org-cap"}, headers={"Retry-After": "45"}
        ),
        ("GET", "/v1/claims/full"): ok({"code": "no-capacity", "reason": "pool_cap"}, 503),
        ("GET", "/v1/claims/closing"): ok({"reason": "shutting_down"}, 503),
        ("GET", "/v1/claims/ended"): ok({"code": "claim-conflict"}, 409),
        ("GET", "/v1/claims/garbled"): lambda: httpx.Response(200, text="<html>"),
    }
    expected: list[tuple[str, type[StokerError], Callable[[StokerError], bool]]] = [
        ("capped", OrgCapError, lambda e: isinstance(e, OrgCapError) and e.retry_after == 45.0),
        ("full", CapacityError, lambda e: isinstance(e, CapacityError) and e.reason == "pool_cap"),
        ("closing", Unavailable, lambda e: e.status == 503 and e.code == ""),
        ("ended", ClaimConflict, lambda e: e.code == "claim-conflict"),
        ("garbled", StokerError, lambda e: e.status == 200 and "not JSON" in str(e)),
        ("missing", NotFound, lambda e: e.detail == "no such thing"),
    ]
    once = Retries(enabled=False)  # each error as the first answer maps it (retries: below)
    sync_client = Client("http://s", retries=once, transport=httpx.MockTransport(Server(answers)))
    async_client = AsyncClient(
        "http://s", retries=once, transport=httpx.MockTransport(Server(answers))
    )
    async with async_client:
        for claim_id, kind, check in expected:
            with pytest.raises(kind) as sync_error:
                sync_client.get_claim(claim_id)
            with pytest.raises(kind) as async_error:
                await async_client.get_claim(claim_id)
            assert type(sync_error.value) is type(async_error.value) is kind
            assert check(sync_error.value) and check(async_error.value)
            assert sync_error.value.problem == async_error.value.problem
    sync_client.close()


async def test_no_answer_is_server_unreachable_for_both_clients() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    once = Retries(enabled=False)
    with Client("http://s:1", retries=once, transport=httpx.MockTransport(refuse)) as client:
        with pytest.raises(ServerUnreachable, match="cannot reach stoker at http://s:1"):
            client.pools()
        assert client.ready() is False
    transport = httpx.MockTransport(refuse)
    async with AsyncClient("http://s:1", retries=once, transport=transport) as aclient:
        with pytest.raises(ServerUnreachable, match="cannot reach stoker at http://s:1"):
            await aclient.pools()
        assert await aclient.ready() is False


async def test_an_unknown_option_is_refused_before_anything_is_sent() -> None:
    server = every_call_server()
    with Client("http://s", transport=httpx.MockTransport(server)) as client:
        with pytest.raises(TypeError, match="claim option: lease"):
            client.create_claim("demo", "acme", lease=30)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="worker filter: owner"):
            client.workers(owner="x")  # type: ignore[call-arg]
    async with AsyncClient("http://s", transport=httpx.MockTransport(server)) as aclient:
        with pytest.raises(TypeError, match="claim option: lease"):
            aclient.claim("demo", "acme", lease=30)  # type: ignore[call-arg]
    assert server.requests == []


def renewals_until_conflict(conflict_after: int) -> tuple[Server, threading.Event]:
    """A server that renews `conflict_after` times, then answers 409 (the claim ended)."""
    ended = threading.Event()
    renewals = 0

    def renew() -> httpx.Response:
        nonlocal renewals
        renewals += 1
        if renewals > conflict_after:
            ended.set()
            return httpx.Response(409, json={"code": "claim-conflict"})
        return httpx.Response(200, json=claim_body(lease_s=0.15))

    server = Server(
        {
            ("POST", "/v1/claims"): ok(claim_body(lease_s=0.15), 201),
            ("POST", "/v1/claims/c/1/renew"): renew,
            ("DELETE", "/v1/claims/c/1"): ok(claim_body("expired")),
        }
    )
    return server, ended


def renew_count(server: Server) -> int:
    return sum(r.url.path.endswith("/renew") for r in server.requests)


def test_a_session_renews_until_the_server_ends_it() -> None:
    server, ended = renewals_until_conflict(2)
    lost: list[SessionLost] = []
    held: list[Session] = []

    def hold(client: Client) -> None:
        with client.claim("demo", "acme", on_lost=lost.append) as session:
            held.append(session)
            assert ended.wait(10)
            renewer = session._renewer
            assert renewer is not None
            renewer.join(10)
            # A 409 ends the renewals: no further request comes.
            assert not renewer.is_alive() and renew_count(server) == 3
            assert isinstance(session.renewal_error, ClaimConflict)
            # The application hears of it at once (and may ask), and the exit raises it.
            assert lost == [session.lost]
            assert session.lost is not None
            assert isinstance(session.lost.__cause__, ClaimConflict)
            with pytest.raises(SessionLost):
                session.check()

    with (
        Client("http://s", transport=httpx.MockTransport(server)) as client,
        pytest.raises(SessionLost, match="c/1 was lost") as raised,
    ):
        hold(client)
    assert raised.value is held[0].lost
    assert held[0].claim.state == "expired"


@pytest.mark.looptime
async def test_an_async_session_renews_until_the_server_ends_it() -> None:
    server, ended = renewals_until_conflict(2)
    lost: list[SessionLost] = []
    held: list[AsyncSession] = []

    async def hold(client: AsyncClient) -> None:
        async with client.claim("demo", "acme", on_lost=lost.append) as session:
            held.append(session)
            # Renewals come every third of the 0.15 s lease: three of them by 0.2 s.
            await asyncio.sleep(1)
            assert ended.is_set() and renew_count(server) == 3
            assert isinstance(session.renewal_error, ClaimConflict)
            assert lost == [session.lost]
            raise ValueError("the application's own")

    async with AsyncClient("http://s", transport=httpx.MockTransport(server)) as client:
        with pytest.raises(ValueError, match="the application's own") as raised:
            await hold(client)
    # The block's own exception wins; the lost session is noted on it.
    assert any("was lost" in note for note in raised.value.__notes__)
    assert held[0].claim.state == "expired"


def test_the_package_root_is_the_sdk_loaded_on_first_use() -> None:
    script = (
        "import sys, stoker, stoker.sdk as sdk\n"
        "assert 'httpx' in sys.modules\n"
        "names = {}\n"
        "exec('from stoker import *', names)\n"
        "assert stoker.__all__ == ['__version__', *sdk.__all__]\n"
        "assert all(names[n] is getattr(sdk, n) for n in sdk.__all__)\n"
        "assert stoker.Client is sdk.Client\n"
    )
    lazy = "import sys, stoker\nassert 'httpx' not in sys.modules, 'import stoker loads httpx'\n"
    for code in (lazy, script):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


# -- retries --------------------------------------------------------------------------------


def test_retry_waits_are_jittered_back_off_never_shorter_than_retry_after() -> None:
    rng = random.Random(7)
    retries = Retries(backoff_s=0.5, max_backoff_s=4.0)
    down = ServerUnreachable("cannot reach stoker")
    waits = [retries.delay(n, down, left=100.0, rng=rng) for n in range(8)]
    caps = [min(4.0, 0.5 * 2**n) for n in range(8)]
    assert all(w is not None and 0 <= w <= cap for w, cap in zip(waits, caps, strict=True))
    assert len(set(waits)) == 8  # jittered: clients that failed together spread out
    capped = OrgCapError("429", retry_after=3.0)
    busy = Unavailable("503", retry_after=2.0)
    assert retries.delay(0, capped, left=100.0, rng=rng) == 3.0
    assert retries.delay(0, busy, left=100.0, rng=rng) == 2.0
    # Past the call's deadline, or for an answer another try would not change: give up.
    assert retries.delay(0, capped, left=2.5, rng=rng) is None
    for final in (CapacityError("503 no capacity"), NotFound("404"), InvalidRequest("422")):
        assert retries.delay(0, final, left=100.0, rng=rng) is None
    assert Retries(enabled=False).delay(0, down, left=100.0) is None


def flaky_claims(*failures: Callable[[], httpx.Response]) -> Server:
    """A server whose claims fail as `failures` say, in turn, then succeed."""
    left = list(failures)

    def claim() -> httpx.Response:
        if left:
            return left.pop(0)()
        return httpx.Response(201, json=claim_body())

    return Server({("POST", "/v1/claims"): claim})


def unavailable(retry_after: str) -> Callable[[], httpx.Response]:
    def answer() -> httpx.Response:
        body = {"code": "unavailable", "detail": "starting", "reason": "starting"}
        return httpx.Response(503, json=body, headers={"Retry-After": retry_after})

    return answer


def refused() -> httpx.Response:
    raise httpx.ConnectError("connection refused")


@pytest.mark.looptime
async def test_a_claim_is_retried_with_its_key_after_retry_after() -> None:
    server = flaky_claims(unavailable("2"), refused, unavailable("1"))
    loop = asyncio.get_running_loop()
    async with AsyncClient("http://s", transport=httpx.MockTransport(server)) as client:
        started = loop.time()
        claim = await client.create_claim("demo", "acme", timeout_s=5)
        elapsed = loop.time() - started
    assert claim.id == "c/1"
    assert len(server.requests) == 4
    # Every try carries the claim's one key: the server binds at most one worker for it.
    assert len({r.headers["idempotency-key"] for r in server.requests}) == 1
    assert elapsed >= 3.0  # both Retry-After waits were honoured


def test_the_sync_client_retries_a_refused_connection() -> None:
    server = flaky_claims(refused, refused)
    retries = Retries(backoff_s=0.001)
    with Client("http://s", retries=retries, transport=httpx.MockTransport(server)) as client:
        assert client.create_claim("demo", "acme").id == "c/1"
    assert len(server.requests) == 3
    assert len({r.headers["idempotency-key"] for r in server.requests}) == 1


@pytest.mark.looptime
async def test_retries_end_at_the_calls_deadline_with_the_last_error() -> None:
    server = flaky_claims(*[unavailable("2")] * 100)
    loop = asyncio.get_running_loop()
    retries = Retries(deadline_s=5.0)
    transport = httpx.MockTransport(server)
    async with AsyncClient("http://s", retries=retries, transport=transport) as client:
        started = loop.time()
        with pytest.raises(Unavailable, match="starting"):
            await client.create_claim("demo", "acme", timeout_s=1)
        # The claim's wait (1 s) plus the retry deadline (5 s), never a try past them.
        assert loop.time() - started <= 6.0
    assert len(server.requests) == 3


ROLLOUT = {
    "id": "ro-1",
    "state": "ramping",
    "share": 10,
    "step": 0,
    "revision": "r2",
    "base_revision": "r1",
    "strategy": {"kind": "canary", "steps": [10, 100]},
    "started_at": 1.0,
    "ended_at": None,
    "reason": None,
}


async def test_rollout_writes_send_the_template_and_if_match_from_both_clients() -> None:
    def rollout_server() -> Server:
        return Server(
            {
                ("POST", "/v1/pools/demo/rollouts"): ok(ROLLOUT, 201),
                ("POST", "/v1/pools/demo/rollouts/ro-1/pause"): ok(ROLLOUT),
            }
        )

    template: TemplateChanges = {"command": ["worker", "--v2"], "env": {"A": "b"}}
    sync_server, async_server = rollout_server(), rollout_server()
    with Client("http://s", transport=httpx.MockTransport(sync_server)) as client:
        assert client.start_rollout("demo", template, generation=3).id == "ro-1"
        client.rollout("demo", "ro-1", "pause", generation=4)
        client.start_rollout("demo", template)
    async with AsyncClient("http://s", transport=httpx.MockTransport(async_server)) as aclient:
        assert (await aclient.start_rollout("demo", template, generation=3)).id == "ro-1"
        await aclient.rollout("demo", "ro-1", "pause", generation=4)
        await aclient.start_rollout("demo", template)
    for server in (sync_server, async_server):
        started, paused, unmatched = server.requests
        assert json.loads(started.content) == {"template": template}
        assert started.headers["if-match"] == '"3"' and paused.headers["if-match"] == '"4"'
        assert "if-match" not in unmatched.headers


async def test_both_clients_delete_a_pool_and_say_why_one_is_refused() -> None:
    removed = {"pools": 1, "revisions": 2, "forecast": 0}
    busy = {
        "code": "pool-in-use",
        "detail": "pool 'busy' still has 2 live workers and 1 open claim",
        "reason": "in_use",
        "live_workers": 2,
        "open_claims": 1,
    }

    def pool_server() -> Server:
        return Server(
            {
                ("DELETE", "/v1/pools/old"): ok(
                    {"name": "old", "generation": 7, "removed": removed}
                ),
                ("DELETE", "/v1/pools/busy"): ok(busy, 409),
            }
        )

    sync_server, async_server = pool_server(), pool_server()
    once = Retries(enabled=False)
    with Client("http://s", retries=once, transport=httpx.MockTransport(sync_server)) as client:
        deleted = client.delete_pool("old", generation=7)
        with pytest.raises(PoolInUse) as sync_refused:
            client.delete_pool("busy")
    async with AsyncClient(
        "http://s", retries=once, transport=httpx.MockTransport(async_server)
    ) as aclient:
        assert await aclient.delete_pool("old", generation=7) == deleted
        with pytest.raises(PoolInUse) as async_refused:
            await aclient.delete_pool("busy")
    assert isinstance(deleted, DeletedPool)
    assert (deleted.name, deleted.generation, deleted.removed) == ("old", 7, removed)
    for refused in (sync_refused.value, async_refused.value):
        assert (refused.status, refused.reason) == (409, "in_use")
        assert (refused.live_workers, refused.open_claims) == (2, 1)
        assert "2 live workers" in str(refused)
    for server in (sync_server, async_server):
        old, unmatched = server.requests
        assert old.method == "DELETE" and old.headers["if-match"] == '"7"'
        assert "if-match" not in unmatched.headers


def ledger_server(requests: list[httpx.Request]) -> Callable[[httpx.Request], httpx.Response]:
    """A pool's ledger, and a claim log of three pages of one entry each."""

    def handle(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        if request.url.path == "/v1/pools/demo/ledger":
            return httpx.Response(200, json={"pool": "demo", "total": {"warm_s": 7.0}})
        page = int(request.url.params.get("after", "0"))
        entry = {"at": 100.0 + page, "pool": "demo", "org": "acme", "outcome": "released"}
        return httpx.Response(
            200, json={"entries": [entry], "next": str(page + 1) if page < 2 else None}
        )

    return handle


async def test_both_clients_read_the_ledger_and_page_through_the_claim_log() -> None:
    sent: list[httpx.Request] = []
    with Client("http://s", transport=httpx.MockTransport(ledger_server(sent))) as client:
        body = client.pool_ledger("demo", since="24h", by="org")
        assert body["total"]["warm_s"] == 7.0
        assert [e["at"] for e in client.iter_claim_log(since="7d", page_size=1)] == [
            100.0,
            101.0,
            102.0,
        ]
    async with AsyncClient("http://s", transport=httpx.MockTransport(ledger_server(sent))) as a:
        assert (await a.pool_ledger("demo", since="24h", by="org"))["pool"] == "demo"
        got = [e["at"] async for e in a.iter_claim_log(since="7d", pool="demo", page_size=1)]
        assert got == [100.0, 101.0, 102.0]
    assert dict(sent[0].url.params) == {"since": "24h", "by": "org"}
    assert dict(sent[2].url.params) == {"since": "7d", "limit": "1", "after": "1"}
    assert dict(sent[-1].url.params) == {"since": "7d", "pool": "demo", "limit": "1", "after": "2"}
