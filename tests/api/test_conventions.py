"""The API's conventions for what it is sent and what it answers (docs/concepts/claims.md).

JSON bodies only (415 otherwise), no key named twice (400), validation errors in stoker's
own words, a 429 whose `Retry-After` follows from what the org holds, and one log line
for each claim refused (429/503) or abandoned by its client. Same harness as test_api:
the real app and SQLite store, `MemoryRuntime` workers, virtual time (looptime).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
from test_api import OK_BODY, _post_then_disconnect, assert_problem, pool, raw, running

from stoker.api.bodies import duplicate_key, is_json
from stoker.api.problems import plain_message

pytestmark = pytest.mark.looptime

#: How the framework's own messages begin: none may reach an answer.
FRAMEWORK_WORDS = ("Input should", "Value error", "Field required", "Extra inputs", "String should")


# -- duplicate keys -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "text", "key"),
    [
        ("/v1/claims", '{"pool": "demo", "org": "acme", "org": "globex"}', "org"),
        ("/v1/claims", '{"pool": "demo", "org": "acme", "config": {"a": 1, "a": 2}}', "a"),
        ("/v1/claims/c-x/renew", '{"lease_s": 1, "lease_s": 600}', "lease_s"),
    ],
)
async def test_a_key_named_twice_is_400_without_effect(
    tmp_path: Path, path: str, text: str, key: str
) -> None:
    async with running(tmp_path) as api:
        before = await api.snapshot()
        body = assert_problem(await api.http.post(path, **raw(text)), 400)
        assert body["code"] == "duplicate-key"
        assert repr(key) in body["detail"]
        assert await api.snapshot() == before


def test_duplicate_keys_are_found_at_any_depth_and_only_in_json() -> None:
    assert duplicate_key(b'{"a": [{"b": 1, "c": {"d": 1, "d": 1}}]}') == "d"
    assert duplicate_key(b'{"a": 1, "b": {"a": 2}}') is None
    assert duplicate_key(b'{"a": 1, "a"') is None  # not JSON: the route says so
    assert duplicate_key(b"[" * 100_000) is None
    assert duplicate_key(b'["a", "a"]') is None


# -- media types ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "media", ["text/plain", "application/x-www-form-urlencoded", "application/xml", "json"]
)
async def test_a_body_that_is_not_json_is_415(tmp_path: Path, media: str) -> None:
    async with running(tmp_path) as api:
        before = await api.snapshot()
        for path in ("/v1/claims", "/v1/claims/c-x/renew"):
            response = await api.http.post(
                path, content=json.dumps(OK_BODY).encode(), headers={"content-type": media}
            )
            body = assert_problem(response, 415)
            assert body["code"] == "unsupported-media-type" and media in body["detail"]
        assert await api.snapshot() == before


@pytest.mark.parametrize(
    "media", ["application/json", "Application/JSON; charset=utf-8", "application/claim+json"]
)
async def test_json_media_types_are_taken(tmp_path: Path, media: str) -> None:
    async with running(tmp_path) as api:
        response = await api.http.post(
            "/v1/claims", content=json.dumps(OK_BODY).encode(), headers={"content-type": media}
        )
        assert response.status_code == 201, response.text


def test_which_media_types_are_json() -> None:
    assert is_json(None) and is_json(b"application/json") and is_json(b"application/x+json")
    assert not is_json(b"text/json") and not is_json(b"application/jsonx")


async def test_a_request_without_a_body_needs_no_content_type(tmp_path: Path) -> None:
    async with running(tmp_path) as api:
        claim = (await api.claim()).json()
        renewed = await api.http.post(
            f"/v1/claims/{claim['id']}/renew", headers={"content-type": "text/plain"}
        )
        assert renewed.status_code == 200, renewed.text


# -- error details --------------------------------------------------------------------------

PLAIN: list[tuple[Any, str]] = [
    ({"pool": "demo"}, "org: is required"),
    ({**OK_BODY, "priority": 1}, "priority: is not a known field"),
    ({**OK_BODY, "org": 123}, "org: must be a string"),
    ({**OK_BODY, "mode": "hot"}, "mode: must be one of 'prefer_warm', 'require_warm' or 'cold'"),
    ({**OK_BODY, "timeout_s": -1}, "timeout_s: must be at least 0"),
    ({**OK_BODY, "timeout_s": 1e12}, "timeout_s: must be at most 3600"),
    ({**OK_BODY, "timeout_s": "5"}, "timeout_s: must be a number"),
    ({**OK_BODY, "lease_s": True}, "lease_s: must be a number"),
    ({**OK_BODY, "org": ""}, "org: must not be empty"),
    ({**OK_BODY, "org": "a" * 129}, "org: must have at most 128 characters"),
    ({**OK_BODY, "org": " acme"}, "org: must be printable, without leading or trailing spaces"),
    ({**OK_BODY, "config": [1]}, "config: must be an object"),
    ([OK_BODY], "body: must be an object"),
]


@pytest.mark.parametrize(("sent", "detail"), PLAIN)
async def test_validation_errors_are_in_plain_words(tmp_path: Path, sent: Any, detail: str) -> None:
    async with running(tmp_path) as api:
        body = assert_problem(await api.http.post("/v1/claims", json=sent), 422)
        assert body["detail"] == detail
        words = [body["detail"], *(e["msg"] for e in body["errors"])]
        assert not [w for w in words if w.startswith(FRAMEWORK_WORDS)], words


async def test_query_errors_are_in_plain_words_too(tmp_path: Path) -> None:
    async with running(tmp_path) as api:
        body = assert_problem(await api.http.get("/v1/workers?limit=0"), 422)
        assert body["detail"] == "query.limit: must be at least 1"


def test_an_unknown_error_type_loses_the_framework_prefix() -> None:
    assert plain_message({"type": "x", "msg": "Input should be blue"}) == "must be blue"
    assert plain_message({"type": "x", "msg": "Value error, too red"}) == "too red"
    assert plain_message({"type": "enum", "msg": "Input should be a", "ctx": {}}) == "must be a"
    assert plain_message({"type": "x"}) == "is invalid"


# -- the 429's Retry-After ------------------------------------------------------------------


async def test_retry_after_is_when_the_org_s_lease_runs_out(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(max_workers_per_org=1)]) as api:
        assert (await api.claim(lease_s=20)).status_code == 201
        await asyncio.sleep(4.1)
        capped = await api.claim(timeout_s=1)
        body = assert_problem(capped, 429)
        # The lease ends 20 s after the claim; 5.1 s of it have gone by.
        assert 14 <= body["retry_after"] <= 15.5, body
        # To the millisecond, as docs/concepts/claims.md says (it was 26.013000011444092).
        assert body["retry_after"] == round(body["retry_after"], 3), body
        assert capped.headers["retry-after"] == str(math.ceil(body["retry_after"]))


async def test_retry_after_is_when_the_org_s_idle_worker_expires(tmp_path: Path) -> None:
    async with running(
        tmp_path, [pool(max_workers_per_org=1, reuse="same_org", hot_idle_ttl=30)]
    ) as api:
        claim = (await api.claim()).json()
        assert (await api.http.delete(f"/v1/claims/{claim['id']}")).status_code == 200
        await asyncio.sleep(10)
        # A cold claim does not reuse the parked worker, which still counts against the cap.
        capped = await api.claim(mode="cold", timeout_s=1)
        body = assert_problem(capped, 429)
        assert 18 <= body["retry_after"] <= 20, body


async def test_retry_after_is_bounded_by_the_configured_longest(tmp_path: Path) -> None:
    async with running(
        tmp_path, [pool(max_workers_per_org=1)], intervals={"org_cap_retry_after_s": 10}
    ) as api:
        assert (await api.claim(lease_s=3600)).status_code == 201
        capped = await api.claim(timeout_s=1)
        assert assert_problem(capped, 429)["retry_after"] == 10
        assert capped.headers["retry-after"] == "10"


# -- log lines of refused and abandoned claims ----------------------------------------------


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    return [
        dict(r.stoker_fields)  # type: ignore[attr-defined]
        for r in caplog.records
        if getattr(r, "stoker_event", None) == name
    ]


async def test_refused_claims_are_logged_with_org_pool_and_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stoker")
    async with running(tmp_path, [pool(max_workers_per_org=1, warm_target=1)]) as api:
        granted = (await api.claim()).json()
        assert_problem(await api.claim(timeout_s=1), 429)
        assert_problem(await api.claim(org="globex", mode="require_warm", timeout_s=1), 503)
        [capped] = [e for e in events(caplog, "claim_refused") if e["status"] == 429]
        assert capped["org"] == "acme" and capped["pool"] == "demo"
        assert capped["reason"] == "org_cap" and capped["retry_after_s"] >= 1
        [empty] = [e for e in events(caplog, "claim_refused") if e["status"] == 503]
        assert empty["org"] == "globex" and empty["reason"] == "no_capacity"
        assert empty["waited_s"] >= 1
        # A client's own mistake is not a refusal.
        assert_problem(await api.claim(pool="nope"), 404)
        assert len(events(caplog, "claim_refused")) == 2
    assert granted["worker"]["token"] not in caplog.text


async def test_an_abandoned_claim_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stoker")
    async with running(tmp_path, [pool(warm_target=0)]) as api:
        payload = {**OK_BODY, "mode": "require_warm", "timeout_s": 60}
        sent = await asyncio.wait_for(_post_then_disconnect(api.app, payload, after=2), 10)
        assert sent[0]["status"] == 499
    [gone] = events(caplog, "claim_abandoned")
    assert gone["org"] == "acme" and gone["pool"] == "demo" and gone["waited_s"] >= 2
