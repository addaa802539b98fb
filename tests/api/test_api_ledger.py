"""`GET /v1/pools/{name}/ledger` and `GET /v1/claims/log` (docs/warmth.md, docs/claim-log.md):
what they answer after real claims, their refusals, and generated bad input (schemathesis,
from the OpenAPI document), which is never a 5xx. The server is the real app on uvicorn in a
thread with `MemoryRuntime` workers, as in test_api_fuzz.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from test_api_fuzz import ADMIN, ThreadedServer, openapi_document

T = TypeVar("T")
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
AS_ORG = {"Authorization": "Bearer fuzz-org-token-0123456789"}
#: The export's keys, fixed (docs/claim-log.md).
EXPORT_KEYS = {"at", "pool", "org", "mode", "source", "wait_s", "held_s", "outcome", "revision"}


class LedgerServer(ThreadedServer):
    """The server, with its event loop at hand to flush the ledger on."""

    loop: asyncio.AbstractEventLoop
    tokens: list[str]

    def _run(self) -> None:
        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve(sockets=[self.sock])

        asyncio.run(serve())

    def call(self, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` on the server's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LedgerServer]:
    """A server with two sessions held and released and one refused claim, flushed."""
    srv = LedgerServer(tmp_path_factory.mktemp("ledger-api"))
    with srv, httpx.Client(base_url=srv.url, headers=AS_ADMIN, timeout=30) as http:
        tokens = []
        for org in ("acme", "globex"):
            made = http.post("/v1/claims", json={"pool": "demo", "org": org, "timeout_s": 5})
            assert made.status_code == 201, made.text
            tokens.append(made.json()["worker"]["token"])
            assert http.delete(f"/v1/claims/{made.json()['id']}").status_code == 200
        held = http.post("/v1/claims", json={"pool": "capped", "org": "acme", "timeout_s": 5})
        assert held.status_code == 201, held.text
        refused = http.post(
            "/v1/claims",
            json={"pool": "capped", "org": "globex", "timeout_s": 0, "mode": "cold"},
        )
        assert refused.status_code == 503, refused.text
        srv.tokens = [*tokens, held.json()["worker"]["token"]]
        plane = srv.app.plane
        srv.call(plane.ledger.flush(plane.store))
        yield srv


def test_the_ledger_sums_the_pools_claims_by_org(server: LedgerServer) -> None:
    with httpx.Client(base_url=server.url, headers=AS_ADMIN, timeout=30) as http:
        answer = http.get("/v1/pools/demo/ledger", params={"since": "1h", "by": "org"})
        assert answer.status_code == 200, answer.text
        body = answer.json()
    total = body["total"]
    assert total["claims_warm"] + total["claims_reuse"] + total["claims_cold"] == 2
    assert total["warm_s"] > 0 and total["spawns"] >= 2
    assert {row["group"] for row in body["rows"]} >= {"acme", "globex"}
    assert len(body["total"]["ready_hist"]) == len(body["spawn_buckets"]) + 1


def test_the_claim_log_pages_in_the_export_form_without_tokens(server: LedgerServer) -> None:
    entries: list[dict[str, Any]] = []
    after = None
    with httpx.Client(base_url=server.url, headers=AS_ADMIN, timeout=30) as http:
        while True:
            params: dict[str, Any] = {"since": "1h", "limit": 1}
            if after:
                params["after"] = after
            page = http.get("/v1/claims/log", params=params)
            assert page.status_code == 200, page.text
            entries += page.json()["entries"]
            after = page.json()["next"]
            if after is None:
                break
            text = page.text
            assert all(token not in text for token in server.tokens)
    assert all(set(e) == EXPORT_KEYS for e in entries)
    assert [e["at"] for e in entries] == sorted(e["at"] for e in entries)
    outcomes = sorted(e["outcome"] for e in entries)
    assert outcomes == ["no_capacity", "open", "released", "released"]
    assert "token" not in json.dumps(entries)


@pytest.mark.parametrize(
    ("path", "params", "status"),
    [
        ("/v1/pools/demo/ledger", {"since": "yesterday"}, 400),
        ("/v1/pools/demo/ledger", {"since": "1h", "until": "2h"}, 400),
        ("/v1/pools/demo/ledger", {"since": "400d"}, 400),
        ("/v1/pools/demo/ledger", {"by": "tenant"}, 422),
        ("/v1/pools/nope/ledger", {}, 404),
        ("/v1/claims/log", {"since": "nan"}, 400),
        # An empty value is no time (nor the default window), and no pool (nor every one).
        ("/v1/pools/demo/ledger", {"since": ""}, 400),
        ("/v1/pools/demo/ledger", {"until": ""}, 400),
        ("/v1/claims/log", {"since": ""}, 400),
        ("/v1/claims/log", {"pool": ""}, 422),
        ("/v1/claims/log", {"after": "not-a-cursor"}, 422),
        ("/v1/claims/log", {"limit": 0}, 422),
    ],
)
def test_bad_input_is_a_problem(
    server: LedgerServer, path: str, params: dict[str, Any], status: int
) -> None:
    answer = httpx.get(server.url + path, params=params, headers=AS_ADMIN, timeout=30)
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/problem+json"


def test_an_org_token_reads_neither(server: LedgerServer) -> None:
    for path in ("/v1/pools/demo/ledger", "/v1/claims/log"):
        assert httpx.get(server.url + path, headers=AS_ORG, timeout=30).status_code == 403


schema = schemathesis.openapi.from_dict(openapi_document()).include(
    method="GET", path_regex=r"^/v1/(pools/\{name\}/ledger|claims/log)$"
)
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
    max_examples=50,
    with_security_parameters=False,
)


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=50)
def test_generated_input_is_never_a_server_error(
    case: schemathesis.Case[Any], server: LedgerServer
) -> None:
    response = case.call(base_url=server.url, headers=AS_ADMIN, timeout=30)
    case.validate_response(
        response,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
            negative_data_rejection,
        ],
    )
    if response.status_code >= 400:
        assert response.headers["content-type"] == ["application/problem+json"]
