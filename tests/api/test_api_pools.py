"""The stored pool's routes: detail with revisions, PATCH, drain and undrain, over HTTP
(the app in process, a real SQLite store; workers are `MemoryRuntime`'s, no processes;
virtual time)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_api import ACME, ADMIN, TOKENS, assert_problem, pool, running

from stoker.domain.specs import ProcessTemplate, revision_of
from stoker.domain.states import LIVE, WorkerState

pytestmark = pytest.mark.looptime

AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
AS_ACME = {"Authorization": f"Bearer {ACME}"}


async def test_a_pool_shows_its_generation_and_revisions(tmp_path: Path) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        await api.plane.run_janitor_pass()
        response = await api.http.get("/v1/pools/demo", headers=AS_ACME)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["generation"] == 1 and response.headers["etag"] == '"1"'
        assert body["draining"] is False and body["rollout"] is None
        stable = revision_of(ProcessTemplate(argv=("worker", "{port}")))
        (revision,) = body["revisions"]
        assert revision["revision"] == stable == body["revision"]
        assert (revision["state"], revision["share"]) == ("stable", 100)
        assert revision["counts"]["spawning"] + revision["counts"]["warm"] == 2


async def test_a_pool_shows_the_per_org_overrides_its_claims_get(tmp_path: Path) -> None:
    orgs = [
        {"name": "acme", "max_workers": 2, "hot_idle_ttl": 30},
        {"name": "globex", "max_claim_s": 600},
        {"name": "initech"},
    ]
    async with running(tmp_path, api=TOKENS, orgs=orgs) as api:
        response = await api.http.get("/v1/pools/demo", headers=AS_ADMIN)
        assert response.status_code == 200, response.text
        assert response.json()["org_overrides"] == {
            "acme": {"max_workers": 2, "hot_idle_ttl": 30},
            "globex": {"max_claim_s": 600},
        }
        listed = await api.http.get("/v1/pools", headers=AS_ADMIN)
        assert listed.json()["pools"][0]["org_overrides"]["acme"]["max_workers"] == 2
        # An org's token sees its own overrides, never another org's (nor its name).
        for path in ("/v1/pools/demo", "/v1/pools"):
            seen = (await api.http.get(path, headers=AS_ACME)).json()
            detail = seen["pools"][0] if "pools" in seen else seen
            assert detail["org_overrides"] == {"acme": {"max_workers": 2, "hot_idle_ttl": 30}}


async def test_patch_changes_the_settings_the_plane_serves(tmp_path: Path) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        response = await api.http.patch(
            "/v1/pools/demo", json={"warm_target": 4, "lease_s": 30}, headers=AS_ADMIN
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert (body["warm_target"], body["generation"]) == (4, 2)
        assert body["settings"]["lease_s"] == 30
        assert response.headers["etag"] == '"2"'
        served = api.plane.catalog.pool("demo")
        assert (served.warm_target, served.lease_s) == (4, 30)
        await api.plane.run_janitor_pass()
        # A write from the generation read before is stale: 412, nothing changes.
        stale = await api.http.patch(
            "/v1/pools/demo", json={"warm_target": 1}, headers={**AS_ADMIN, "If-Match": '"1"'}
        )
        assert_problem(stale, 412)
        assert api.plane.catalog.pool("demo").warm_target == 4
        fresh = await api.http.patch(
            "/v1/pools/demo", json={"warm_target": 1}, headers={**AS_ADMIN, "If-Match": '"2"'}
        )
        assert fresh.status_code == 200 and fresh.json()["generation"] == 3


async def test_patch_sets_hot_idle_ttl_back_to_the_default_with_null(tmp_path: Path) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        set_ttl = await api.http.patch(
            "/v1/pools/demo", json={"hot_idle_ttl": 300}, headers=AS_ADMIN
        )
        assert set_ttl.json()["settings"]["hot_idle_ttl"] == 300
        # Another setting sent alone (or null for the others) leaves the TTL as it is.
        kept = await api.http.patch(
            "/v1/pools/demo", json={"warm_target": 3, "lease_s": None}, headers=AS_ADMIN
        )
        assert kept.json()["settings"]["hot_idle_ttl"] == 300
        assert kept.json()["settings"]["lease_s"] == 60
        unset = await api.http.patch(
            "/v1/pools/demo", json={"hot_idle_ttl": None}, headers=AS_ADMIN
        )
        assert unset.status_code == 200, unset.text
        assert unset.json()["settings"]["hot_idle_ttl"] is None
        assert api.plane.catalog.pool("demo").hot_idle_ttl is None


async def test_patch_refuses_bad_values_and_callers(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(max_workers=5)], api=TOKENS) as api:
        before = await api.plane.store.get_pool("demo")
        assert_problem(
            await api.http.patch("/v1/pools/demo", json={"warm_target": 2}, headers=AS_ACME), 403
        )
        assert_problem(
            await api.http.patch("/v1/pools/nope", json={"warm_target": 2}, headers=AS_ADMIN), 404
        )
        for bad in (
            {"warm_target": -1},
            {"warm_target": "many"},
            {"lease_s": 0},
            {"image": "x"},
            {"warm_target": 6},  # above max_workers
        ):
            response = await api.http.patch("/v1/pools/demo", json=bad, headers=AS_ADMIN)
            assert response.status_code in (400, 422), (bad, response.text)
            assert_problem(response, response.status_code)
        bad_match = await api.http.patch(
            "/v1/pools/demo", json={"warm_target": 1}, headers={**AS_ADMIN, "If-Match": "x"}
        )
        assert bad_match.status_code in (400, 422)
        assert await api.plane.store.get_pool("demo") == before


async def test_a_drained_pool_refuses_new_claims_until_undrained(tmp_path: Path) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        assert_problem(await api.http.post("/v1/pools/demo/drain", headers=AS_ACME), 403)
        response = await api.http.post("/v1/pools/demo/drain", headers=AS_ADMIN)
        assert response.status_code == 200 and response.json()["draining"] is True
        refused = assert_problem(await api.claim(token=ACME), 503)
        assert "draining" in refused["detail"]
        # Its warm workers retire: the pool keeps no warm target while it drains.
        assert api.plane.catalog.pool("demo").warm_target == 0
        for _ in range(3):
            await api.plane.run_janitor_pass()
            await asyncio.sleep(61)  # past scale_down_delay (virtual time)
        warm = await api.plane.store.list_workers(states=[WorkerState.WARM])
        assert warm == []
        response = await api.http.post("/v1/pools/demo/undrain", headers=AS_ADMIN)
        assert response.status_code == 200 and response.json()["draining"] is False
        assert api.plane.catalog.pool("demo").warm_target == 2
        claimed = await api.claim(token=ACME)
        assert claimed.status_code == 201, claimed.text


async def test_an_admin_deletes_a_drained_pool_gone_from_the_config(tmp_path: Path) -> None:
    """The pool `old`, dropped from the file, is refused while it is not drained and while
    a session holds a worker, then deleted: the replica serves it no more, its claims get
    the unknown pool's 404 and its metrics go."""
    async with running(tmp_path, [pool(), pool("old", warm_target=1)], api=TOKENS) as api:
        await api.plane.run_janitor_pass()
    async with running(tmp_path, api=TOKENS) as api:
        assert "old" in api.plane.catalog.pools  # the store is the truth
        claimed = await api.claim(pool="old", token=ACME)
        assert claimed.status_code == 201, claimed.text
        assert_problem(await api.http.delete("/v1/pools/old", headers=AS_ACME), 403)
        assert_problem(await api.http.delete("/v1/pools/nope", headers=AS_ADMIN), 404)
        in_config = assert_problem(await api.http.delete("/v1/pools/demo", headers=AS_ADMIN), 409)
        assert in_config["reason"] == "in_config" and "config file" in in_config["detail"]
        undrained = assert_problem(await api.http.delete("/v1/pools/old", headers=AS_ADMIN), 409)
        assert undrained["reason"] == "not_draining" and "drain" in undrained["detail"]
        await api.http.post("/v1/pools/old/drain", headers=AS_ADMIN)
        # Another replica reads the drain at its next pass: not deleted before two.
        just = assert_problem(await api.http.delete("/v1/pools/old", headers=AS_ADMIN), 409)
        assert just["reason"] == "just_drained" and "drained" in just["detail"]
        await asyncio.sleep(2 * api.plane.settings.janitor_interval_s)  # virtual time
        busy = assert_problem(await api.http.delete("/v1/pools/old", headers=AS_ADMIN), 409)
        assert busy["reason"] == "in_use" and busy["open_claims"] == 1
        assert busy["live_workers"] >= 1 and "1 open claim" in busy["detail"]
        released = await api.http.delete(f"/v1/claims/{claimed.json()['id']}", headers=AS_ACME)
        assert released.status_code == 200, released.text
        for _ in range(4):
            await api.plane.run_janitor_pass()
            await asyncio.sleep(61)  # past the TTLs and scale_down_delay (virtual time)
        await api.plane.run_janitor_pass()
        assert await api.plane.store.list_workers(pool="old", states=LIVE) == []
        stale = await api.http.delete("/v1/pools/old", headers={**AS_ADMIN, "If-Match": '"1"'})
        assert_problem(stale, 412)
        assert 'pool="old"' in (await api.http.get("/metrics")).text

        deleted = await api.http.delete("/v1/pools/old", headers=AS_ADMIN)

        assert deleted.status_code == 200, deleted.text
        body = deleted.json()
        assert body["name"] == "old" and body["generation"] >= 2
        assert body["removed"]["pools"] == 1 and body["removed"]["revisions"] == 1
        assert "old" not in api.plane.catalog.pools
        assert_problem(await api.http.get("/v1/pools/old", headers=AS_ADMIN), 404)
        listed = (await api.http.get("/v1/pools", headers=AS_ADMIN)).json()["pools"]
        assert [p["name"] for p in listed] == ["demo"]
        unknown = assert_problem(await api.claim(pool="old", token=ACME), 404)
        assert "unknown pool 'old'" in unknown["detail"]
        await api.plane.run_janitor_pass()
        assert 'pool="old"' not in (await api.http.get("/metrics")).text
        assert_problem(await api.http.delete("/v1/pools/old", headers=AS_ADMIN), 404)
