"""Generated bad input on every admin write route (issue #25), from the OpenAPI document.

Schemathesis sends requests that fit the document and requests that break it to each
route that changes a pool: `PATCH /v1/pools/{name}`, drain and undrain, starting a rollout
and every action on one. No answer may be a 5xx or show Python's internals or stoker's
class names, and nothing accepted may fail later: after every write that was accepted a
janitor pass runs through, every template in the store passes the template model as it
is, and each stored template's command line, environment and directory are handed to exec
(its program swapped for `true`: a fuzzer's programs are not run) and refused for no
reason of their form. The server is the real app on uvicorn in a thread with
`MemoryRuntime` workers, as in test_api_fuzz.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections import Counter
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    status_code_conformance,
)
from test_api_fuzz import ADMIN, ThreadedServer, openapi_document

from stoker.adapters.runtime_local._processes import start_process, substitute, worker_environment
from stoker.config.changes import changed_template
from stoker.domain.errors import RuntimeFailure
from stoker.domain.specs import ProcessTemplate, RuntimeTemplate

T = TypeVar("T")
#: Examples per route and generation mode.
EXAMPLES = 60
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
#: What no answer may show: Python's internals and stoker's own class names.
INTERNALS = (
    "__init__",
    "Traceback",
    "object has no attribute",
    "unexpected keyword argument",
    "not supported between instances",
    "ProcessTemplate",
    "PodTemplate",
    "ProcessConfig",
    "PodConfig",
    "TolerationConfig",
    "RolloutConfig",
    "PoolSpec",
    "StoredPool",
    "CanaryStrategy",
)
POOLS = ["demo", "capped"]
#: Requests sent, by route and class of answer (printed at the end of the module).
CALLS: Counter[tuple[str, str, int]] = Counter()
#: Rollouts started on the server (before the sweep and by it): what actions aim at.
ROLLOUT_IDS: list[str] = []


class AdminServer(ThreadedServer):
    """The fuzzed server, with its event loop at hand to run the plane's passes on."""

    loop: asyncio.AbstractEventLoop

    def _run(self) -> None:
        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve(sockets=[self.sock])

        asyncio.run(serve())

    def call(self, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` on the server's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout=60)


@pytest.fixture(scope="module")
def admin_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AdminServer]:
    server = AdminServer(tmp_path_factory.mktemp("admin-fuzz"))
    with server:
        with httpx.Client(base_url=server.url, headers=AS_ADMIN, timeout=30) as http:
            started = http.post(
                "/v1/pools/demo/rollouts", json={"template": {"env": {"REVISION": "2"}}}
            )
            assert started.status_code == 201, started.text
            ROLLOUT_IDS.append(started.json()["id"])
        yield server
    for (method, path, status), count in sorted(CALLS.items()):
        print(f"{method} {path} {status}xx: {count}")


schema = schemathesis.openapi.from_dict(openapi_document()).include(
    method=["PATCH", "POST"], path_regex=r"^/v1/pools/"
)
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
    max_examples=EXAMPLES,
    with_security_parameters=False,
)


@schema.hook
def map_case(
    context: schemathesis.HookContext, case: schemathesis.Case[Any]
) -> schemathesis.Case[Any]:
    """Aim two in three requests at a real pool and a real rollout, and send two in three
    valid ones without a random `If-Match`: random names, ids and generations are never
    real, and the writes that change something would go untested."""
    meta = case.meta
    positive = meta is not None and meta.generation.mode.is_positive
    if_match = case.headers.get("if-match") if case.headers else None
    if positive and case.headers and if_match is not None and (not if_match or len(if_match) % 3):
        del case.headers["if-match"]
    params = case.path_parameters
    if params and isinstance(params.get("name"), str) and len(params["name"]) % 3:
        params["name"] = POOLS[len(params["name"]) % 2]
    rollout_id = params.get("rollout_id") if params else None
    if params and ROLLOUT_IDS and isinstance(rollout_id, str) and len(rollout_id) % 3:
        params["name"] = "demo"
        params["rollout_id"] = ROLLOUT_IDS[len(rollout_id) % len(ROLLOUT_IDS)]
    return case


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    negative_data_rejection,
]


def assert_exec_takes(template: RuntimeTemplate) -> None:
    """The template's argv, environment and directory are what exec takes: started with
    `true` as its program, it runs, or is refused by the machine (a directory that does not
    exist here), never for its form (a NUL, text that is not unicode, a name with `=`)."""
    if not isinstance(template, ProcessTemplate):
        return
    program = shutil.which("true")
    assert program is not None
    args = [substitute(a, {"{port}": "1", "{worker_id}": "w-1"}) for a in template.argv[1:]]
    env = worker_environment(template.env, {})
    try:
        pid = start_process("w-fuzz", [program, *args], env, template.cwd, None)
    except RuntimeFailure as exc:
        refusal = exc.__cause__
    else:
        os.waitpid(pid, 0)  # start_process leaves the reaping to its caller
        return
    assert isinstance(refusal, OSError), refusal


async def stored_templates(server: AdminServer) -> list[RuntimeTemplate]:
    """Every template the server's store holds."""
    store = server.app.plane.store
    return [
        revision.template
        for pool in await store.list_pools()
        for revision in await store.list_revisions(pool.name)
    ]


def assert_nothing_accepted_fails_later(server: AdminServer) -> None:
    """A janitor pass runs through; every stored template passes the model as it is and
    is what exec takes."""
    server.call(server.app.plane.run_janitor_pass())
    for template in server.call(stored_templates(server)):
        assert changed_template(template, {}) == template
        assert_exec_takes(template)


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=EXAMPLES)
def test_admin_writes_refuse_generated_bad_input_in_stokers_words(
    case: schemathesis.Case[Any], admin_server: AdminServer
) -> None:
    response = case.call(base_url=admin_server.url, headers=AS_ADMIN, timeout=30)
    CALLS[case.method.upper(), case.path, response.status_code // 100] += 1
    if response.status_code >= 400:
        assert response.headers["content-type"] == ["application/problem+json"]
        return
    if case.path.endswith("/rollouts") and response.status_code == 201:
        ROLLOUT_IDS.append(response.json()["id"])
    assert_nothing_accepted_fails_later(admin_server)


def test_the_sweep_reaches_every_admin_write_route() -> None:
    operations = [r.ok() for r in schema.get_all_operations() if isinstance(r, Ok)]
    routes = {(op.method.upper(), op.path) for op in operations}
    assert routes == {
        ("PATCH", "/v1/pools/{name}"),
        ("POST", "/v1/pools/{name}/drain"),
        ("POST", "/v1/pools/{name}/undrain"),
        ("POST", "/v1/pools/{name}/rollouts"),
        ("POST", "/v1/pools/{name}/rollouts/{rollout_id}/pause"),
        ("POST", "/v1/pools/{name}/rollouts/{rollout_id}/resume"),
        ("POST", "/v1/pools/{name}/rollouts/{rollout_id}/abort"),
        ("POST", "/v1/pools/{name}/rollouts/{rollout_id}/promote"),
    }


def test_exec_check_tells_a_form_refusal_from_the_machine_s(tmp_path: Path) -> None:
    # The check the sweep relies on: a directory that does not exist is the machine's
    # refusal; a NUL in an argument is the template's, and fails it.
    assert_exec_takes(ProcessTemplate(argv=("w", "--x"), cwd=str(tmp_path / "nowhere")))
    with pytest.raises(AssertionError):
        assert_exec_takes(ProcessTemplate(argv=("w", "a\x00b")))
