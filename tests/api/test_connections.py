"""Clients that try to make the server hold too much, against a real `stoker serve`.

Each attack of a hostile neighbour is reproduced on raw sockets: an endless header, headers
or a body dripped a byte at a time, hundreds of idle connections, a low open-files limit.
Each is refused with its status and one log line, while `/healthz` and a claim (also one
already in flight) keep answering; a claim still waiting when the shutdown grace ends gets
a problem answer. Waits are bounded generously; no test measures a time.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from servers import DEMO, Server, kill_fleet, start_server, wait_until

pytestmark = pytest.mark.processes

#: Generous bound on anything the server should do "soon".
SOON = 30.0
LIMITS: dict[str, object] = {
    "port": 0,
    "max_header_bytes": 4096,
    "header_timeout_s": 1,
    "body_timeout_s": 1,
    "keep_alive_s": 1,
    "max_connections": 64,
}
SLOW_START = ["sh", "-c", "sleep 3; exec " + " ".join(DEMO)]


def config(fleet: str, api: dict[str, object]) -> str:
    pools = [
        {"name": "demo", "command": DEMO, "warm_target": 1},
        {"name": "slow", "command": SLOW_START, "warm_target": 0},
        {"name": "tiny", "command": DEMO, "warm_target": 0, "max_workers": 1},
    ]
    return (
        f"store: sqlite:///./stoker.db\nfleet: {fleet}\napi: {json.dumps(api)}\n"
        "intervals: {janitor_interval_s: 0.2, shutdown_grace_s: 5}\n"
        f"pools: {json.dumps(pools)}\n"
    )


def launch(
    workdir: Path, api: dict[str, object], open_files: int | None = None
) -> Generator[Server, None, None]:
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    srv = start_server(
        workdir, config=config(fleet, api), args=["--stop-workers"], open_files=open_files
    )
    try:
        yield srv
    finally:
        srv.stop()
        kill_fleet(fleet)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from launch(tmp_path_factory.mktemp("bounds"), LIMITS)


def connect(server: Server) -> socket.socket:
    parts = urlsplit(server.url)
    assert parts.hostname is not None and parts.port is not None
    sock = socket.create_connection((parts.hostname, parts.port), timeout=SOON)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by SOON); then
    closes this end too."""
    chunks = []
    with sock:
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    return b"".join(chunks)


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response.split(b" ", 2)[1])


def healthy(server: Server) -> bool:
    return httpx.get(server.url + "/healthz", timeout=SOON).status_code == 200


def claim_and_release(server: Server, pool: str = "demo") -> None:
    """A claim is served (201), its worker answers its token, and it is released."""
    with httpx.Client(base_url=server.url, timeout=SOON) as client:
        claimed = client.post("/v1/claims", json={"pool": pool, "org": "acme"})
        assert claimed.status_code == 201, claimed.text
        body = claimed.json()
        worker = httpx.get(
            body["worker"]["endpoint"] + "/",
            headers={"Authorization": f"Bearer {body['worker']['token']}"},
            timeout=SOON,
        )
        assert worker.status_code == 200
        assert client.delete(f"/v1/claims/{body['id']}").status_code == 200


def refusals(server: Server, reason: str) -> int:
    return server.log().count(f"event=client_refused reason={reason} ")


def test_headers_over_the_limit_get_431(server: Server) -> None:
    # Unfinished: the server refuses once it has read past the limit, not at the end.
    sock = connect(server)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 8192)
    response = read_until_closed(sock)
    assert status_of(response) == 431
    assert b"headers-too-large" in response
    # Finished within one read: the complete headers are measured before any route runs.
    sock = connect(server)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 5000 + b"\r\n\r\n")
    assert status_of(read_until_closed(sock)) == 431
    # A request line alone over the limit.
    sock = connect(server)
    sock.sendall(b"GET /healthz?" + b"q" * 8192 + b" HTTP/1.1\r\nhost: x\r\n\r\n")
    assert status_of(read_until_closed(sock)) == 431
    # Under the limit, the same header is served.
    ok = httpx.get(server.url + "/healthz", headers={"x-big": "a" * 3000}, timeout=SOON)
    assert ok.status_code == 200
    assert wait_until(lambda: refusals(server, "headers_too_large") >= 1, SOON)


def test_an_endless_header_is_cut_off_while_healthz_answers(server: Server) -> None:
    sock = connect(server)
    sent = 0
    cut_off = threading.Event()

    def flood() -> None:
        nonlocal sent
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: ")
        piece = b"a" * 65536
        try:
            while sent < 200 * 1024 * 1024:
                sock.sendall(piece)
                sent += len(piece)
        except OSError:
            cut_off.set()

    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    assert healthy(server)
    claim_and_release(server)
    sender.join(SOON)
    sock.close()
    # The server stopped reading long before 200 MB: the connection broke under the sender.
    assert cut_off.is_set() and sent < 16 * 1024 * 1024, sent


def test_dripped_headers_get_408(server: Server) -> None:
    sock = connect(server)
    sock.sendall(b"GET /healthz HTTP/1.1\r\n")
    stop = threading.Event()

    def drip() -> None:
        try:
            while not stop.wait(0.1):
                sock.send(b"x")
        except OSError:
            return

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        assert healthy(server)
        response = read_until_closed(sock)
    finally:
        stop.set()
        dripper.join(SOON)
    assert status_of(response) == 408
    assert b"header" in response
    assert wait_until(lambda: refusals(server, "header_timeout") >= 1, SOON)


def test_a_dripped_body_gets_408_while_claims_are_served(server: Server) -> None:
    sock = connect(server)
    sock.sendall(
        b"POST /v1/claims HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 500\r\n\r\n{"
    )
    stop = threading.Event()

    def drip() -> None:
        try:
            while not stop.wait(0.1):
                sock.send(b" ")
        except OSError:
            return

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        claim_and_release(server)
        response = read_until_closed(sock)
    finally:
        stop.set()
        dripper.join(SOON)
    assert status_of(response) == 408
    assert b"body" in response
    assert wait_until(lambda: refusals(server, "body_timeout") >= 1, SOON)


def test_idle_connections_are_closed_and_never_crowd_out_healthz(server: Server) -> None:
    idle = [connect(server) for _ in range(300)]
    try:
        # Far more than max_connections (64) are open or queued: healthz still answers.
        assert healthy(server)
        claim_and_release(server)
        for sock in idle:
            assert read_until_closed(sock) == b""
    finally:
        for sock in idle:
            sock.close()
    assert wait_until(lambda: refusals(server, "evicted") >= 1, SOON)
    assert wait_until(lambda: refusals(server, "idle_connection") >= 1, SOON)
    # Hundreds of evictions at once: a few lines, and one that counts the rest.
    assert wait_until(lambda: "event=client_refused_folded reason=evicted" in server.log(), SOON)
    assert refusals(server, "evicted") < 50


def test_an_idle_keep_alive_connection_is_closed(server: Server) -> None:
    sock = connect(server)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
    response = read_until_closed(sock)
    # One response, then the server closed the connection on its own (keep_alive_s).
    assert status_of(response) == 200
    assert response.count(b"HTTP/1.1") == 1


def test_a_claim_in_flight_survives_a_flood_of_connections(server: Server) -> None:
    outcome: list[int] = []

    def slow_claim() -> None:
        answer = httpx.post(
            server.url + "/v1/claims",
            json={"pool": "slow", "org": "acme", "mode": "cold", "timeout_s": 60},
            timeout=90,
        )
        outcome.append(answer.status_code)
        if answer.status_code == 201:
            httpx.delete(server.url + f"/v1/claims/{answer.json()['id']}", timeout=SOON)

    claimer = threading.Thread(target=slow_claim, daemon=True)
    claimer.start()

    def spawning() -> bool:
        pool = httpx.get(server.url + "/v1/pools/slow", timeout=SOON).json()
        return bool(pool["counts"].get("spawning"))

    assert wait_until(spawning, SOON)
    flood = [connect(server) for _ in range(200)]
    try:
        # The worker takes seconds to start: the claim is still waiting for it.
        assert claimer.is_alive()
        assert healthy(server)
        claimer.join(90)
    finally:
        for sock in flood:
            sock.close()
    assert outcome == [201]


def test_a_low_open_files_limit_lowers_the_cap_and_healthz_answers(tmp_path: Path) -> None:
    servers = launch(tmp_path, {"port": 0}, open_files=256)
    srv = next(servers)
    with contextlib.closing(servers):
        assert "event=connection_limit_lowered max_connections=1024 to=128" in srv.log()
        crowd = [connect(srv) for _ in range(400)]
        try:
            assert healthy(srv)
            claim_and_release(srv)
        finally:
            for sock in crowd:
                sock.close()
        assert wait_until(lambda: refusals(srv, "evicted") >= 1, SOON)


def test_a_body_over_the_limit_gets_413_and_a_log_line(server: Server) -> None:
    big = {"pool": "demo", "org": "acme", "config": {"x": "a" * 70000}}
    answer = httpx.post(server.url + "/v1/claims", json=big, timeout=SOON)
    assert answer.status_code == 413
    assert wait_until(lambda: refusals(server, "body_too_large") >= 1, SOON)
    metrics = httpx.get(server.url + "/metrics", timeout=SOON).text
    assert 'stoker_api_refusals_total{reason="body_too_large"}' in metrics


def test_a_claim_waiting_when_the_shutdown_grace_ends_gets_503_problem_json(
    tmp_path: Path,
) -> None:
    """SIGTERM while a claim waits for a worker that never comes: once the shutdown grace
    ends, the claim is answered 503 `shutting_down` as problem JSON, and nothing in the
    log is a traceback."""
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    never = {"name": "never", "command": ["sleep", "600"], "warm_target": 0}
    text = (
        f"store: sqlite:///./stoker.db\nfleet: {fleet}\napi: {{port: 0}}\n"
        f"intervals: {{shutdown_grace_s: 1}}\npools: {json.dumps([never])}\n"
    )
    srv = start_server(tmp_path, config=text, args=["--stop-workers"])
    answers: list[httpx.Response] = []
    body = {"pool": "never", "org": "acme", "mode": "require_warm", "timeout_s": 600}
    client = threading.Thread(
        target=lambda: answers.append(
            httpx.post(srv.url + "/v1/claims", json=body, timeout=4 * SOON)
        )
    )
    try:
        client.start()
        waiting = 'stoker_claims_waiting{pool="never"} 1.0'
        assert wait_until(lambda: waiting in httpx.get(srv.url + "/metrics").text, SOON)
        assert srv.stop() == 0
        client.join(SOON)
    finally:
        srv.stop()
        kill_fleet(fleet)
    [answer] = answers
    assert answer.status_code == 503, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["reason"] == "shutting_down"
    assert "Traceback" not in srv.log()


def test_only_connections_all_serving_requests_make_a_newcomer_wait(tmp_path: Path) -> None:
    """At the cap with every connection serving a claim that waits, a newcomer gets 503;
    the waiting claims are never cut off, and once they are answered there is room again."""
    api: dict[str, object] = {"port": 0, "max_connections": 16}
    servers = launch(tmp_path, api)
    srv = next(servers)
    with contextlib.closing(servers):
        # The tiny pool's one worker is held: claims that want a warm one wait.
        held = httpx.post(
            srv.url + "/v1/claims", json={"pool": "tiny", "org": "acme"}, timeout=SOON
        ).json()
        answers: list[str] = []

        def wait_for_a_worker() -> None:
            body = {"pool": "tiny", "org": "globex", "mode": "require_warm", "timeout_s": 8}
            sent = time.perf_counter()
            try:
                answer = httpx.post(srv.url + "/v1/claims", json=body, timeout=SOON)
            except httpx.RemoteProtocolError:
                # Evicted before its request was sent: it was the longest-idle connection.
                answers.append("evicted")
                return
            except httpx.ReadError:
                # Evicted as its request arrived (closed with the request unread, the
                # kernel resets the connection), at once; a claim that waited in the plane
                # and was then cut off would be reset after seconds, which must not happen.
                answers.append("evicted" if time.perf_counter() - sent < 4.0 else "cut off")
                return
            assert answer.status_code == 503
            problem = answer.json()
            answers.append(problem.get("reason") or problem["code"])

        def probe() -> int:
            sock = connect(srv)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            return status_of(read_until_closed(sock))

        waiting = [threading.Thread(target=wait_for_a_worker, daemon=True) for _ in range(40)]
        for thread in waiting:
            thread.start()
        saw_503 = wait_until(lambda: probe() == 503, SOON)
        for thread in waiting:
            thread.join(SOON)
        assert wait_until(lambda: probe() == 200, SOON)
        httpx.delete(srv.url + f"/v1/claims/{held['id']}", timeout=SOON)
    assert saw_503 and refusals(srv, "connection_limit") >= 1
    # Claims that reached the plane waited their time out and were answered; the others
    # were refused with 503 at the cap (or closed before they sent anything).
    assert len(answers) == 40 and answers.count("no_capacity") >= 1
    assert set(answers) <= {"no_capacity", "connection-limit", "evicted"}, answers


def test_a_connection_answered_before_its_body_ended_still_closes_when_idle(
    server: Server,
) -> None:
    sock = connect(server)
    body = b"{" + b" " * 99_998 + b"}"
    sock.sendall(
        b"POST /v1/claims HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
    )
    # 413 by the Content-Length, before the body; the body comes after the answer.
    answer = b""
    while not answer.endswith(b"}"):
        answer += sock.recv(65536)
    assert status_of(answer) == 413
    sock.sendall(body)
    # Then idle, the connection is closed by the keep-alive limit (bounded by SOON).
    assert read_until_closed(sock) == b""


def read_response(sock: socket.socket) -> bytes:
    """One whole response (head and its content-length body) from a kept-alive connection;
    b"" when the server closed or reset the connection instead of answering."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            if not (chunk := sock.recv(65536)):
                return b""
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
        while len(body) < length:
            if not (chunk := sock.recv(65536)):
                return b""
            body += chunk
    except ConnectionResetError:
        return b""
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("kept_alive", [True, False], ids=["kept-alive", "new"])
def test_a_request_sent_as_the_idle_time_ran_out_is_answered_not_reset(
    server: Server, kept_alive: bool
) -> None:
    """A busy server runs its keep-alive (or a new connection's header) timer late, after
    the client sent its request: that request is answered, never cut off with a reset.

    The server is stopped (SIGSTOP) past its timeout while the request arrives, as a loop
    busy for that long would be; on SIGCONT its loop finds the timer due and the request
    waiting, unread, in the socket. Whether the resumed loop reads or runs its timers
    first varies, so the race is run on several connections at once."""
    request = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
    socks = [connect(server) for _ in range(4)]
    for sock in socks:
        if kept_alive:
            sock.sendall(request)
            assert status_of(read_response(sock)) == 200
    for _ in range(3):
        server.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(float(str(LIMITS["keep_alive_s"])) + 0.5)
            for sock in socks:
                sock.sendall(request)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert [status_of(read_response(sock)) for sock in socks] == [200] * len(socks)
    for sock in socks:
        # Idle afterwards, it is closed as before.
        assert read_until_closed(sock) == b""
