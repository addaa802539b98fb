"""Generated bad input on every admin write route (issue #25), from the OpenAPI document.

Schemathesis sends requests that fit the document and requests that break it to each route
that changes a pool: `PATCH /v1/pools/{name}`, drain and undrain, `DELETE
/v1/pools/{name}`, starting a rollout and every action on one. No answer may be a 5xx or
show Python's internals or stoker's class names, and nothing accepted may fail later:
after every write that was accepted a janitor pass runs through, every template in the
store passes the template model as it is, and each stored template's command line,
environment and directory are handed to exec (its program swapped for `true`: a fuzzer's
programs are not run) and refused for no reason of their form. The server is the real app
on uvicorn in a thread with `MemoryRuntime` workers, as in test_api_fuzz.py.

Its pools run processes, so the template model is also driven directly, with generated
changes of a process's and a pod's template: every template it accepts is one exec takes,
or one whose worker pod the API server's rules and the Pod schema take.
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
import kubernetes_validate
import pytest
import schemathesis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    status_code_conformance,
)
from test_api_fuzz import ADMIN, ThreadedServer, openapi_document

from fakes import TEST_ACTIVATION_KEY
from stoker.adapters.cluster_lightkube import _pod_to_k8s
from stoker.adapters.runtime_kubernetes._pods import worker_pod
from stoker.adapters.runtime_local._processes import start_process, substitute, worker_environment
from stoker.config.changes import changed_template
from stoker.domain.errors import RuntimeFailure
from stoker.domain.records import Worker
from stoker.domain.specs import PodTemplate, PoolSpec, ProcessTemplate, RuntimeTemplate
from stoker.domain.states import WorkerState
from stoker.ports.cluster import Invalid
from stoker.sim.cluster.validation import check_labels

T = TypeVar("T")
#: The Kubernetes whose Pod schema a worker pod must fit (as the deploy manifests do).
KUBERNETES_VERSION = "1.37"
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
    method=["PATCH", "POST", "DELETE"], path_regex=r"^/v1/pools/"
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
    """A janitor pass fails for no pool, every stored pool loads, and every stored template
    passes the model as it is and is what exec takes."""
    plane = server.app.plane
    server.call(plane.run_janitor_pass())
    # The janitor isolates a pool whose step fails: a pass that runs through says nothing.
    assert plane.janitor.faults.failing(at_least=1) == []
    assert plane.pools.broken == {}
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
        ("DELETE", "/v1/pools/{name}"),
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


# -- the template model itself, over generated changes -------------------------------------

#: Any JSON value (the wrong type for most fields).
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
#: Text a worker can be handed, and text it cannot (or that is empty).
TEXT = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=8)
WORDS = TEXT.filter(bool)
BAD_TEXT = st.sampled_from(["", "a\x00b", "\ud800"])
#: Environment variable names, label keys and values, object names; and wrong ones.
ENV_NAMES = st.from_regex(r"[A-Za-z_.-][A-Za-z0-9_.-]{0,6}", fullmatch=True)
LABEL_VALUES = st.from_regex(r"([A-Za-z0-9]([A-Za-z0-9._-]{0,4}[A-Za-z0-9])?)?", fullmatch=True)
LABEL_KEYS = st.from_regex(
    r"([a-z0-9]{1,4}(\.[a-z0-9]{1,4})?/)?[A-Za-z0-9]([A-Za-z0-9._-]{0,4}[A-Za-z0-9])?",
    fullmatch=True,
)
OBJECT_NAMES = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,6}[a-z0-9])?", fullmatch=True)
BAD_NAMES = st.sampled_from(["1X", "A=B", "", "-a", "a/", "stoker.dev/pool", "Ab_"])
QUANTITIES = st.sampled_from(["1", "500m", "2Gi", "0.5", "1e3", "128Mi"])
BAD_QUANTITIES = st.sampled_from(["0", "-1", "x", "1.5.2", 2, 1.5, True])


NOTHING: st.SearchStrategy[Any] = st.nothing()


def field(
    valid: st.SearchStrategy[Any], invalid: st.SearchStrategy[Any] = NOTHING
) -> st.SearchStrategy[Any]:
    """Mostly a valid value (12 in 14), else an invalid one or any JSON at all."""
    return weighted((12, valid), (1, invalid), (1, JSON))


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, each drawn by its weight (one_of draws them alike)."""
    picks = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(picks) - 1).flatmap(lambda i: picks[i])


def mapping(keys: st.SearchStrategy[str], values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A small mapping of `keys` to `values`."""
    return st.dictionaries(keys, values, max_size=3)


_PROCESS_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "command": field(st.lists(WORDS, min_size=1, max_size=4), st.lists(BAD_TEXT, max_size=2)),
        "env": field(mapping(ENV_NAMES, TEXT), mapping(BAD_NAMES, BAD_TEXT)),
        "cwd": field(st.none() | WORDS, BAD_TEXT),
        "memory_mb": field(st.integers(1, 2**20), st.integers(-2, 0) | st.just(2**21)),
    },
)
#: A process template's fields, now and then under the name the API no longer takes.
PROCESS_CHANGES = weighted(
    (9, _PROCESS_FIELDS), (1, st.fixed_dictionaries({"argv": st.lists(WORDS, max_size=2)}))
)
TOLERATION = st.fixed_dictionaries(
    {"operator": st.just("Exists")},
    optional={
        "key": field(st.none() | LABEL_KEYS, st.just("")),
        "effect": field(st.sampled_from(["NoSchedule", "NoExecute"]), st.just("Never")),
    },
)
POD_CHANGES = st.fixed_dictionaries(
    {},
    optional={
        "image": field(WORDS, BAD_TEXT),
        "command": field(st.lists(TEXT, max_size=3), st.lists(BAD_TEXT, min_size=1, max_size=2)),
        "args": field(st.lists(TEXT, max_size=3)),
        "env": field(mapping(ENV_NAMES, TEXT), mapping(BAD_NAMES, TEXT)),
        "cpu": field(QUANTITIES, BAD_QUANTITIES),
        "memory": field(QUANTITIES, BAD_QUANTITIES),
        "port": field(st.integers(1, 65535), st.sampled_from([0, 65536, "8080"])),
        "node_selector": field(mapping(LABEL_KEYS, LABEL_VALUES), mapping(BAD_NAMES, TEXT)),
        "tolerations": field(st.lists(TOLERATION, max_size=2)),
        "priority_class": field(st.none() | OBJECT_NAMES, BAD_NAMES),
        "service_account": field(st.none() | OBJECT_NAMES, BAD_NAMES),
        "labels": field(mapping(LABEL_KEYS, LABEL_VALUES), mapping(BAD_NAMES, TEXT)),
        "annotations": field(mapping(LABEL_KEYS, TEXT), mapping(BAD_NAMES, TEXT)),
    },
)
STABLE_PROCESS = ProcessTemplate(argv=("worker", "{port}"))
STABLE_POD = PodTemplate(image="worker:1")


def assert_a_cluster_takes(template: PodTemplate) -> None:
    """The worker pod of `template` has names and labels the API server takes, and its
    manifest fits the Pod schema of a current Kubernetes."""
    worker = Worker(
        id="w-1",
        pool="p",
        revision="r1",
        state=WorkerState.SPAWNING,
        epoch=0,
        owner="cp-a",
        created_at=0.0,
        updated_at=0.0,
    )
    pool = PoolSpec(name="p", template=template)
    pod = worker_pod(
        worker,
        pool,
        template,
        fleet="f",
        instance_id="cp-a",
        grace_s=10,
        activation_key=TEST_ACTIVATION_KEY,
    )
    check_labels(pod.labels)
    check_labels(pod.spec.node_selector)
    manifest = _pod_to_k8s(pod, "stoker").to_dict()
    kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(PROCESS_CHANGES)
def test_every_process_template_the_model_takes_is_one_exec_takes(
    changes: dict[str, Any],
) -> None:
    try:
        template = changed_template(STABLE_PROCESS, changes)
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            assert error["loc"], error  # each problem names a field
        event("refused")
        return
    event("accepted")
    assert "argv" not in changes
    assert_exec_takes(template)


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(POD_CHANGES)
def test_every_pod_template_the_model_takes_is_one_a_cluster_takes(
    changes: dict[str, Any],
) -> None:
    try:
        template = changed_template(STABLE_POD, changes)
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            assert error["loc"], error
        event("refused")
        return
    event("accepted")
    assert isinstance(template, PodTemplate)
    assert_a_cluster_takes(template)


def test_the_cluster_check_refuses_what_an_api_server_would() -> None:
    # The check the property relies on: a label key the API server refuses fails it.
    assert_a_cluster_takes(PodTemplate(image="worker:1", labels={"app": "w"}))
    with pytest.raises(Invalid):
        assert_a_cluster_takes(PodTemplate(image="worker:1", labels={"-app": "w"}))
