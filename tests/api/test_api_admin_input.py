"""An admin's bad input on the pool and rollout routes (issue #25): each case refused in
stoker's words before anything is stored, and nothing accepted that a janitor pass or a
spawn would trip over later. The app in process, a real SQLite store, `MemoryRuntime`
workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from test_api import ADMIN, TOKENS, Api, assert_problem, pool, running

from stoker.config.changes import changed_template
from stoker.domain.specs import ProcessTemplate, revision_of

AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
ROLLOUTS = "/v1/pools/demo/rollouts"
#: What no answer may show: Python's internals and stoker's own class names.
INTERNALS = (
    "__init__",
    "Traceback",
    "object has no attribute",
    "ProcessTemplate",
    "PodTemplate",
    "ProcessConfig",
    "PodConfig",
    "PoolSpec",
    "StoredPool",
    "TypeError",
    "KeyError",
    "OverflowError",
)


def assert_plain(response: httpx.Response) -> None:
    """The answer speaks stoker's words only."""
    for word in INTERNALS:
        assert word not in response.text, (word, response.text)


def refused(response: httpx.Response, status: int, *fields: str) -> dict[str, Any]:
    """A problem of `status` in plain words, naming each of `fields` (as `a.b`)."""
    problem = assert_problem(response, status)
    assert_plain(response)
    for name in fields:
        assert name in problem["detail"] or any(
            ".".join(str(p) for p in e["loc"]).endswith(name) for e in problem.get("errors") or ()
        ), (name, problem)
    return problem


async def assert_fleet_unharmed(api: Api) -> None:
    """No rollout was stored, the stored templates are all valid under the model, and a
    janitor pass fails for no pool."""
    assert await api.plane.store.list_rollouts() == []
    await assert_stored_templates_valid(api)
    await api.plane.run_janitor_pass()
    assert api.plane.janitor.faults.failing(at_least=1) == []
    assert api.plane.pools.broken == {}
    assert api.plane.catalog.pool("demo").revision == STABLE


async def assert_stored_templates_valid(api: Api) -> None:
    """Every template the store holds passes the template model as it is."""
    for stored in await api.plane.store.list_pools():
        for revision in await api.plane.store.list_revisions(stored.name):
            assert changed_template(revision.template, {}) == revision.template


STABLE = revision_of(ProcessTemplate(argv=("worker", "{port}")))


# -- "One mistyped admin request stops the fleet's janitor" --------------------------------


async def test_a_rollout_with_memory_mb_as_text_is_a_422_and_the_janitor_goes_on(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        for bad in ("x", "64", True, 0, 2**70, 1.5):
            response = await api.http.post(
                ROLLOUTS, json={"template": {"memory_mb": bad}}, headers=AS_ADMIN
            )
            refused(response, 422, "memory_mb")
        await assert_fleet_unharmed(api)
        counts = await api.plane.store.count_workers()
        assert sum(c.count for c in counts if c.pool == "demo") == 2


# -- `{"template": {"env": {"A": 1}}}` and the argv cases ------------------------------------


@pytest.mark.parametrize(
    ("template", "field"),
    [
        ({"env": {"A": 1}}, "env.A"),
        ({"env": "x"}, "env"),
        ({"env": {"A=B": "1"}}, "env"),
        ({"env": {"A": "a\u0000b"}}, "env.A"),
        ({"command": "python"}, "command"),
        ({"command": []}, "command"),
        ({"command": [""]}, "command.0"),
        ({"command": ["python", 3]}, "command.1"),
        ({"cwd": ""}, "cwd"),
        ({"image": "x"}, "image"),
    ],
)
async def test_a_template_that_could_not_spawn_is_a_422(
    tmp_path: Path, template: dict[str, Any], field: str
) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        response = await api.http.post(ROLLOUTS, json={"template": template}, headers=AS_ADMIN)
        refused(response, 422, field)
        await assert_fleet_unharmed(api)


# -- "Two vocabularies" ---------------------------------------------------------------------


async def test_command_is_the_template_s_command_line_and_argv_a_422_naming_it(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        argv = await api.http.post(
            ROLLOUTS, json={"template": {"argv": ["worker", "--v2"]}}, headers=AS_ADMIN
        )
        problem = refused(argv, 422, "argv")
        assert "`command`" in problem["detail"]
        assert await api.plane.store.list_rollouts() == []
        started = await api.http.post(
            ROLLOUTS, json={"template": {"command": ["worker", "--v2", "{port}"]}}, headers=AS_ADMIN
        )
        assert started.status_code == 201, started.text
        new = revision_of(ProcessTemplate(argv=("worker", "--v2", "{port}")))
        assert started.json()["revision"] == new
        await assert_stored_templates_valid(api)
        await api.plane.run_janitor_pass()
        assert api.plane.janitor.faults.failing(at_least=1) == []


# -- "Loose types and edges on the pool routes" ---------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"warm_target": True}, "warm_target"),
        ({"warm_target": "3"}, "warm_target"),
        ({"max_workers": 2.5}, "max_workers"),
        ({"lease_s": 0.001}, "lease_s"),
        ({"lease_s": "30"}, "lease_s"),
        ({"hot_idle_ttl": False}, "hot_idle_ttl"),
        ({"warm_target": 1, "generation": 9223372036854775808}, "generation"),
        ({"warm_target": 1, "generation": True}, "generation"),
    ],
)
async def test_patch_refuses_loose_types_and_numbers_out_of_range(
    tmp_path: Path, body: dict[str, Any], field: str
) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        before = await api.plane.store.get_pool("demo")
        response = await api.http.patch("/v1/pools/demo", json=body, headers=AS_ADMIN)
        refused(response, 422, field)
        assert await api.plane.store.get_pool("demo") == before


@pytest.mark.parametrize("if_match", ["9" * 20, '"18446744073709551616"', "1" * 5000, "0", "x"])
async def test_an_if_match_that_names_no_generation_is_a_400_on_every_write(
    tmp_path: Path, if_match: str
) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        before = await api.plane.store.get_pool("demo")
        headers = {**AS_ADMIN, "If-Match": if_match}
        writes = [
            api.http.patch("/v1/pools/demo", json={"warm_target": 3}, headers=headers),
            api.http.post("/v1/pools/demo/drain", headers=headers),
            api.http.post(ROLLOUTS, json={"template": {"env": {"V": "2"}}}, headers=headers),
        ]
        for write in writes:
            refused(await write, 400, "If-Match")
        assert await api.plane.store.get_pool("demo") == before
        assert await api.plane.store.list_rollouts() == []


async def test_unknown_strategy_keys_are_a_422(tmp_path: Path) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        for strategy, field in (
            ({"kind": "canary", "step": [10, 100]}, "step"),
            ({"kind": "canary", "steps": [10, 100], "interval": 5}, "interval"),
            ({"kind": "replace", "steps": [10, 100]}, "strategy.steps"),
            ({"kind": "canary", "steps": [True, 100]}, "steps.0"),
            ({"kind": "canary", "steps": ["10", 100]}, "steps.0"),
            ({"kind": "canary", "step_interval_s": "60"}, "step_interval_s"),
            ({"kind": "blue-green"}, "kind"),
        ):
            response = await api.http.post(
                ROLLOUTS,
                json={"template": {"env": {"V": "2"}}, "strategy": strategy},
                headers=AS_ADMIN,
            )
            refused(response, 422, field)
        assert await api.plane.store.list_rollouts() == []


async def test_a_strategy_problem_is_located_at_its_own_key(tmp_path: Path) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        for strategy, loc, detail in (
            (
                {"kind": "canary", "steps": [50, 10]},
                ["body", "strategy", "steps", 1],
                "strategy.steps.1: must exceed the step before (50)",
            ),
            (
                {"kind": "replace", "step_interval_s": 5},
                ["body", "strategy", "step_interval_s"],
                "strategy.step_interval_s: is for a canary rollout only",
            ),
        ):
            response = await api.http.post(
                ROLLOUTS,
                json={"template": {"env": {"V": "2"}}, "strategy": strategy},
                headers=AS_ADMIN,
            )
            problem = refused(response, 422)
            assert problem["detail"] == detail
            assert [e["loc"] for e in problem["errors"]] == [loc]
        assert await api.plane.store.list_rollouts() == []


async def test_rollout_routes_honour_if_match(tmp_path: Path) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        body = {"template": {"env": {"V": "2"}}, "strategy": {"kind": "canary"}}
        stale = await api.http.post(ROLLOUTS, json=body, headers={**AS_ADMIN, "If-Match": '"7"'})
        refused(stale, 412)
        assert await api.plane.store.list_rollouts() == []
        started = await api.http.post(ROLLOUTS, json=body, headers={**AS_ADMIN, "If-Match": '"1"'})
        assert started.status_code == 201, started.text
        url = f"{ROLLOUTS}/{started.json()['id']}"
        stored = await api.plane.store.get_pool("demo")
        assert stored is not None and stored.generation == 2
        generation = stored.generation
        for action in ("pause", "resume", "abort", "promote"):
            moved = await api.http.post(f"{url}/{action}", headers={**AS_ADMIN, "If-Match": '"1"'})
            refused(moved, 412)
        rollout = await api.plane.store.get_rollout(started.json()["id"])
        assert rollout is not None and rollout.state == "ramping"
        paused = await api.http.post(
            f"{url}/pause", headers={**AS_ADMIN, "If-Match": f'"{generation}"'}
        )
        assert paused.status_code == 200 and paused.json()["state"] == "paused", paused.text


async def test_a_rollout_of_the_template_served_or_rolling_out_is_a_409(tmp_path: Path) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        same = await api.http.post(
            ROLLOUTS, json={"template": {"command": ["worker", "{port}"]}}, headers=AS_ADMIN
        )
        problem = refused(same, 409)
        assert "serves this template already" in problem["detail"]
        assert await api.plane.store.list_rollouts() == []
        body = {"template": {"env": {"V": "2"}}}
        started = await api.http.post(ROLLOUTS, json=body, headers=AS_ADMIN)
        assert started.status_code == 201, started.text
        again = refused(await api.http.post(ROLLOUTS, json=body, headers=AS_ADMIN), 409)
        assert started.json()["id"] in again["detail"]
        back = refused(await api.http.post(ROLLOUTS, json=same_as_stable(), headers=AS_ADMIN), 409)
        assert "abort" in back["detail"]
        assert [r.id for r in await api.plane.store.list_rollouts()] == [started.json()["id"]]


def same_as_stable() -> dict[str, Any]:
    """A rollout body whose template is the stable one, spelled out."""
    return {"template": {"command": ["worker", "{port}"], "env": {}, "memory_mb": 64}}


async def test_a_write_that_changes_nothing_keeps_the_generation(tmp_path: Path) -> None:
    async with running(tmp_path, api=TOKENS) as api:
        for body in ({"warm_target": 2}, {"lease_s": 60, "warm_target": 2}, {"lease_s": None}):
            response = await api.http.patch("/v1/pools/demo", json=body, headers=AS_ADMIN)
            assert response.status_code == 200, response.text
            assert response.json()["generation"] == 1 and response.headers["etag"] == '"1"'
        undrained = await api.http.post("/v1/pools/demo/undrain", headers=AS_ADMIN)
        assert undrained.status_code == 200 and undrained.json()["generation"] == 1
        # A change from a stale generation is still a 412, even when it would change nothing.
        changed = await api.http.patch("/v1/pools/demo", json={"warm_target": 3}, headers=AS_ADMIN)
        assert changed.json()["generation"] == 2
        stale = await api.http.patch(
            "/v1/pools/demo", json={"warm_target": 3}, headers={**AS_ADMIN, "If-Match": '"1"'}
        )
        refused(stale, 412)
        same = await api.http.patch(
            "/v1/pools/demo", json={"warm_target": 3}, headers={**AS_ADMIN, "If-Match": "*"}
        )
        assert same.status_code == 200 and same.json()["generation"] == 2


async def test_settings_that_do_not_fit_together_are_a_422(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(max_workers=5)], api=TOKENS) as api:
        before = await api.plane.store.get_pool("demo")
        above = await api.http.patch("/v1/pools/demo", json={"warm_target": 6}, headers=AS_ADMIN)
        assert "exceeds max_workers" in refused(above, 422)["detail"]
        assert await api.plane.store.get_pool("demo") == before


async def test_the_checks_above_catch_a_template_stored_around_the_api(tmp_path: Path) -> None:
    # What these tests rely on: a template the model refuses, written to the store as the
    # API once let through, fails `assert_stored_templates_valid`.
    async with running(tmp_path, api=TOKENS) as api:
        stored = await api.plane.pools.get("demo")
        bad = ProcessTemplate(argv=("worker",), env={"A": 1})  # type: ignore[dict-item]
        await api.plane.pools.propose(stored, bad, now=api.plane.clock.now())
        with pytest.raises(ValidationError):
            await assert_stored_templates_valid(api)
