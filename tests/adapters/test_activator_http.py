"""The HTTP activator against real demo workers and against a scripted HTTP worker.

The Activator contract runs on demo-worker processes started by the local runtime (the
activator reaches pods the same way, at `http://<podIP>:<port>`); the tests below it pin
what only HTTP has: the exact body sent, the status mapping, the endpoint taken from the
runtime ref, and the retry of a refused connection (pods).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import httpx
import pytest
from aiohttp import web
from test_runtime_local import MakeRuntime, local_runtimes, make_pool

from activator_contract import ActivatorContract
from fakes import TEST_ACTIVATION_KEY
from runtime_contract import Recorder, make_worker, spawn_ready
from stoker.adapters.activator_http import HttpActivator
from stoker.adapters.runtime_local import LocalProcessRuntime
from stoker.domain.activation import ActivationKey
from stoker.domain.errors import ActivationRejected, RuntimeFailure
from stoker.domain.records import Worker
from stoker.domain.states import WorkerState
from stoker.ports.activator import ActivationPayload, Activator
from stoker.worker import SIGNATURE_HEADER, signature_valid

pytestmark = pytest.mark.processes


@pytest.fixture
async def activator() -> AsyncIterator[HttpActivator]:
    activator = HttpActivator(activation_key=TEST_ACTIVATION_KEY)
    yield activator
    await activator.close()


@pytest.fixture
async def demo_workers() -> AsyncIterator[tuple[LocalProcessRuntime, Recorder]]:
    """A local runtime starting demo workers (all killed afterwards)."""
    make: MakeRuntime
    async with local_runtimes() as make:
        yield await make()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as c:
        yield c


# -- the Activator contract on demo workers ----------------------------------------------------


class DemoTarget:
    """Demo workers started by the local runtime, activated over HTTP."""

    def __init__(
        self, activator: HttpActivator, workers: tuple[LocalProcessRuntime, Recorder]
    ) -> None:
        self.activator: Activator = activator
        self.runtime, self.recorder = workers

    async def ready_worker(self) -> Worker:
        return await spawn_ready(self.runtime, self.recorder, make_pool())

    async def unreachable(self) -> tuple[Activator, Worker]:
        worker = await self.ready_worker()
        await self.runtime.stop(worker, grace_s=5.0)
        return self.activator, worker


class TestHttpActivatorContract(ActivatorContract):
    """The shared contract, over HTTP to real demo workers."""

    @pytest.fixture
    def target(
        self, activator: HttpActivator, demo_workers: tuple[LocalProcessRuntime, Recorder]
    ) -> DemoTarget:
        return DemoTarget(activator, demo_workers)


# -- what only HTTP has ------------------------------------------------------------------------


async def test_activation_succeeds_then_a_second_org_is_rejected(
    activator: HttpActivator,
    demo_workers: tuple[LocalProcessRuntime, Recorder],
    client: httpx.AsyncClient,
) -> None:
    rt, recorder = demo_workers
    worker = await spawn_ready(rt, recorder, make_pool())
    payload = ActivationPayload(
        worker_id=worker.id, org="acme", epoch=1, token="tok-1", config={"region": "eu"}
    )
    await activator.activate(worker, payload, timeout=5.0)
    state = await client.get(f"{worker.endpoint}/", headers={"Authorization": "Bearer tok-1"})
    assert state.json()["org"] == "acme"
    assert state.json()["config_keys"] == ["region"]

    other_org = ActivationPayload(worker_id=worker.id, org="globex", epoch=2, token="tok-2")
    with pytest.raises(ActivationRejected):
        await activator.activate(worker, other_org, timeout=5.0)
    stale = ActivationPayload(worker_id=worker.id, org="acme", epoch=1, token="tok-3")
    with pytest.raises(ActivationRejected):
        await activator.activate(worker, stale, timeout=5.0)
    # The endpoint may come from the ref alone (a record without `endpoint`).
    newer = ActivationPayload(worker_id=worker.id, org="acme", epoch=2, token="tok-4")
    await activator.activate(worker.evolve(endpoint=None), newer, timeout=5.0)


async def test_activation_of_an_unreachable_worker_is_a_runtime_failure(
    activator: HttpActivator, demo_workers: tuple[LocalProcessRuntime, Recorder]
) -> None:
    rt, recorder = demo_workers
    worker = await spawn_ready(rt, recorder, make_pool())
    await rt.stop(worker, grace_s=5.0)
    payload = ActivationPayload(worker_id=worker.id, org="acme", epoch=1, token="t")
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(RuntimeFailure) as failure:
        await activator.activate(worker, payload, timeout=2.0)
    assert not isinstance(failure.value, ActivationRejected)
    # A local worker listened when it was ready: a refusal now fails at once, no retry.
    assert loop.time() - began < 1.0
    with pytest.raises(RuntimeFailure, match="no endpoint"):
        await activator.activate(worker.evolve(endpoint=None, runtime_ref={}), payload, 2.0)


async def test_a_local_runtime_probes_on_the_activators_session(activator: HttpActivator) -> None:
    """As bootstrap wires a server: readiness probes and activations share one session, so
    a worker's first activation reuses its probe's connection. The runtime leaves the
    session open when it closes; the activator, its owner, closes it."""
    async with local_runtimes() as make:
        rt, recorder = await make(probe_session=activator.session)
        worker = await spawn_ready(rt, recorder, make_pool())
        session = activator.session()
        payload = ActivationPayload(worker_id=worker.id, org="acme", epoch=1, token="t")
        await activator.activate(worker, payload, 5.0)
        await rt.close()
        assert not session.closed
        await activator.activate(worker, replace(payload, epoch=2), 5.0)
    await activator.close()
    assert session.closed


@asynccontextmanager
async def worker_server(
    handler: Callable[[web.Request], Any],
) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/activate", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def activating(worker_id: str, endpoint: str | None) -> Worker:
    return make_worker(make_pool()).evolve(
        id=worker_id, state=WorkerState.ACTIVATING, endpoint=endpoint
    )


@pytest.mark.parametrize(
    ("status", "error"), [(200, None), (409, ActivationRejected), (500, RuntimeFailure)]
)
async def test_the_activator_posts_the_payload_to_the_worker(
    activator: HttpActivator, status: int, error: type[Exception] | None
) -> None:
    """POST {endpoint}/activate with the payload: 200 binds, 409 is a rejection, else a failure."""
    received: list[Mapping[str, Any]] = []
    signed: list[bool] = []

    async def handler(request: web.Request) -> web.Response:
        raw = await request.read()
        received.append(json.loads(raw))
        # Signed over the exact bytes received, with the secret of the worker addressed.
        secret = TEST_ACTIVATION_KEY.worker_secret("w-1")
        given = request.headers.get(SIGNATURE_HEADER)
        signed.append(signature_valid(secret, "POST", "/activate", raw, given))
        return web.json_response({"detail": "no"}, status=status)

    async with worker_server(handler) as endpoint:
        payload = ActivationPayload(
            worker_id="w-1", org="acme", epoch=3, token="secret", config={"dsn": "x"}
        )
        one = activating("w-1", endpoint)
        if error is None:
            await activator.activate(one, payload, 5.0)
        else:
            with pytest.raises(error, match="no"):
                await activator.activate(one, payload, 5.0)
    assert received == [
        {"worker_id": "w-1", "org": "acme", "epoch": 3, "token": "secret", "config": {"dsn": "x"}}
    ]
    assert signed == [True]


async def test_an_activator_with_another_fleet_key_is_refused_and_binds_nothing(
    activator: HttpActivator, demo_workers: tuple[LocalProcessRuntime, Recorder]
) -> None:
    """A replica holding another key (or none) cannot activate: the worker answers 401,
    a failure that is not a rejection, and it still takes the right key's activation."""
    rt, recorder = demo_workers
    worker = await spawn_ready(rt, recorder, make_pool())
    foreign = HttpActivator(activation_key=ActivationKey(b"another-fleet-key-of-32-bytes-or-more"))
    payload = ActivationPayload(worker_id=worker.id, org="globex", epoch=7, token="intruder")
    try:
        with pytest.raises(RuntimeFailure, match="401") as failure:
            await foreign.activate(worker, payload, 5.0)
    finally:
        await foreign.close()
    assert not isinstance(failure.value, ActivationRejected)
    assert "intruder" not in str(failure.value)
    own = ActivationPayload(worker_id=worker.id, org="acme", epoch=1, token="tok-1")
    await activator.activate(worker, own, 5.0)


async def test_a_pod_activator_retries_a_closed_port_until_the_timeout() -> None:
    """A pod can be Ready a moment before its server listens; nothing listens at all here."""

    async def accept(request: web.Request) -> web.Response:
        return web.Response()

    async with worker_server(accept) as endpoint:
        closed = endpoint  # nothing listens there once the block ends
    activator = HttpActivator(activation_key=TEST_ACTIVATION_KEY, refused_retry_s=0.2)
    one = activating("w-1", closed)
    payload = ActivationPayload(worker_id="w-1", org="acme", epoch=1, token="t")
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(RuntimeFailure, match="activation of worker w-1 failed"):
        await activator.activate(one, payload, 0.6)
    assert loop.time() - began >= 0.35  # two retries, 0.2 s apart
    with pytest.raises(RuntimeFailure, match="no endpoint"):
        await activator.activate(activating("w-2", None), payload, 1.0)
    await activator.close()
    with pytest.raises(RuntimeFailure, match="closed"):
        await activator.activate(one, payload, 1.0)


def test_a_retry_pause_must_be_positive() -> None:
    with pytest.raises(ValueError, match="refused_retry_s"):
        HttpActivator(activation_key=TEST_ACTIVATION_KEY, refused_retry_s=0.0)
