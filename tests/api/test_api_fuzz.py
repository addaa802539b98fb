"""Property-based fuzzing of the API from its own OpenAPI document (schemathesis).

Schemathesis reads `/openapi.json` from a running server and sends requests that fit the
schema and requests that break it, on every operation. No answer may be a 5xx, and every
answer must match what the document declares (status, media type, body schema, headers);
malformed requests must be rejected. The server is the real app on uvicorn in a thread,
with `MemoryRuntime` workers (tests/fakes.py): a fuzzer's claims would otherwise start
hundreds of worker processes, and the subject here is the HTTP layer.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from fakes import MemoryRuntime
from stoker.api import create_app
from stoker.api.server import bind, bound_url
from stoker.bootstrap import build_control_plane
from stoker.config import StokerConfig

ADMIN = "fuzz-admin-token-0123456789"
#: Examples per operation and generation mode; keeps the whole run well under a minute.
EXAMPLES = 40


def config(store: str) -> StokerConfig:
    return StokerConfig.model_validate(
        {
            "store": store,
            "api": {"admin_tokens": [ADMIN], "org_tokens": {"fuzz-org-token-0123456789": "acme"}},
            # A fast janitor: a require_warm claim waits for demand to spawn a worker.
            "intervals": {"janitor_interval_s": 0.05, "shutdown_grace_s": 2},
            "pools": [
                {"name": "demo", "command": ["w"], "warm_target": 2, "lease_s": 30},
                {"name": "capped", "command": ["w"], "warm_target": 0, "max_workers": 1},
            ],
        }
    )


class ThreadedServer:
    """The app on uvicorn, in a thread with its own event loop."""

    def __init__(self, tmp: Path) -> None:
        config_ = config(f"sqlite:///{tmp}/stoker.db")
        runtime = MemoryRuntime(ready_delay=0.0)
        plane = build_control_plane(config_, runtime=runtime, activator=runtime)
        self.app = create_app(plane, config_.api, stop_workers=True)
        self.sock = bind("127.0.0.1", 0)
        self.url = bound_url(self.sock)
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, lifespan="on", log_config=None, access_log=False)
        )
        self.thread = threading.Thread(target=self._run, name="fuzz-server", daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.perf_counter() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.perf_counter() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        assert not self.thread.is_alive(), "server did not stop"


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    with ThreadedServer(tmp_path_factory.mktemp("fuzz")) as server:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
            for i in range(6):
                response = http.post("/v1/claims", json={"pool": "demo", "org": f"org-{i}"})
                assert response.status_code == 201, response.text
                CLAIM_IDS.append(response.json()["id"])
        yield server


def openapi_document() -> dict[str, object]:
    """The document the server serves (the app is built, never started, for it)."""
    document_config = config("sqlite:///:memory:")
    runtime = MemoryRuntime()
    plane = build_control_plane(document_config, runtime=runtime, activator=runtime)
    return create_app(plane, document_config.api).openapi()


schema = schemathesis.openapi.from_dict(openapi_document())
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
    max_examples=EXAMPLES,
    # Tokens come from the tests (below), not from the generator.
    with_security_parameters=False,
)
# 503 is the documented answer of a claim that found no worker within its timeout (which a
# valid claim may set to 0); the tests below still fail on any other 5xx, and on a 503 that
# is not that answer.
schema.config.checks.not_a_server_error.expected_statuses = ["2xx", "3xx", "4xx", "503"]

#: Pools of the fuzzed server.
POOLS = ["demo", "capped"]
#: Ids of claims made on the fuzzed server before the fuzzing (filled by `fuzz_server`).
CLAIM_IDS: list[str] = []


@schema.hook
def map_case(
    context: schemathesis.HookContext, case: schemathesis.Case[Any]
) -> schemathesis.Case[Any]:
    """Aim two in three valid claims at a real pool, and keep their waits short.

    Random pool names are almost never a configured pool, and random claim ids never an
    existing claim, so without this no claim would ever be bound and the answers about
    real claims would go untested. Waits are clamped because a valid claim may ask for up
    to an hour, and the fuzzer's claims hold the `capped` pool's only worker.
    """
    meta = case.meta
    positive = meta is not None and meta.generation.mode.is_positive
    params = case.path_parameters
    if positive and CLAIM_IDS and params and isinstance(params.get("claim_id"), str):
        claim_id = params["claim_id"]
        if len(claim_id) % 3:
            params["claim_id"] = CLAIM_IDS[len(claim_id) % len(CLAIM_IDS)]
    if positive and params and isinstance(params.get("name"), str) and len(params["name"]) % 3:
        params["name"] = POOLS[len(params["name"]) % 2]
    if positive and case.path == "/v1/claims" and isinstance(case.body, dict):
        pool = case.body.get("pool")
        if isinstance(pool, str) and len(pool) % 3:
            case.body["pool"] = POOLS[len(pool) % 3 - 1]
        timeout = case.body.get("timeout_s")
        if not isinstance(timeout, int | float) or timeout > 1:
            case.body["timeout_s"] = 1
    return case


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


def assert_not_a_fault(response: schemathesis.Response) -> None:
    """No 5xx but the documented "no worker within the timeout" 503."""
    if response.status_code < 500:
        return
    assert response.status_code == 503, response.text
    problem = response.json()
    assert problem["code"] == "no-capacity", problem
    assert problem["reason"] in ("no_capacity", "pool_cap"), problem


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=EXAMPLES)
def test_the_api_answers_every_generated_request_within_its_schema(
    case: schemathesis.Case[Any], fuzz_server: ThreadedServer
) -> None:
    response = case.call(
        base_url=fuzz_server.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30
    )
    case.validate_response(response, checks=CHECKS)
    assert_not_a_fault(response)
    if response.status_code >= 400:
        assert response.headers["content-type"] == ["application/problem+json"]
        assert "Traceback" not in response.text


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=10)
def test_unauthenticated_requests_are_refused(
    case: schemathesis.Case[Any], fuzz_server: ThreadedServer
) -> None:
    response = case.call(base_url=fuzz_server.url, timeout=30)
    case.validate_response(response, checks=CHECKS)
    if case.path.startswith("/v1/"):
        assert response.status_code == 401, response.text
