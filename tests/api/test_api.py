"""The HTTP API (docs/api.md): every route, every error status, auth and org isolation.

These tests call the ASGI app in-process through `httpx.ASGITransport`, on virtual time
(looptime), with `MemoryRuntime` workers (tests/fakes.py) and the real SQLite store: the
subject here is the HTTP layer — routing, validation, auth, problem details, status
mapping — and hundreds of requests against real worker processes would make the suite
minutes long without testing more of it. The same routes run against a real server with
real demo workers in tests/sdk/test_sdk.py, tests/test_cli.py and tests/test_quickstart.py.
"""

# These tests assert a property, act, then assert it changed: mypy narrows the first
# assert onto the second and calls what follows unreachable.
# mypy: disable-error-code="unreachable"

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Iterable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import MemoryRuntime
from stoker._version import __version__
from stoker.api import StokerApp, create_app
from stoker.api.routing import DECLINED, DirectRoute, DirectRoutes
from stoker.bootstrap import build_control_plane
from stoker.config import ApiConfig, StokerConfig
from stoker.control.plane import ControlPlane
from stoker.domain.states import ClaimState, WorkerState

pytestmark = pytest.mark.looptime

ADMIN = "admin-token-0123456789"
ACME = "acme-token-0123456789"
GLOBEX = "globex-token-0123456789"
TOKENS = ApiConfig(admin_tokens=[ADMIN], org_tokens={ACME: "acme", GLOBEX: "globex"})


def pool(name: str = "demo", **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"name": name, "command": ["worker", "{port}"], "warm_target": 2}
    base.update(kw)
    return base


@dataclass
class Api:
    app: StokerApp
    plane: ControlPlane
    runtime: MemoryRuntime
    http: httpx.AsyncClient

    async def claim(self, org: str = "acme", pool: str = "demo", **kw: Any) -> httpx.Response:
        token = kw.pop("token", None)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        body = {"pool": pool, "org": org, **kw}
        return await self.http.post("/v1/claims", json=body, headers=headers)

    async def claims(self) -> list[Any]:
        return await self.plane.store.list_claims()

    async def snapshot(self) -> tuple[Any, ...]:
        """Everything a request could change: claims and workers with their states."""
        workers = await self.plane.store.list_workers()
        claims = await self.plane.store.list_claims()
        return (
            sorted((w.id, w.state.value, w.epoch, w.org) for w in workers),
            sorted((c.id, c.state.value, c.expires_at) for c in claims),
        )


@asynccontextmanager
async def running(
    tmp_path: Path,
    pools: Iterable[dict[str, Any]] = (),
    *,
    api: ApiConfig | None = None,
    client: tuple[str, int] = ("127.0.0.1", 40000),
    headers: dict[str, str] | None = None,
    start: bool = True,
    **config: Any,
) -> AsyncIterator[Api]:
    """A started plane (no background loops) behind the app, and a client for it.

    Built inside each test, not in a fixture: looptime makes only the test body virtual.
    """
    cfg = StokerConfig.model_validate(
        {
            "store": f"sqlite:///{tmp_path}/stoker.db",
            "pools": list(pools) or [pool()],
            "api": (api or ApiConfig()).model_dump(),
            **config,
        }
    )
    runtime = MemoryRuntime(ready_delay=0.2)
    plane = build_control_plane(cfg, runtime=runtime, activator=runtime)
    app = create_app(plane, cfg.api, manage_plane=False)
    if start:
        await plane.start(loops=False)
        await asyncio.sleep(1)
    transport = httpx.ASGITransport(app=app, client=client)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://stoker", headers=headers or {}
    ) as http:
        try:
            yield Api(app, plane, runtime, http)
        finally:
            await plane.stop()


def assert_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    assert body["type"].startswith("urn:stoker:problem:")
    assert body["title"] and body["detail"] and body["code"]
    assert "Traceback" not in response.text
    return body


# -- claims ---------------------------------------------------------------------------------


async def test_a_claim_repeated_with_its_idempotency_key_is_the_same_claim(
    tmp_path: Path,
) -> None:
    async with running(tmp_path) as api:
        key = {"Idempotency-Key": "5f0c6a3e-key"}
        body = {"pool": "demo", "org": "acme", "config": {"role": "ro"}}
        first = await api.http.post("/v1/claims", json=body, headers=key)
        assert first.status_code == 201, first.text
        assert "idempotent-replayed" not in first.headers
        again = await api.http.post("/v1/claims", json=body, headers=key)
        assert again.status_code == 200, again.text
        assert again.headers["idempotent-replayed"] == "true"
        assert again.headers["location"] == first.headers["location"]
        assert again.json() == first.json()  # same id, worker and token
        assert len(await api.claims()) == 1

        reused = await api.http.post(
            "/v1/claims", json={**body, "config": {"role": "rw"}}, headers=key
        )
        problem = assert_problem(reused, 422)
        assert problem["code"] == "idempotency-key-reused"
        assert first.json()["id"] in problem["detail"]

        await api.http.delete(first.headers["location"])
        ended = await api.http.post("/v1/claims", json=body, headers=key)
        assert ended.status_code == 200
        assert ended.json()["state"] == "released" and ended.json()["worker"]["token"] is None
        assert len(await api.claims()) == 1


@pytest.mark.parametrize("key", ["", "x" * 256, "clé", "a\tb"])
async def test_a_malformed_idempotency_key_is_refused(tmp_path: Path, key: str) -> None:
    # Headers travel as bytes: a non-ASCII key reaches the server as latin-1 text.
    async with running(tmp_path) as api:
        headers = {b"Idempotency-Key": key.encode("utf-8")}
        response = await api.http.post(
            "/v1/claims", json={"pool": "demo", "org": "acme"}, headers=headers
        )
        assert "Idempotency-Key" in assert_problem(response, 400)["detail"]
        assert await api.claims() == []


async def test_claim_get_renew_release(tmp_path: Path) -> None:
    async with running(tmp_path) as api:
        created = await api.claim(config={"dsn": "postgres://x", "role": "ro"})
        assert created.status_code == 201, created.text
        claim = created.json()
        assert created.headers["location"] == f"/v1/claims/{claim['id']}"
        assert claim["pool"] == "demo" and claim["org"] == "acme"
        assert claim["state"] == "bound" and claim["source"] == "warm"
        assert claim["mode"] == "prefer_warm"
        worker = claim["worker"]
        assert worker["endpoint"].startswith("mem://") and worker["token"]
        proc = api.runtime.procs[worker["id"]]
        assert proc.org == "acme" and proc.token == worker["token"]
        assert proc.config == {"dsn": "postgres://x", "role": "ro"}

        # The token is in the claim's answer only: the server keeps no usable copy of it.
        got = await api.http.get(f"/v1/claims/{claim['id']}")
        assert got.status_code == 200
        assert got.json() == {**claim, "worker": {**worker, "token": None}}

        await asyncio.sleep(10)
        renewed = await api.http.post(f"/v1/claims/{claim['id']}/renew", json={"lease_s": 120})
        assert renewed.status_code == 200
        assert renewed.json()["expires_at"] > claim["expires_at"]
        bare = await api.http.post(f"/v1/claims/{claim['id']}/renew")
        assert bare.status_code == 200

        released = await api.http.delete(f"/v1/claims/{claim['id']}")
        assert released.status_code == 200
        body = released.json()
        assert body["state"] == "released" and body["ended_at"] is not None
        assert body["worker"]["token"] is None
        again = await api.http.delete(f"/v1/claims/{claim['id']}")
        assert again.status_code == 200 and again.json()["state"] == "released"

        late = await api.http.post(f"/v1/claims/{claim['id']}/renew")
        assert assert_problem(late, 409)["code"] == "claim-conflict"


async def test_release_then_claim_reuses_the_same_worker(tmp_path: Path) -> None:
    async with running(tmp_path) as api:
        first = (await api.claim()).json()
        await api.http.delete(f"/v1/claims/{first['id']}")
        second = (await api.claim()).json()
        assert second["source"] == "reuse"
        assert second["worker"]["id"] == first["worker"]["id"]
        assert second["worker"]["epoch"] > first["worker"]["epoch"]
        assert second["worker"]["token"] != first["worker"]["token"]


async def test_modes_are_served(tmp_path: Path) -> None:
    async with running(tmp_path) as api:
        cold = await api.claim(mode="cold")
        assert cold.status_code == 201 and cold.json()["source"] == "cold"
        warm = await api.claim(mode="require_warm")
        assert warm.status_code == 201 and warm.json()["source"] == "warm"


async def test_unicode_names_are_accepted(tmp_path: Path) -> None:
    async with running(tmp_path) as api:
        response = await api.claim(org="Zürich-组织-🚀")
        assert response.status_code == 201
        claim = response.json()
        assert claim["org"] == "Zürich-组织-🚀"
        got = await api.http.get(f"/v1/claims/{claim['id']}")
        assert got.json()["org"] == "Zürich-组织-🚀"


async def test_unknown_pool_and_claim_are_404(tmp_path: Path) -> None:
    async with running(tmp_path) as api:
        before = await api.snapshot()
        assert assert_problem(await api.claim(pool="nope"), 404)["code"] == "not-found"
        assert_problem(await api.claim(pool="пул"), 404)
        assert_problem(await api.http.get("/v1/claims/c-missing"), 404)
        assert_problem(await api.http.post("/v1/claims/c-missing/renew"), 404)
        assert_problem(await api.http.delete("/v1/claims/c-missing"), 404)
        assert_problem(await api.http.get("/v1/pools/nope"), 404)
        assert await api.snapshot() == before


# -- capacity and caps ----------------------------------------------------------------------


async def test_org_cap_is_429_with_retry_after(tmp_path: Path) -> None:
    async with running(
        tmp_path, [pool(max_workers_per_org=1)], intervals={"org_cap_retry_after_s": 12.5}
    ) as api:
        first = await api.claim()
        assert first.status_code == 201
        capped = await api.claim(timeout_s=1)
        body = assert_problem(capped, 429)
        assert body["code"] == "org-cap" and body["retry_after"] == 12.5
        assert capped.headers["retry-after"] == "13"
        # Another org is not affected by acme's cap.
        assert (await api.claim(org="globex")).status_code == 201


async def test_no_capacity_within_the_timeout_is_503_with_the_reason(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(warm_target=0)]) as api:
        response = await api.claim(mode="require_warm", timeout_s=0.5)
        body = assert_problem(response, 503)
        assert body["code"] == "no-capacity" and body["reason"] == "no_capacity"
        assert response.headers["Retry-After"] == "1"
        assert await api.claims() == []


async def test_pool_cap_is_503_with_the_reason(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(warm_target=1, max_workers=1)]) as api:
        assert (await api.claim()).status_code == 201
        body = assert_problem(await api.claim(org="globex", timeout_s=1), 503)
        assert body["reason"] == "pool_cap"


async def test_claims_are_refused_while_draining(tmp_path: Path) -> None:
    async with running(tmp_path) as api:
        held = (await api.claim()).json()
        api.app.api_state.draining = True
        body = assert_problem(await api.claim(), 503)
        assert body["reason"] == "shutting_down"
        # Sessions in flight may still end.
        released = await api.http.delete(f"/v1/claims/{held['id']}")
        assert released.status_code == 200


# -- pools, workers, health -----------------------------------------------------------------


async def test_pools_show_targets_demand_and_counts(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(), pool("other", warm_target=1, max_workers=5)]) as api:
        await api.claim()
        listed = await api.http.get("/v1/pools")
        assert listed.status_code == 200
        pools = {p["name"]: p for p in listed.json()["pools"]}
        assert set(pools) == {"demo", "other"}
        demo = pools["demo"]
        assert demo["warm_target"] == 2 and demo["revision"]
        assert demo["counts"]["hot"] == 1 and demo["counts"]["warm"] == 1
        assert set(demo["counts"]) == {s.value for s in WorkerState if s.value != "retired"}
        assert pools["other"]["cap"] == 5
        one = await api.http.get("/v1/pools/other")
        assert one.status_code == 200 and one.json() == pools["other"]


async def test_a_pools_counts_and_its_revisions_come_from_one_read(tmp_path: Path) -> None:
    """The listing reads the counts once: a pool's counts are always its revisions' sum,
    even when a worker moves between two reads (each read here sees one more worker hot)."""
    async with running(tmp_path, [pool()]) as api:
        store = api.plane.store
        read = store.count_workers
        reads = 0

        async def counted() -> Any:
            nonlocal reads
            reads += 1
            rows = await read()
            # A later read would see a claim that landed meanwhile.
            return [dataclasses.replace(c, count=c.count + reads - 1) for c in rows]

        store.count_workers = counted  # type: ignore[method-assign]
        (demo,) = (await api.http.get("/v1/pools")).json()["pools"]
        assert reads == 1
        summed = {
            state: sum(r["counts"][state] for r in demo["revisions"]) for state in demo["counts"]
        }
        assert summed == demo["counts"]


async def test_a_pool_shows_how_the_leader_sized_it(tmp_path: Path) -> None:
    async with running(tmp_path, [pool()]) as api:
        await api.claim()
        await api.plane.run_janitor_pass()
        sizing = (await api.http.get("/v1/pools/demo")).json()["sizing"]
        assert sizing["demand_rate"] > 0 and sizing["stable_rate"] > 0
        assert sizing["reactive_warm"] >= 1 and sizing["replace_s"] > sizing["ready_s"] > 0
        # No history yet: no forecast, and so no forecast error; no headroom (a process pool).
        assert sizing["forecast_rate"] is sizing["forecast_warm"] is sizing["headroom"] is None
        assert sizing["headroom_reason"] is sizing["headroom_short"] is None
        assert sizing["policy"] in ("static", "reactive") and sizing["forecast_off"] is False
        metrics = (await api.http.get("/metrics")).text
        assert 'stoker_pool_demand_rate{pool="demo"}' in metrics
        assert 'stoker_pool_forecast_sessions{pool="demo"} 0.0' in metrics


async def test_workers_are_listed_with_filters(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(), pool("other", warm_target=1)]) as api:
        claim = (await api.claim()).json()
        everyone = (await api.http.get("/v1/workers")).json()["workers"]
        assert len(everyone) == 3
        demo = (await api.http.get("/v1/workers", params={"pool": "demo"})).json()["workers"]
        assert {w["pool"] for w in demo} == {"demo"} and len(demo) == 2
        hot = (await api.http.get("/v1/workers", params={"state": "hot"})).json()["workers"]
        assert [w["id"] for w in hot] == [claim["worker"]["id"]]
        assert hot[0]["org"] == "acme" and hot[0]["claim_id"] == claim["id"]
        acme = (await api.http.get("/v1/workers", params={"org": "acme"})).json()["workers"]
        assert [w["id"] for w in acme] == [claim["worker"]["id"]]
        one = (await api.http.get("/v1/workers", params={"limit": 1})).json()["workers"]
        assert len(one) == 1
        await api.http.delete(f"/v1/claims/{claim['id']}")
        retired = await api.http.get("/v1/workers", params={"state": "retired"})
        assert retired.json()["workers"] == []


async def test_open_claims_are_listed(tmp_path: Path) -> None:
    async with running(tmp_path) as api:
        first = (await api.claim()).json()
        second = (await api.claim(org="globex")).json()
        listed = (await api.http.get("/v1/claims")).json()["claims"]
        # Oldest first; on virtual time both have the same creation time (then by id).
        assert sorted(c["id"] for c in listed) == sorted([first["id"], second["id"]])
        by_id = {c["id"]: c for c in listed}
        assert by_id[first["id"]]["org"] == "acme" and by_id[first["id"]]["state"] == "bound"
        # The list never carries a session token: the server keeps only digests.
        assert {c["worker"]["token"] for c in listed} == {None}
        await api.http.delete(f"/v1/claims/{first['id']}")
        listed = (await api.http.get("/v1/claims")).json()["claims"]
        assert [c["id"] for c in listed] == [second["id"]]
        ended = (await api.http.get("/v1/claims", params={"state": "released"})).json()
        assert [c["id"] for c in ended["claims"]] == [first["id"]]
        assert_problem(await api.http.get("/v1/claims", params={"state": "nope"}), 422)


async def test_listings_page_with_the_next_cursor(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(warm_target=3, max_workers=10)]) as api:
        made = [(await api.claim(org=f"org{i}")).json()["id"] for i in range(5)]
        everything = (await api.http.get("/v1/claims")).json()
        assert everything["next"] is None  # not a full page: the listing ended
        order = [c["id"] for c in everything["claims"]]
        assert sorted(order) == sorted(made)
        pages: list[list[str]] = []
        params: dict[str, str | int] = {"limit": 2}
        while True:
            page = (await api.http.get("/v1/claims", params=params)).json()
            pages.append([c["id"] for c in page["claims"]])
            if page["next"] is None:
                break
            params = {"limit": 2, "after": page["next"]}
        assert pages == [order[0:2], order[2:4], order[4:]]
        # A full last page still carries `next`; the page after it is empty.
        full = (await api.http.get("/v1/claims", params={"limit": 5})).json()
        assert full["next"] is not None
        after = {"limit": 5, "after": full["next"]}
        assert (await api.http.get("/v1/claims", params=after)).json() == {
            "claims": [],
            "next": None,
        }
        # Workers page the same way, with their filters.
        workers = [w["id"] for w in (await api.http.get("/v1/workers")).json()["workers"]]
        first = (await api.http.get("/v1/workers", params={"limit": 3})).json()
        rest = await api.http.get("/v1/workers", params={"limit": 1000, "after": first["next"]})
        assert [w["id"] for w in first["workers"] + rest.json()["workers"]] == workers
        hot: dict[str, str | int] = {"state": "hot", "limit": 4}
        page = (await api.http.get("/v1/workers", params=hot)).json()
        more = (await api.http.get("/v1/workers", params={**hot, "after": page["next"]})).json()
        assert len(page["workers"]) == 4 and len(more["workers"]) == 1
        for bad in ("nope!", "WzEsMl0", "x" * 600):
            problem = await api.http.get("/v1/claims", params={"after": bad})
            assert_problem(problem, 422)
            assert problem.json()["errors"][0]["loc"] == ["query", "after"]


async def test_events_record_spawns_and_retirements_with_reasons(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(reuse="never")]) as api:
        claim = (await api.claim()).json()
        await api.http.delete(f"/v1/claims/{claim['id']}")
        await asyncio.sleep(1)  # the worker stops in the background, then retires
        answer = (await api.http.get("/v1/events")).json()
        assert answer["replica"] == api.plane.instance_id
        events = answer["events"]
        # Newest first: the released worker retired (no reuse), after two spawns.
        assert events[0]["kind"] == "retired"
        assert events[0]["worker"] == claim["worker"]["id"]
        assert events[0]["reason"] == "no_reuse" and events[0]["org"] == "acme"
        spawned = [e for e in events if e["kind"] == "spawned"]
        assert len(spawned) == 2 and {e["pool"] for e in spawned} == {"demo"}
        newest = events[0]["seq"]
        assert (await api.http.get("/v1/events", params={"after": newest})).json()["events"] == []
        one = (await api.http.get("/v1/events", params={"limit": 1})).json()["events"]
        assert [e["seq"] for e in one] == [newest]


async def test_events_record_failed_spawns(tmp_path: Path) -> None:
    async with running(tmp_path, start=False) as api:
        api.runtime.fail_spawns = 1
        await api.plane.start(loops=False)
        await asyncio.sleep(1)
        events = (await api.http.get("/v1/events")).json()["events"]
        failed = [e for e in events if e["kind"] == "spawn_failed"]
        assert failed and failed[0]["pool"] == "demo" and failed[0]["detail"]
        retired = [e for e in events if e["kind"] == "retired"]
        assert retired and retired[0]["reason"] == "spawn_failure"


async def test_history_samples_each_pool(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(), pool("other", warm_target=1)]) as api:
        await api.plane.sample_pools()
        await api.claim()
        await asyncio.sleep(10)
        await api.plane.sample_pools()
        answer = (await api.http.get("/v1/history")).json()
        assert answer["interval_s"] == 10 and answer["replica"] == api.plane.instance_id
        demo = answer["pools"]["demo"]
        assert [(s["hot"], s["warm_target"]) for s in demo] == [(0, 2), (1, 2)]
        assert demo[0]["at"] < demo[1]["at"] <= answer["now"]
        assert len(answer["pools"]["other"]) == 2
        later = await api.http.get("/v1/history", params={"since": demo[0]["at"]})
        assert [s["hot"] for s in later.json()["pools"]["demo"]] == [1]


async def test_dashboard_data_is_for_admins_only(tmp_path: Path) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        acme = {"Authorization": f"Bearer {ACME}"}
        admin = {"Authorization": f"Bearer {ADMIN}"}
        for path in ("/v1/claims", "/v1/events", "/v1/history"):
            assert_problem(await api.http.get(path), 401)
            assert_problem(await api.http.get(path, headers=acme), 403)
            assert (await api.http.get(path, headers=admin)).status_code == 200, path


async def test_health_readiness_and_metrics(tmp_path: Path) -> None:
    async with running(tmp_path) as api:
        assert (await api.http.get("/healthz")).json() == {"status": "ok", "version": __version__}
        ready = await api.http.get("/readyz")
        assert ready.status_code == 200 and ready.json() == {"status": "ready", "degraded": []}
        await api.claim()
        metrics = await api.http.get("/metrics")
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain")
        assert 'stoker_claims_total{outcome="bound",pool="demo",source="warm"} 1.0' in metrics.text
        # One series per counter and histogram label set, no `_created` twin.
        assert "_created" not in metrics.text
        api.app.api_state.draining = True
        assert assert_problem(await api.http.get("/readyz"), 503)["reason"] == "shutting_down"


async def test_readiness_reports_a_pool_in_trouble_and_stays_200(tmp_path: Path) -> None:
    """A pool whose spawns keep failing degrades the answer without failing it: every
    replica shares the pool's fault, and a 503 would take all of them out of the load
    balancer, the other pools' claims with them."""
    async with running(tmp_path) as api:
        api.runtime.fail_spawns = 10**9
        for worker in await api.plane.store.list_workers(states=[WorkerState.WARM]):
            api.runtime.kill(worker.id)
        for _ in range(10):
            await api.plane.run_janitor_pass()
            await asyncio.sleep(1)
        ready = await api.http.get("/readyz")
        assert ready.status_code == 200
        body = ready.json()
        assert body["status"] == "degraded"
        [pool] = body["degraded"]
        assert pool["pool"] == "demo" and pool["problem"] == "spawn_failing"
        assert pool["in_a_row"] >= 3 and pool["detail"] == "injected spawn failure"

        api.runtime.fail_spawns = 0
        for _ in range(40):
            await api.plane.run_janitor_pass()
            await asyncio.sleep(1)
        assert (await api.http.get("/readyz")).json() == {"status": "ready", "degraded": []}


class SwitchedElector:
    """An elector whose answer the test sets; nothing runs it (the plane has no loops)."""

    is_leader = True
    epoch = 1

    async def run(self) -> None:
        """Nothing to contend for."""

    async def resign(self) -> None:
        """Nothing to give up."""


async def test_the_leader_gauge_follows_the_elector_at_every_scrape(tmp_path: Path) -> None:
    # A janitor pass that began while leading may outlast the lease (a stalled process, a
    # slow store): the gauge must follow the elector, not the last pass, or two replicas
    # report leader at once.
    async with running(tmp_path) as api:
        elector = SwitchedElector()
        api.plane.elector = elector
        for leading, value in ((True, "1.0"), (False, "0.0"), (True, "1.0")):
            elector.is_leader = leading
            text = (await api.http.get("/metrics")).text
            assert f"\nstoker_janitor_is_leader {value}\n" in text, (leading, text)


async def test_not_ready_until_started(tmp_path: Path) -> None:
    async with running(tmp_path, start=False) as api:
        assert (await api.http.get("/healthz")).status_code == 200
        body = assert_problem(await api.http.get("/readyz"), 503)
        assert body["reason"] == "starting"
        assert assert_problem(await api.claim(), 503)["code"] == "unavailable"
        assert_problem(await api.http.get("/v1/pools"), 503)
        assert_problem(await api.http.get("/v1/workers"), 503)
        await api.plane.start(loops=False)
        assert (await api.http.get("/readyz")).status_code == 200


async def test_openapi_document_lists_every_route(tmp_path: Path) -> None:
    async with running(tmp_path) as api:
        doc = (await api.http.get("/openapi.json")).json()
        paths = doc["paths"]
        assert set(paths["/v1/claims"]) == {"post", "get"}
        assert set(paths["/v1/claims/{claim_id}"]) == {"get", "delete"}
        assert set(paths["/v1/claims/{claim_id}/renew"]) == {"post"}
        for path in ("/v1/pools", "/v1/pools/{name}", "/v1/workers", "/healthz", "/readyz"):
            assert "get" in paths[path], path
        assert "/metrics" in paths
        errors = paths["/v1/claims"]["post"]["responses"]
        assert {"400", "404", "413", "422", "429", "503"} <= set(errors)
        assert "application/problem+json" in errors["503"]["content"]


# -- auth -----------------------------------------------------------------------------------


async def test_tokens_are_required_when_configured(tmp_path: Path) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        missing = await api.http.get("/v1/pools")
        assert assert_problem(missing, 401)["code"] == "unauthorized"
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = await api.http.get("/v1/pools", headers={"Authorization": "Bearer nope-nope"})
        assert_problem(wrong, 401)
        basic = await api.http.get("/v1/pools", headers={"Authorization": f"Basic {ADMIN}"})
        assert_problem(basic, 401)
        before = await api.snapshot()
        assert_problem(await api.claim(), 401)
        assert await api.snapshot() == before
        ok = await api.http.get("/v1/pools", headers={"Authorization": f"Bearer {ADMIN}"})
        assert ok.status_code == 200
        # Probes and metrics stay open for the orchestrator and the scraper.
        assert (await api.http.get("/healthz")).status_code == 200
        assert (await api.http.get("/readyz")).status_code == 200
        assert (await api.http.get("/metrics")).status_code == 200
        doc = (await api.http.get("/openapi.json")).json()
        assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


async def test_org_token_acts_only_for_its_org(tmp_path: Path) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        theirs = await api.claim(org="globex", token=GLOBEX)
        assert theirs.status_code == 201
        claim = theirs.json()
        before = await api.snapshot()

        acme = {"Authorization": f"Bearer {ACME}"}
        body = assert_problem(await api.claim(org="globex", token=ACME), 403)
        assert body["code"] == "forbidden"
        # Another org's claim answers as an unknown one would: nothing names its owner.
        unknown = assert_problem(await api.http.get("/v1/claims/c-nope", headers=acme), 404)
        foreign = [
            await api.http.get(f"/v1/claims/{claim['id']}", headers=acme),
            await api.http.post(f"/v1/claims/{claim['id']}/renew", headers=acme),
            await api.http.delete(f"/v1/claims/{claim['id']}", headers=acme),
        ]
        for answer in foreign:
            body = assert_problem(answer, 404)
            assert body["detail"] == unknown["detail"].replace("c-nope", claim["id"])
            assert "globex" not in answer.text
        assert_problem(await api.http.get("/v1/workers", headers=acme), 403)
        assert await api.snapshot() == before

        # Its own org works, and so does an admin for any org.
        assert (await api.http.get("/v1/pools", headers=acme)).status_code == 200
        mine = await api.claim(org="acme", token=ACME)
        assert mine.status_code == 201
        admin = {"Authorization": f"Bearer {ADMIN}"}
        got = await api.http.get(f"/v1/claims/{claim['id']}", headers=admin)
        assert got.status_code == 200 and got.json()["org"] == "globex"


async def test_an_org_never_receives_a_worker_that_served_another(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(warm_target=2)], api=TOKENS) as api:
        globex_workers = set()
        for _ in range(3):
            claim = (await api.claim(org="globex", token=GLOBEX)).json()
            globex_workers.add(claim["worker"]["id"])
            headers = {"Authorization": f"Bearer {GLOBEX}"}
            await api.http.delete(f"/v1/claims/{claim['id']}", headers=headers)
        acme_workers = set()
        for _ in range(4):
            response = await api.claim(org="acme", token=ACME)
            assert response.status_code == 201
            acme_workers.add(response.json()["worker"]["id"])
            await api.plane.run_janitor_pass()
            await asyncio.sleep(1)
        assert globex_workers and acme_workers
        assert not globex_workers & acme_workers
        assert api.runtime.fencing_violations == []


async def test_without_tokens_only_loopback_clients_are_served(tmp_path: Path) -> None:
    async with running(tmp_path, client=("10.1.2.3", 5000)) as api:
        body = assert_problem(await api.http.get("/v1/pools"), 403)
        assert "loopback" in body["detail"]
        assert_problem(await api.claim(), 403)
        assert await api.claims() == []
    async with running(tmp_path, client=("::1", 5000)) as api:
        assert (await api.http.get("/v1/pools")).status_code == 200


# -- malformed input ------------------------------------------------------------------------

OK_BODY = {"pool": "demo", "org": "acme"}


def raw(text: str) -> dict[str, Any]:
    return {"content": text.encode(), "headers": {"content-type": "application/json"}}


def body(**changes: Any) -> dict[str, Any]:
    return {"json": {**OK_BODY, **changes}}


def deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = {"k": value}
    return value


MALFORMED: list[tuple[str, str, str, dict[str, Any], int]] = [
    ("missing org", "POST", "/v1/claims", {"json": {"pool": "demo"}}, 422),
    ("missing body", "POST", "/v1/claims", {}, 422),
    ("body is an array", "POST", "/v1/claims", {"json": [OK_BODY]}, 422),
    ("body is a string", "POST", "/v1/claims", {"json": "demo"}, 422),
    ("not JSON", "POST", "/v1/claims", raw("{pool: demo"), 400),
    ("truncated JSON", "POST", "/v1/claims", raw('{"pool": "demo", "org": "a"'), 400),
    (
        "number too long",
        "POST",
        "/v1/claims",
        raw('{"pool": "demo", "timeout_s": ' + "9" * 5000 + "}"),
        400,
    ),
    ("org wrong type", "POST", "/v1/claims", body(org=123), 422),
    ("pool wrong type", "POST", "/v1/claims", body(pool=["demo"]), 422),
    ("unknown field", "POST", "/v1/claims", body(priority=1), 422),
    ("unknown mode", "POST", "/v1/claims", body(mode="hot"), 422),
    ("negative timeout", "POST", "/v1/claims", body(timeout_s=-1), 422),
    ("huge timeout", "POST", "/v1/claims", body(timeout_s=1e12), 422),
    ("timeout is text", "POST", "/v1/claims", body(timeout_s="soon"), 422),
    ("timeout is a numeric string", "POST", "/v1/claims", body(timeout_s="5"), 422),
    ("lease is a boolean", "POST", "/v1/claims", body(lease_s=True), 422),
    ("ttl is a boolean", "POST", "/v1/claims", body(ttl_s=False), 422),
    (
        "NaN timeout",
        "POST",
        "/v1/claims",
        raw('{"pool": "demo", "org": "a", "timeout_s": NaN}'),
        422,
    ),
    (
        "infinite timeout",
        "POST",
        "/v1/claims",
        raw('{"pool": "demo", "org": "a", "timeout_s": 1e400}'),
        422,
    ),
    ("zero lease", "POST", "/v1/claims", body(lease_s=0), 422),
    ("lease over a day", "POST", "/v1/claims", body(lease_s=86401), 422),
    ("negative ttl", "POST", "/v1/claims", body(ttl_s=-5), 422),
    ("huge integer ttl", "POST", "/v1/claims", body(ttl_s=10**30), 422),
    ("empty pool", "POST", "/v1/claims", body(pool=""), 422),
    ("empty org", "POST", "/v1/claims", body(org=""), 422),
    ("long org", "POST", "/v1/claims", body(org="a" * 129), 422),
    ("NUL in org", "POST", "/v1/claims", body(org="a\x00b"), 422),
    ("newline in org", "POST", "/v1/claims", body(org="a\nb"), 422),
    ("padded org", "POST", "/v1/claims", body(org=" acme "), 422),
    ("lone surrogate in org", "POST", "/v1/claims", raw('{"pool": "demo", "org": "\\ud800"}'), 422),
    ("config is a list", "POST", "/v1/claims", body(config=[1, 2]), 422),
    ("config nested too deep", "POST", "/v1/claims", body(config=deep(40)), 422),
    (
        "NaN in config",
        "POST",
        "/v1/claims",
        raw('{"pool": "demo", "org": "a", "config": {"x": NaN}}'),
        422,
    ),
    (
        "surrogate in config",
        "POST",
        "/v1/claims",
        raw('{"pool": "demo", "org": "a", "config": {"\\udfff": 1}}'),
        422,
    ),
    ("body over 64 KiB", "POST", "/v1/claims", body(config={"blob": "x" * 70_000}), 413),
    ("claim id too long", "GET", "/v1/claims/" + "c" * 129, {}, 422),
    ("renew with bad lease", "POST", "/v1/claims/c-x/renew", {"json": {"lease_s": -1}}, 422),
    ("renew with unknown field", "POST", "/v1/claims/c-x/renew", {"json": {"extend": 5}}, 422),
    ("renew with a list", "POST", "/v1/claims/c-x/renew", {"json": [1]}, 422),
    ("workers limit zero", "GET", "/v1/workers?limit=0", {}, 422),
    ("workers limit text", "GET", "/v1/workers?limit=many", {}, 422),
    ("workers limit huge", "GET", "/v1/workers?limit=99999999999999999999", {}, 422),
    ("workers unknown state", "GET", "/v1/workers?state=sleeping", {}, 422),
    ("wrong method", "PUT", "/v1/claims", {"json": OK_BODY}, 405),
    ("no id to delete", "DELETE", "/v1/claims", {}, 405),
    ("unknown route", "GET", "/v1/clams", {}, 404),
    ("unknown root route", "GET", "/admin", {}, 404),
]


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status"),
    [pytest.param(m, p, k, s, id=name) for name, m, p, k, s in MALFORMED],
)
async def test_malformed_requests_are_rejected_without_effect(
    tmp_path: Path, method: str, path: str, kwargs: dict[str, Any], status: int
) -> None:
    async with running(tmp_path) as api:
        before = await api.snapshot()
        response = await api.http.request(method, path, **kwargs)
        problem = assert_problem(response, status)
        if status == 405:
            assert response.headers["allow"]
        if status == 422 and path == "/v1/claims":
            assert problem["errors"] and all("loc" in e for e in problem["errors"])
        assert await api.snapshot() == before


async def test_a_chunked_body_over_the_limit_is_413(tmp_path: Path) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"pool": "demo", "org": "acme", "config": {"blob": "'
        for _ in range(20):
            yield b"x" * 4096
        yield b'"}}'

    async with running(tmp_path) as api:
        before = await api.snapshot()
        response = await api.http.post(
            "/v1/claims", content=chunks(), headers={"content-type": "application/json"}
        )
        assert assert_problem(response, 413)["code"] == "body-too-large"
        assert await api.snapshot() == before


# The claim routes are `DirectRoute`s: `DirectRoutes` serves their plain requests by calling
# the endpoint itself (stoker.api.routing); whatever it answers must be what the framework
# answers for the same routes. Each case is sent to the app and to the same app without
# `DirectRoutes` (the framework alone), and the answers compared byte for byte.
PARITY: list[tuple[str, str, str, dict[str, Any]]] = [
    *((name, m, p, k) for name, m, p, k, _ in MALFORMED if p.startswith("/v1/claims")),
    ("unknown pool", "POST", "/v1/claims", body(pool="nope")),
    (
        "unknown pool, charset",
        "POST",
        "/v1/claims",
        {
            "content": json.dumps({**OK_BODY, "pool": "nope"}).encode(),
            "headers": {"content-type": "application/json; charset=UTF-8"},
        },
    ),
    (
        "JSON sent as text/plain",
        "POST",
        "/v1/claims",
        {
            "content": json.dumps(OK_BODY).encode(),
            "headers": {"content-type": "text/plain"},
        },
    ),
    (
        "JSON without a content type",
        "POST",
        "/v1/claims",
        {
            "content": json.dumps({**OK_BODY, "pool": "nope"}).encode(),
        },
    ),
    ("JSON nested past the parser's limit", "POST", "/v1/claims", raw("[" * 60_000)),
    ("renewed with JSON nested too deep", "POST", "/v1/claims/c-x/renew", raw("[" * 60_000)),
    ("unknown claim", "GET", "/v1/claims/c-missing", {}),
    ("unknown claim released", "DELETE", "/v1/claims/c-missing", {}),
    ("unknown claim renewed", "POST", "/v1/claims/c-missing/renew", {}),
    ("unknown claim renewed with null", "POST", "/v1/claims/c-missing/renew", raw("null")),
    (
        "renewed with text",
        "POST",
        "/v1/claims/c-missing/renew",
        {
            "content": b'{"lease_s": 30}',
            "headers": {"content-type": "text/plain"},
        },
    ),
    ("trailing slash", "GET", "/v1/claims/c-missing/", {}),
    ("renew with a trailing slash", "POST", "/v1/claims/c-missing/renew/", {}),
    ("id with a slash", "DELETE", "/v1/claims/a/b", {}),
    ("id with a slash, renewed", "POST", "/v1/claims/a/b/renew", {}),
    ("renew by GET", "GET", "/v1/claims/c-missing/renew", {}),
    ("wrong method on a claim", "PUT", "/v1/claims/c-missing", {}),
    ("another prefix", "GET", "/v1/claimsx", {}),
]


def framework_alone(plane: ControlPlane) -> httpx.AsyncClient:
    """A client of an app like `running`'s whose routes are all served by the framework."""
    app = create_app(plane, ApiConfig(), manage_plane=False)
    app.user_middleware = [
        m for m in app.user_middleware if cast(object, m.cls) is not DirectRoutes
    ]
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://stoker")


def same_answer(direct: httpx.Response, framework: httpx.Response) -> None:
    assert direct.status_code == framework.status_code, direct.text
    assert direct.headers.multi_items() == framework.headers.multi_items()
    assert direct.content == framework.content


@pytest.mark.parametrize(
    ("method", "path", "kwargs"), [pytest.param(m, p, k, id=name) for name, m, p, k in PARITY]
)
async def test_claim_routes_answer_as_the_framework_does(
    tmp_path: Path, method: str, path: str, kwargs: dict[str, Any]
) -> None:
    async with running(tmp_path) as api, framework_alone(api.plane) as framework:
        before = await api.snapshot()
        direct = await api.http.request(method, path, **kwargs)
        assert 300 <= direct.status_code < 500, direct.text
        same_answer(direct, await framework.request(method, path, **kwargs))
        assert await api.snapshot() == before


async def test_claims_by_either_route_give_the_same_answers(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(warm_target=2)]) as api, framework_alone(api.plane) as fw:
        answers = {}
        for name, http, org in (("direct", api.http, "acme"), ("framework", fw, "globex")):
            created = await http.post(
                "/v1/claims", json={"pool": "demo", "org": org, "lease_s": 60}
            )
            assert created.status_code == 201, created.text
            claim_id = created.json()["id"]
            assert created.headers["location"] == f"/v1/claims/{claim_id}"
            # A claim just made reads back as it was created (but for the token, in the
            # claim's answer only), by either route.
            made = created.json()
            made["worker"]["token"] = None
            for reader in (api.http, fw):
                got = await reader.get(f"/v1/claims/{claim_id}")
                assert got.status_code == 200 and got.json() == made
            renewed = await http.post(f"/v1/claims/{claim_id}/renew", json={"lease_s": 90})
            assert renewed.json()["expires_at"] > created.json()["expires_at"]
            same_answer(
                await api.http.get(f"/v1/claims/{claim_id}"),
                await fw.get(f"/v1/claims/{claim_id}"),
            )
            assert (await fw.get(f"/v1/claims/{claim_id}")).content == renewed.content
            released = await http.delete(f"/v1/claims/{claim_id}")
            assert released.json()["state"] == "released"
            # Releasing an ended claim returns it unchanged, by either route.
            same_answer(
                await api.http.delete(f"/v1/claims/{claim_id}"),
                await fw.delete(f"/v1/claims/{claim_id}"),
            )
            assert (await api.http.delete(f"/v1/claims/{claim_id}")).content == released.content
            answers[name] = (created, renewed, released)
        # The two claims differ only in what each claim owns: id, org, worker, times.
        for direct, framework in zip(answers["direct"], answers["framework"], strict=True):
            assert direct.status_code == framework.status_code
            assert direct.headers.keys() == framework.headers.keys()
            assert direct.headers["content-type"] == framework.headers["content-type"]
            own = {"id", "org", "worker", "expires_at", "created_at", "ended_at"}
            ours, theirs = direct.json(), framework.json()
            assert ours.keys() == theirs.keys()
            assert {k: v for k, v in ours.items() if k not in own} == {
                k: v for k, v in theirs.items() if k not in own
            }
            assert ours["worker"].keys() == theirs["worker"].keys()


def direct_routes() -> list[DirectRoute]:
    """The direct routes that take a body, of an app that is built and never started."""
    cfg = StokerConfig.model_validate({"store": "sqlite:///:memory:", "pools": [pool()]})
    app = create_app(build_control_plane(cfg, runtime=MemoryRuntime()), cfg.api)
    return [r for r in app.routes if isinstance(r, DirectRoute) and r.body_field is not None]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)
CLAIM_BODIES = st.dictionaries(
    st.sampled_from(["pool", "org", "mode", "timeout_s", "lease_s", "ttl_s", "config", "x"]),
    JSON_VALUES | st.sampled_from(["demo", "acme", "cold", "require_warm", 0, 1, 30.5, 1e9]),
)


@settings(max_examples=300, suppress_health_check=list(HealthCheck), deadline=None)
@given(body=CLAIM_BODIES | JSON_VALUES)
def test_a_direct_route_takes_a_body_as_the_framework_would(body: Any) -> None:
    # What the direct path takes it must take as the framework does (same value), and a
    # body the framework takes should not cost the framework's path.
    raw = json.dumps(body).encode()
    scope = {"headers": [(b"content-type", b"application/json")]}
    for route in DIRECT_ROUTES:
        assert route.body_field is not None
        expected, errors = route.body_field.validate(json.loads(raw), {}, loc=("body",))
        direct = route.parse_body(scope, raw)
        if errors:
            assert direct is DECLINED, (route.path, raw)
        elif b"NaN" not in raw and b"Infinity" not in raw:
            assert direct == expected, (route.path, raw)


DIRECT_ROUTES = direct_routes()


async def test_app_middleware_sees_every_claim_request(tmp_path: Path) -> None:
    seen: dict[str, list[tuple[str, str, int]]] = {"asgi": [], "http": []}

    class Recorder:
        """A plain ASGI middleware, added with `app.add_middleware`."""

        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            async def recording(message: Any) -> None:
                if message["type"] == "http.response.start":
                    seen["asgi"].append((scope["method"], scope["path"], message["status"]))
                await send(message)

            await self.app(scope, receive, recording if scope["type"] == "http" else send)

    async with running(tmp_path, api=TOKENS) as api:
        api.app.add_middleware(Recorder)

        @api.app.middleware("http")
        async def record(request: Any, call_next: Any) -> Any:
            response = await call_next(request)
            seen["http"].append((request.method, request.url.path, response.status_code))
            return response

        admin = {"Authorization": f"Bearer {ADMIN}"}
        created = await api.claim(token=ADMIN)
        claim = f"/v1/claims/{created.json()['id']}"
        requests: list[tuple[str, str, dict[str, Any]]] = [
            ("POST", "/v1/claims", {"json": OK_BODY, "headers": {}}),
            ("POST", "/v1/claims", {"json": {"pool": "nope", "org": "acme"}, "headers": admin}),
            ("POST", "/v1/claims", {"json": {"pool": "demo"}, "headers": admin}),
            ("GET", claim, {"headers": admin}),
            ("GET", "/v1/claims/c-missing", {"headers": admin}),
            ("POST", f"{claim}/renew", {"json": {"lease_s": 30}, "headers": admin}),
            ("POST", f"{claim}/renew", {"json": {"lease_s": -1}, "headers": admin}),
            ("POST", "/v1/claims/c-missing/renew", {"headers": admin}),
            ("DELETE", claim, {"headers": admin}),
            ("DELETE", "/v1/claims/c-missing", {"headers": admin}),
        ]
        statuses = []
        for method, path, kwargs in requests:
            statuses.append((await api.http.request(method, path, **kwargs)).status_code)
        assert statuses == [401, 404, 422, 200, 404, 200, 422, 404, 200, 404]
        expected = [("POST", "/v1/claims", 201)] + [
            (method, path, status)
            for (method, path, _), status in zip(requests, statuses, strict=True)
        ]
        assert seen["asgi"] == expected
        assert seen["http"] == expected


async def test_a_body_just_under_the_limit_is_accepted(tmp_path: Path) -> None:
    async with running(tmp_path) as api:
        filler = "x" * (65536 - 200)
        response = await api.claim(config={"blob": filler})
        assert response.status_code == 201
        assert api.runtime.procs[response.json()["worker"]["id"]].config == {"blob": filler}


# -- disconnects and lifespan ---------------------------------------------------------------


async def _post_then_disconnect(app: StokerApp, payload: dict[str, Any], after: float) -> list[Any]:
    """Send a claim as a raw ASGI request whose client disconnects after `after` seconds."""
    body = json.dumps(payload).encode()
    sent: list[Any] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(after)
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/claims",
        "raw_path": b"/v1/claims",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"stoker")],
        "client": ("127.0.0.1", 40001),
        "server": ("127.0.0.1", 8080),
    }
    await app(scope, receive, send)
    return sent


async def test_a_claim_cut_off_by_the_shutdown_grace_gets_503_shutting_down(
    tmp_path: Path,
) -> None:
    """The server cancels the requests still running when its shutdown grace ends (as
    uvicorn does); a waiting claim answers 503 `shutting_down` as problem JSON, not 500."""
    async with running(tmp_path, [pool(warm_target=0)]) as api:
        payload = {**OK_BODY, "mode": "require_warm", "timeout_s": 600}
        request = asyncio.ensure_future(_post_then_disconnect(api.app, payload, after=3600))
        await asyncio.sleep(2)
        assert api.plane.demand.waiting("demo") == 1
        api.app.api_state.draining = True
        request.cancel("Task cancelled, timeout graceful shutdown exceeded")
        sent = await asyncio.wait_for(request, 10)
        assert sent[0]["status"] == 503
        assert (b"content-type", b"application/problem+json") in sent[0]["headers"]
        body = json.loads(sent[1]["body"])
        assert body["reason"] == "shutting_down" and "shutdown grace" in body["detail"]
        assert api.plane.demand.waiting("demo") == 0


async def test_a_client_that_leaves_while_waiting_leaves_nothing_behind(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(warm_target=0)]) as api:
        payload = {**OK_BODY, "mode": "require_warm", "timeout_s": 60}
        sent = await asyncio.wait_for(_post_then_disconnect(api.app, payload, after=2), 10)
        assert sent[0]["status"] == 499
        assert api.plane.demand.waiting("demo") == 0
        # A warm worker that arrives later stays warm: nobody claims it for the gone client.
        await api.plane.run_janitor_pass()
        await asyncio.sleep(1)
        assert await api.claims() == []
        assert api.plane.book.in_flight() == frozenset()


async def test_a_client_that_leaves_during_a_cold_spawn_gets_no_worker(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(warm_target=0)]) as api:
        api.runtime.ready_delay = 5
        payload = {**OK_BODY, "mode": "cold", "timeout_s": 60}
        sent = await asyncio.wait_for(_post_then_disconnect(api.app, payload, after=1), 10)
        assert sent[0]["status"] == 499
        await asyncio.sleep(10)
        # The spawned worker was given back neutral (never activated): warm, no claim.
        [worker] = await api.plane.store.list_workers(states=[WorkerState.WARM])
        assert worker.org is None and api.runtime.procs[worker.id].activations == 0
        assert await api.claims() == []


async def test_a_client_that_stays_gets_its_claim(tmp_path: Path) -> None:
    async with running(tmp_path) as api:
        sent = await asyncio.wait_for(_post_then_disconnect(api.app, OK_BODY, after=30), 10)
        assert sent[0]["status"] == 201
        [claim] = await api.claims()
        assert claim.state is ClaimState.BOUND


async def _lifespan(app: StokerApp, *events: str) -> list[dict[str, Any]]:
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for event in events:
        queue.put_nowait({"type": event})
    sent: list[dict[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    await app({"type": "lifespan", "asgi": {"version": "3.0"}}, queue.get, send)
    return sent


async def test_lifespan_starts_the_plane_and_leaves_workers_on_shutdown(tmp_path: Path) -> None:
    cfg = StokerConfig.model_validate(
        {"store": f"sqlite:///{tmp_path}/stoker.db", "pools": [pool()]}
    )
    runtime = MemoryRuntime(ready_delay=0.2)
    plane = build_control_plane(cfg, runtime=runtime, activator=runtime)
    app = create_app(plane, cfg.api)
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    sent: list[dict[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    lifespan = asyncio.ensure_future(
        app({"type": "lifespan", "asgi": {"version": "3.0"}}, queue.get, send)
    )
    await queue.put({"type": "lifespan.startup"})
    await asyncio.sleep(1)
    assert sent == [{"type": "lifespan.startup.complete"}]
    assert plane.started and plane.reconciled
    alive = runtime.alive()
    assert len(alive) == 2
    await queue.put({"type": "lifespan.shutdown"})
    await asyncio.wait_for(lifespan, 60)
    assert sent[-1] == {"type": "lifespan.shutdown.complete"}
    assert not plane.started
    assert app.api_state.draining
    # Left running for the next start to adopt.
    assert runtime.alive() == alive


async def test_lifespan_stops_workers_when_asked(tmp_path: Path) -> None:
    cfg = StokerConfig.model_validate(
        {"store": f"sqlite:///{tmp_path}/stoker.db", "pools": [pool()]}
    )
    runtime = MemoryRuntime(ready_delay=0.2)
    plane = build_control_plane(cfg, runtime=runtime, activator=runtime)
    app = create_app(plane, cfg.api, stop_workers=True)
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def send(message: MutableMapping[str, Any]) -> None:
        return None

    lifespan = asyncio.ensure_future(
        app({"type": "lifespan", "asgi": {"version": "3.0"}}, queue.get, send)
    )
    await queue.put({"type": "lifespan.startup"})
    await asyncio.sleep(1)
    assert len(runtime.alive()) == 2
    await queue.put({"type": "lifespan.shutdown"})
    await asyncio.wait_for(lifespan, 60)
    assert runtime.alive() == set()


async def test_a_failed_start_is_reported_in_one_line(tmp_path: Path) -> None:
    cfg = StokerConfig.model_validate(
        {"store": f"sqlite:///{tmp_path}/no/such/dir/stoker.db", "pools": [pool()]}
    )
    runtime = MemoryRuntime()
    plane = build_control_plane(cfg, runtime=runtime, activator=runtime)
    app = create_app(plane, cfg.api)
    sent = await _lifespan(app, "lifespan.startup")
    assert sent == [{"type": "lifespan.startup.failed", "message": ""}]
    error = app.api_state.startup_error
    assert error is not None and "cannot open sqlite store" in error and "\n" not in error


async def test_the_access_log_names_each_request_and_its_caller_never_its_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stoker")
    api_config = ApiConfig(
        admin_tokens=["admin-secret-token-0001"],
        org_tokens={"acme-secret-token-0001": "acme"},
        access_log=True,
    )
    async with running(tmp_path, api=api_config) as api:
        acme = {"Authorization": "Bearer acme-secret-token-0001"}
        created = await api.http.post("/v1/claims", json=OK_BODY, headers=acme)
        assert created.status_code == 201
        await api.http.get(
            "/v1/workers", headers={"Authorization": "Bearer admin-secret-token-0001"}
        )
        await api.http.get("/v1/workers", headers={"Authorization": "Bearer wrong-token-000001"})
    lines = [r.getMessage() for r in caplog.records if "event=http_request" in r.getMessage()]
    assert len(lines) == 3, lines
    assert "method=POST path=/v1/claims status=201" in lines[0] and "org=acme" in lines[0]
    assert "path=/v1/workers status=200" in lines[1] and "admin=True" in lines[1]
    assert "status=401" in lines[2] and "org=" not in lines[2]
    assert not any("secret-token" in line or "wrong-token" in line for line in lines)


async def test_without_the_access_log_no_request_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stoker")
    async with running(tmp_path) as api:
        assert (await api.claim()).status_code == 201
    assert not [r for r in caplog.records if "event=http_request" in r.getMessage()]
