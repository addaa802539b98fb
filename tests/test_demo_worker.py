"""The demo worker over real HTTP: the worker side of the protocol (docs/worker-protocol.md).

Activations are signed here as the control plane signs them, with the worker's secret
derived from the tests' fleet key; the refusals of unsigned and wrongly signed ones are
pinned below, and end to end through `stoker serve` in `tests/test_activation_hijack.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fakes import TEST_ACTIVATION_KEY
from stoker.demo_worker import parse_args
from stoker.worker import SECRET_ENV, SIGNATURE_HEADER, signature

pytestmark = pytest.mark.processes

START_TIMEOUT_S = 10.0


@dataclass
class DemoWorker:
    """A running demo worker process and where it listens."""

    process: asyncio.subprocess.Process
    worker_id: str
    endpoint: str

    @property
    def secret(self) -> str:
        """The activation secret the worker was started with."""
        return TEST_ACTIVATION_KEY.worker_secret(self.worker_id)

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])


StartWorker = Callable[..., Awaitable[DemoWorker]]


@pytest.fixture
async def start_worker() -> AsyncIterator[StartWorker]:
    """Start demo workers on a free port; every one is killed and reaped afterwards."""
    started: list[asyncio.subprocess.Process] = []

    async def start(worker_id: str, *options: str) -> DemoWorker:
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "stoker.demo_worker", "--port", "0", "--worker-id", worker_id),
            *options,
            stdout=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
            env={**os.environ, SECRET_ENV: TEST_ACTIVATION_KEY.worker_secret(worker_id)},
        )
        started.append(process)
        assert process.stdout is not None
        # The start line is printed once the socket listens: it is the readiness event.
        line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)
        fields = dict(part.split("=", 1) for part in line.decode().split() if "=" in part)
        assert fields["worker_id"] == worker_id
        return DemoWorker(process=process, worker_id=worker_id, endpoint=fields["endpoint"])

    yield start
    for process in started:
        if process.returncode is None:
            process.kill()
        await asyncio.wait_for(process.wait(), 10)
        assert process.stdout is not None
        # Drain to EOF so the pipe transport closes before the loop does.
        await asyncio.wait_for(process.stdout.read(), 10)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as c:
        yield c


@pytest.fixture
async def worker(start_worker: StartWorker) -> DemoWorker:
    return await start_worker("w-1")


def activation(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "worker_id": "w-1",
        "org": "acme",
        "epoch": 1,
        "token": "tok-1",
        "config": {"region": "eu", "dsn": "x"},
    }
    body.update(overrides)
    return body


async def activate(
    client: httpx.AsyncClient,
    worker: DemoWorker,
    body: dict[str, Any] | None = None,
    *,
    content: bytes | None = None,
    secret: str | None = None,
) -> httpx.Response:
    """POST an activation signed as the control plane signs it (with `secret`, else the
    worker's own): `body` as JSON, or `content` as it is."""
    raw = content if content is not None else json.dumps(body).encode()
    key = worker.secret if secret is None else secret
    headers = {SIGNATURE_HEADER: signature(key, "POST", "/activate", raw)}
    return await client.post(f"{worker.endpoint}/activate", content=raw, headers=headers)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def raw_exchange(port: int, *requests: bytes) -> list[bytes]:
    """Send `requests` on one connection and read one response per request."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    responses = []
    try:
        for request in requests:
            writer.write(request)
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            body = await asyncio.wait_for(reader.readexactly(length), 5)
            responses.append(head + body)
    finally:
        writer.close()
        await writer.wait_closed()
    return responses


async def test_healthz_and_state_before_activation(
    worker: DemoWorker, client: httpx.AsyncClient
) -> None:
    health = await client.get(f"{worker.endpoint}/healthz")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    state = await client.get(f"{worker.endpoint}/")
    assert state.status_code == 200
    assert state.json() == {"worker_id": "w-1", "org": None, "epoch": None, "config_keys": []}


async def test_activation_binds_the_org_and_requires_the_token(
    worker: DemoWorker, client: httpx.AsyncClient
) -> None:
    activated = await activate(client, worker, activation())
    assert activated.status_code == 200
    assert activated.json() == {"worker_id": "w-1", "org": "acme", "epoch": 1}

    missing = await client.get(f"{worker.endpoint}/")
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert missing.headers["content-type"] == "application/problem+json"
    assert missing.json()["status"] == 401
    wrong = await client.get(f"{worker.endpoint}/", headers=bearer("tok-2"))
    assert wrong.status_code == 401
    other_scheme = await client.get(f"{worker.endpoint}/", headers={"Authorization": "Basic x"})
    assert other_scheme.status_code == 401

    state = await client.get(f"{worker.endpoint}/", headers=bearer("tok-1"))
    assert state.status_code == 200
    assert state.json() == {
        "worker_id": "w-1",
        "org": "acme",
        "epoch": 1,
        "config_keys": ["dsn", "region"],
    }
    # Liveness stays open: the control plane probes without a session token.
    assert (await client.get(f"{worker.endpoint}/healthz")).status_code == 200


async def test_an_unsigned_or_wrongly_signed_activation_is_401_and_binds_nothing(
    start_worker: StartWorker, client: httpx.AsyncClient
) -> None:
    """Without the worker's signature nothing is bound, before or after an activation:
    no signature, a made-up one, another worker's (its secret differs), and a captured
    signature sent with a body at a newer epoch (the signature covers the body)."""
    worker = await start_worker("w-1")
    other = await start_worker("w-2")
    endpoint = f"{worker.endpoint}/activate"
    intruder = activation(epoch=100, token="intruder")

    async def refused(response: httpx.Response) -> None:
        assert response.status_code == 401
        assert response.json()["code"] == "activation-unauthenticated"

    await refused(await client.post(endpoint, json=intruder))
    await refused(await client.post(endpoint, json=intruder, headers={SIGNATURE_HEADER: "v1=00"}))
    await refused(await activate(client, worker, intruder, secret=other.secret))
    assert (await client.get(f"{worker.endpoint}/")).json()["org"] is None

    captured = json.dumps(activation()).encode()
    signed = {SIGNATURE_HEADER: signature(worker.secret, "POST", "/activate", captured)}
    assert (await client.post(endpoint, content=captured, headers=signed)).status_code == 200
    # The captured activation, replayed: at a newer epoch, to another worker, and as is.
    newer = json.dumps(activation(epoch=2, token="intruder")).encode()
    await refused(await client.post(endpoint, content=newer, headers=signed))
    retargeted = json.dumps(activation(worker_id="w-2")).encode()
    await refused(
        await client.post(f"{other.endpoint}/activate", content=retargeted, headers=signed)
    )
    await refused(await client.post(f"{other.endpoint}/activate", content=captured, headers=signed))
    replayed = await client.post(endpoint, content=captured, headers=signed)
    assert (replayed.status_code, replayed.json()["code"]) == (409, "stale-epoch")

    # The tenant keeps its session; the intruder's token opens nothing.
    assert (await client.get(f"{worker.endpoint}/", headers=bearer("tok-1"))).status_code == 200
    assert (await client.get(f"{worker.endpoint}/", headers=bearer("intruder"))).status_code == 401
    assert (await client.get(f"{other.endpoint}/")).json()["org"] is None


async def test_the_worker_refuses_to_start_without_its_secret() -> None:
    """A worker that could not check activations would accept anyone's: it does not start."""
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "stoker.demo_worker", "--port", "0", "--worker-id", "w-1"),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(process.communicate(), START_TIMEOUT_S)
    assert process.returncode == 2
    assert out == b""
    assert f"{SECRET_ENV} is not set".encode() in err


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"org": "globex", "epoch": 2}, "second-org"),
        ({"epoch": 1, "token": "tok-9"}, "stale-epoch"),
        ({"epoch": 0, "token": "tok-9"}, "stale-epoch"),
        ({"worker_id": "w-2", "epoch": 2}, "wrong-worker"),
    ],
)
async def test_fencing_rejects_with_409_and_keeps_the_binding(
    worker: DemoWorker, client: httpx.AsyncClient, overrides: dict[str, Any], code: str
) -> None:
    assert (await activate(client, worker, activation())).status_code == 200

    rejected = await activate(client, worker, activation(**overrides))
    assert rejected.status_code == 409
    assert rejected.json()["code"] == code

    # The first session is untouched: same org and epoch, and its token still works.
    state = await client.get(f"{worker.endpoint}/", headers=bearer("tok-1"))
    assert state.status_code == 200
    assert (state.json()["org"], state.json()["epoch"]) == ("acme", 1)


async def test_wrong_worker_id_is_rejected_before_any_activation(
    worker: DemoWorker, client: httpx.AsyncClient
) -> None:
    rejected = await activate(client, worker, activation(worker_id="w-9"))
    assert rejected.status_code == 409
    state = await client.get(f"{worker.endpoint}/")
    assert state.json()["org"] is None


async def test_reactivation_by_the_same_org_revokes_the_old_token(
    worker: DemoWorker, client: httpx.AsyncClient
) -> None:
    assert (await activate(client, worker, activation())).status_code == 200
    again = await activate(
        client, worker, activation(epoch=5, token="tok-2", config={"fresh": True})
    )
    assert again.status_code == 200
    assert again.json()["epoch"] == 5

    assert (await client.get(f"{worker.endpoint}/", headers=bearer("tok-1"))).status_code == 401
    state = await client.get(f"{worker.endpoint}/", headers=bearer("tok-2"))
    assert state.status_code == 200
    assert state.json() == {"worker_id": "w-1", "org": "acme", "epoch": 5, "config_keys": ["fresh"]}


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"worker_id": "w-1", "org": "acme", "epoch": 1}',
        b'{"worker_id": "w-1", "org": "", "epoch": 1, "token": "t"}',
        b'{"worker_id": "w-1", "org": "acme", "epoch": true, "token": "t"}',
        b'{"worker_id": "w-1", "org": "acme", "epoch": "1", "token": "t"}',
        b'{"worker_id": "w-1", "org": "acme", "epoch": 1, "token": "t", "config": []}',
    ],
)
async def test_malformed_activation_is_400(
    worker: DemoWorker, client: httpx.AsyncClient, content: bytes
) -> None:
    response = await activate(client, worker, content=content)
    assert response.status_code == 400
    assert response.json()["status"] == 400
    # Nothing was bound by a rejected request.
    assert (await client.get(f"{worker.endpoint}/")).json()["org"] is None


async def test_unknown_paths_and_wrong_methods(
    worker: DemoWorker, client: httpx.AsyncClient
) -> None:
    assert (await client.get(f"{worker.endpoint}/nope")).status_code == 404
    wrong = await client.get(f"{worker.endpoint}/activate")
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "POST"
    assert (await client.post(f"{worker.endpoint}/healthz")).status_code == 405
    assert (await client.delete(f"{worker.endpoint}/")).status_code == 405


async def test_oversized_and_chunked_bodies_are_refused(worker: DemoWorker) -> None:
    (too_large,) = await raw_exchange(
        worker.port,
        b"POST /activate HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n",
    )
    assert too_large.startswith(b"HTTP/1.1 413 ")
    (chunked,) = await raw_exchange(
        worker.port,
        b"POST /activate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
    )
    assert chunked.startswith(b"HTTP/1.1 411 ")
    (garbage,) = await raw_exchange(worker.port, b"HELLO\r\n\r\n")
    assert garbage.startswith(b"HTTP/1.1 400 ")


async def test_expect_100_continue_is_answered_before_the_body(worker: DemoWorker) -> None:
    body = b'{"worker_id": "w-1", "org": "acme", "epoch": 1, "token": "t"}'
    signed = signature(worker.secret, "POST", "/activate", body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", worker.port)
    try:
        writer.write(
            b"POST /activate HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            b"Stoker-Signature: %s\r\nContent-Length: %d\r\n\r\n" % (signed, len(body))
        )
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        final = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert final.startswith(b"HTTP/1.1 200 ")
    finally:
        writer.close()
        await writer.wait_closed()


async def test_keep_alive_serves_several_requests_on_one_connection(worker: DemoWorker) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    responses = await raw_exchange(worker.port, request, request, request)
    assert len(responses) == 3
    for response in responses:
        assert response.startswith(b"HTTP/1.1 200 ")
        assert b"Connection: keep-alive" in response


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_signal_exits_zero_promptly_with_an_open_connection(
    worker: DemoWorker, client: httpx.AsyncClient, signum: signal.Signals
) -> None:
    # A pooled keep-alive connection stays open across the signal.
    assert (await client.get(f"{worker.endpoint}/healthz")).status_code == 200
    loop = asyncio.get_running_loop()
    started = loop.time()
    worker.process.send_signal(signum)
    code = await asyncio.wait_for(worker.process.wait(), 5)
    assert code == 0
    assert loop.time() - started < 2.0


async def test_a_stop_delay_keeps_serving_that_long_after_sigterm(
    start_worker: StartWorker, client: httpx.AsyncClient
) -> None:
    """`--stop-delay` stands in for an engine slow to shut down: the process answers on
    for that long after SIGTERM, then exits 0."""
    worker = await start_worker("w-1", "--stop-delay", "1.5")
    loop = asyncio.get_running_loop()
    started = loop.time()
    worker.process.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.5)
    assert worker.process.returncode is None
    assert (await client.get(f"{worker.endpoint}/healthz")).status_code == 200
    assert await asyncio.wait_for(worker.process.wait(), 5) == 0
    assert loop.time() - started >= 1.5


async def test_idle_memory(start_worker: StartWorker, client: httpx.AsyncClient) -> None:
    worker = await start_worker("w-mem")
    body = activation(worker_id="w-mem")
    assert (await activate(client, worker, body)).status_code == 200
    for _ in range(20):
        response = await client.get(f"{worker.endpoint}/", headers=bearer("tok-1"))
        assert response.status_code == 200
    memory = psutil.Process(worker.process.pid).memory_full_info()
    print(
        f"\ndemo worker idle memory: rss={memory.rss / 2**20:.1f} MiB "
        f"uss={memory.uss / 2**20:.1f} MiB pss={memory.pss / 2**20:.1f} MiB"
    )


@pytest.mark.parametrize("option", ["--start-delay", "--stop-delay"])
@given(
    value=st.one_of(
        st.floats(max_value=-1e-9),
        st.sampled_from(["nan", "inf", "-inf", "1e309", "", "x", "1s", "--"]),
        st.text("abcxyz-_ .,:", min_size=1, max_size=8),
    )
)
def test_a_delay_that_is_not_a_finite_number_of_seconds_is_refused(
    option: str, value: float | str
) -> None:
    """Generated bad delays end with argparse's usage error (exit 2), never a worker that
    never gets ready or never exits (`inf`), and never a traceback."""
    err = io.StringIO()
    with pytest.raises(SystemExit) as exit_, contextlib.redirect_stderr(err):
        parse_args(["--port", "0", "--worker-id", "w-1", option, str(value)])
    assert exit_.value.code == 2
    assert f"argument {option}" in err.getvalue()


@pytest.mark.parametrize("value", ["0", "1.5", "12"])
def test_a_finite_delay_is_taken(value: str) -> None:
    args = parse_args(["--port", "0", "--worker-id", "w-1", "--stop-delay", value])
    assert args.stop_delay == float(value) and args.start_delay == 0.0
