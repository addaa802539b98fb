"""The rollout routes over HTTP (the app in process, a real SQLite store; workers are
`MemoryRuntime`'s: no process is needed to route a claim)."""

from __future__ import annotations

from pathlib import Path

from test_api import ACME, ADMIN, TOKENS, assert_problem, running

from stoker.domain.specs import ProcessTemplate, revision_of

AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
AS_ACME = {"Authorization": f"Bearer {ACME}"}
NEW = {"command": ["worker", "--v2", "{port}"]}
CANARY = {"kind": "canary", "steps": [10, 50, 100], "step_interval_s": 30}


async def test_a_rollout_starts_reads_pauses_resumes_and_promotes(tmp_path: Path) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        started = await api.http.post(
            "/v1/pools/demo/rollouts",
            json={"template": NEW, "strategy": CANARY},
            headers=AS_ADMIN,
        )
        assert started.status_code == 201, started.text
        body = started.json()
        new = revision_of(ProcessTemplate(argv=("worker", "--v2", "{port}")))
        assert body["revision"] == new and body["state"] == "ramping"
        # Its first step takes effect once the new revision holds its warm workers.
        assert body["share"] == 0 and body["strategy"]["steps"] == [10, 50, 100]
        url = f"/v1/pools/demo/rollouts/{body['id']}"
        read = await api.http.get(url, headers=AS_ADMIN)
        assert read.status_code == 200 and read.json()["id"] == body["id"]
        pool = (await api.http.get("/v1/pools/demo", headers=AS_ADMIN)).json()
        shares = {r["revision"]: (r["state"], r["share"]) for r in pool["revisions"]}
        assert shares[new] == ("ramping", 0)
        for action, state in (("pause", "paused"), ("resume", "ramping")):
            moved = await api.http.post(f"{url}/{action}", headers=AS_ADMIN)
            assert moved.status_code == 200, moved.text
            assert moved.json()["state"] == state
        promoted = await api.http.post(f"{url}/promote", headers=AS_ADMIN)
        assert promoted.json()["state"] == "promoted"
        assert api.plane.catalog.pool("demo").revision == new
        # It has ended: every action is a conflict.
        for action in ("pause", "resume", "abort", "promote"):
            assert_problem(await api.http.post(f"{url}/{action}", headers=AS_ADMIN), 409)


async def test_rollouts_refuse_bad_input_and_org_tokens(tmp_path: Path) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        url = "/v1/pools/demo/rollouts"
        assert_problem(await api.http.post(url, json={"template": NEW}, headers=AS_ACME), 403)
        assert_problem(
            await api.http.post(
                "/v1/pools/nope/rollouts", json={"template": NEW}, headers=AS_ADMIN
            ),
            404,
        )
        for steps in ([50, 10], [0, 100], [10, 101], [10, 10]):
            strategy = {"kind": "canary", "steps": steps}
            bad = await api.http.post(
                url, json={"template": NEW, "strategy": strategy}, headers=AS_ADMIN
            )
            assert_problem(bad, 422)
        assert_problem(
            await api.http.post(url, json={"template": {"command": 5}}, headers=AS_ADMIN), 422
        )
        assert_problem(await api.http.get(f"{url}/ro-nope", headers=AS_ADMIN), 404)
        assert_problem(await api.http.post(f"{url}/ro-nope/abort", headers=AS_ADMIN), 404)
        assert await api.plane.store.list_rollouts() == []
