"""No secret in any log line or metric, after a tour of everything a server does with one.

A real `stoker serve` at log level debug, with admin and org tokens (inline and from a
file) and an activation key from the environment, serves a tour: claims whose config
carries credentials, calls to the worker with the session token (and with a wrong or an
old one), renewals, releases, reuse by the same org (a new token), a lease left to
expire, and failures (unknown and wrong tokens, another org, an unknown and a foreign
claim, a malformed and an oversized request, an oversized header carrying a token, a
claim that finds no capacity). Then every secret the tour handled is searched for in the
server's whole log, its stdout and `/metrics`: the tokens, every session token, every
config value of a claim, the activation key and every worker's activation secret.
"""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from servers import DEMO, environment, kill_fleet, start_server, wait_until
from stoker.domain.activation import ActivationKey

pytestmark = pytest.mark.processes

SOON = 30.0
ADMIN = "admin-audit-" + uuid.uuid4().hex
ADMIN_FROM_FILE = "admin-file-" + uuid.uuid4().hex
ACME = "acme-audit-" + uuid.uuid4().hex
GLOBEX = "globex-audit-" + uuid.uuid4().hex
KEY = uuid.uuid4().hex + uuid.uuid4().hex


def config(fleet: str, admins: Path) -> str:
    pools = [
        {"name": "demo", "command": DEMO, "warm_target": 1, "reuse": "same_org"},
        {"name": "tiny", "command": DEMO, "warm_target": 0, "max_workers": 1},
    ]
    api = {
        "port": 0,
        "admin_tokens": [ADMIN],
        "admin_tokens_file": str(admins),
        "org_tokens": {ACME: "acme", GLOBEX: "globex"},
    }
    return (
        f"store: sqlite:///./stoker.db\nfleet: {fleet}\napi: {json.dumps(api)}\n"
        "log_level: debug\n"
        "intervals: {janitor_interval_s: 0.2, shutdown_grace_s: 5}\n"
        f"pools: {json.dumps(pools)}\n"
    )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_no_secret_reaches_a_log_line_or_a_metric(tmp_path: Path) -> None:
    admins = tmp_path / "admins"
    admins.write_text(f"{ADMIN_FROM_FILE}\n")
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    srv = start_server(
        tmp_path / "srv",
        config=config(fleet, admins),
        env=environment(STOKER_ACTIVATION__KEY=KEY),
    )
    secrets = {ADMIN, ADMIN_FROM_FILE, ACME, GLOBEX, KEY}
    workers: set[str] = set()
    api = httpx.Client(base_url=srv.url, headers=bearer(ACME), timeout=SOON)
    try:

        def claim(pool: str = "demo", **extra: object) -> dict[str, object]:
            secret = "pw-" + uuid.uuid4().hex
            secrets.add(secret)
            body = {"pool": pool, "org": "acme", "config": {"dsn": f"pg://u:{secret}@db"}}
            answer = api.post("/v1/claims", json={**body, **extra})
            assert answer.status_code == 201, answer.text
            made: dict[str, object] = answer.json()
            worker = made["worker"]
            assert isinstance(worker, dict)
            secrets.add(worker["token"])
            workers.add(worker["id"])
            return made

        def call(made: dict[str, object], token: str) -> int:
            worker = made["worker"]
            assert isinstance(worker, dict)
            return httpx.get(
                worker["endpoint"] + "/", headers=bearer(token), timeout=SOON
            ).status_code

        # Claim, use, renew, release, and reuse by the same org with a new token.
        first = claim()
        token = first["worker"]["token"]  # type: ignore[index]
        assert call(first, token) == 200
        assert call(first, "wrong-" + uuid.uuid4().hex) == 401
        assert api.post(f"/v1/claims/{first['id']}/renew", json={"lease_s": 60}).status_code == 200
        assert api.delete(f"/v1/claims/{first['id']}").status_code == 200
        again = claim()
        assert again["source"] == "reuse"
        assert call(again, token) == 401  # the old token was revoked
        assert call(again, again["worker"]["token"]) == 200  # type: ignore[index]
        api.delete(f"/v1/claims/{again['id']}")

        # A lease left to expire.
        lapsed = claim(lease_s=1)

        def expired() -> bool:
            return bool(api.get(f"/v1/claims/{lapsed['id']}").json()["state"] == "expired")

        assert wait_until(expired, SOON)

        # Failures.
        assert httpx.get(srv.url + "/v1/pools", timeout=SOON).status_code == 401
        assert (
            httpx.get(srv.url + "/v1/pools", headers=bearer(KEY), timeout=SOON).status_code == 401
        )
        assert api.post("/v1/claims", json={"pool": "demo", "org": "globex"}).status_code == 403
        assert api.get("/v1/claims/c-unknown").status_code == 404
        theirs = httpx.post(
            srv.url + "/v1/claims",
            json={"pool": "demo", "org": "globex", "config": {"k": "globex-" + GLOBEX}},
            headers=bearer(GLOBEX),
            timeout=SOON,
        ).json()
        secrets.add(theirs["worker"]["token"])
        workers.add(theirs["worker"]["id"])
        assert api.get(f"/v1/claims/{theirs['id']}").status_code == 404
        bad = api.post("/v1/claims", json={"pool": "demo", "org": "acme", "config": ACME})
        assert bad.status_code == 422
        assert api.post("/v1/claims", content=b"{" + ACME.encode()).status_code in (400, 422)
        big = {"pool": "demo", "org": "acme", "config": {"k": ACME * 3000}}
        assert api.post("/v1/claims", json=big).status_code == 413
        held = claim("tiny")
        crowded = api.post("/v1/claims", json={"pool": "tiny", "org": "acme", "timeout_s": 0.2})
        assert crowded.status_code in (429, 503)
        api.delete(f"/v1/claims/{held['id']}")
        parts = urlsplit(srv.url)
        with socket.create_connection((parts.hostname or "", parts.port or 0), SOON) as sock:
            sock.sendall(
                f"GET /v1/pools HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {ADMIN}\r\n"
                f"x-big: {ADMIN * 2000}".encode()
            )
            assert sock.recv(100).startswith(b"HTTP/1.1 431")

        # The admin's views.
        admin = bearer(ADMIN_FROM_FILE)
        listed = httpx.get(srv.url + "/v1/workers", headers=admin, timeout=SOON)
        assert listed.status_code == 200
        workers.update(w["id"] for w in listed.json()["workers"])
        metrics = httpx.get(srv.url + "/metrics", timeout=SOON).text
        assert "stoker_claims_total" in metrics
    finally:
        api.close()
        srv.stop()
        kill_fleet(fleet)

    key = ActivationKey(KEY.encode())
    secrets.update(key.worker_secret(w) for w in workers)
    log = srv.log()
    said = "".join(srv.lines) + srv.tail
    assert "event=client_refused reason=headers_too_large" in log  # the tour was logged
    assert len(log.splitlines()) > 20
    for secret in sorted(secrets):
        for where, text in (("log", log), ("stdout", said), ("/metrics", metrics)):
            assert secret not in text, f"a secret appears in {where}"
