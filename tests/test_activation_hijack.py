"""The session hijack of issue 13, tried against `stoker serve` with its defaults, refused.

A tenant (`acme`) claims a worker; then this test process — another process on the
machine, as a hostile neighbour would be — posts activations straight to the worker
processes the server started: unsigned, with a made-up signature, signed with a guessed
key, and a signed activation replayed against another worker and at another epoch. The
"captured" activation is minted with the fleet key the server keeps next to its store,
exactly as the server signs one: what someone watching the loopback traffic would see.
Every attempt is refused (401, or 409 for the replay as is), the tenant's session keeps
working, and the intruder's token opens nothing. Neither the key nor any worker's secret
shows in the server's log, its store, `/v1/workers` or a claim.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from servers import DEMO, Server, kill_fleet, start_server, wait_until
from stoker.domain.activation import ActivationKey
from stoker.sdk import Client
from stoker.worker import SIGNATURE_HEADER, signature

pytestmark = pytest.mark.processes


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    demo = json.dumps(DEMO)
    config = f"""
store: sqlite:///./stoker.db
fleet: {fleet}
api: {{host: 127.0.0.1, port: 0}}
pools:
  - {{name: demo, command: {demo}, warm_target: 2}}
"""
    srv = start_server(tmp_path, config=config, args=["--stop-workers"])
    try:
        yield srv
    finally:
        srv.stop()
        kill_fleet(fleet)


def post(endpoint: str, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    """POST `body` as it is to `{endpoint}/activate`."""
    return httpx.post(
        f"{endpoint}/activate",
        content=body,
        headers={"Content-Type": "application/json", **(headers or {})},
        timeout=5,
        trust_env=False,
    )


def activation(worker_id: str, epoch: int, token: str = "intruder") -> bytes:
    body = {"worker_id": worker_id, "org": "acme", "epoch": epoch, "token": token, "config": {}}
    return json.dumps(body, separators=(",", ":")).encode()


def test_a_neighbour_cannot_take_over_a_session(server: Server) -> None:
    with Client(server.url) as client:
        claim = client.create_claim("demo", "acme", config={"role": "ro"})
        mine = claim.worker
        assert mine.token
        assert wait_until(lambda: len(client.workers(state="warm")) >= 1, 30)
        (spare,) = client.workers(state="warm")[:1]
        assert spare.endpoint is not None
        tenant = {"Authorization": f"Bearer {mine.token}"}

        def refused(response: httpx.Response) -> None:
            assert response.status_code == 401, response.text
            assert response.json()["code"] == "activation-unauthenticated"

        # The hijack as filed: a newer epoch, the intruder's token, no credential.
        takeover = activation(mine.id, mine.epoch + 100)
        refused(post(mine.endpoint, takeover))
        refused(post(mine.endpoint, takeover, {SIGNATURE_HEADER: "v1=" + "0" * 64}))
        guessed = ActivationKey(b"a-guess-at-the-fleet-key-of-32-bytes").worker_secret(mine.id)
        refused(post(mine.endpoint, takeover, {SIGNATURE_HEADER: sign(guessed, takeover)}))

        # A captured activation of the spare worker, exactly as the server signs one.
        key = ActivationKey((server.workdir / "stoker.db.activation-key").read_bytes().strip())
        captured = activation(spare.id, spare.epoch + 1)
        signed = {SIGNATURE_HEADER: sign(key.worker_secret(spare.id), captured)}
        # ... replayed against the tenant's worker (another secret), as is and retargeted,
        refused(post(mine.endpoint, captured, signed))
        refused(post(mine.endpoint, activation(mine.id, spare.epoch + 1), signed))
        # ... and against its own worker at another epoch (another body).
        refused(post(spare.endpoint, activation(spare.id, spare.epoch + 50), signed))
        assert httpx.get(f"{spare.endpoint}/", timeout=5).json()["org"] is None

        # The tenant keeps its session; the intruder's token opens nothing.
        state = httpx.get(f"{mine.endpoint}/", headers=tenant, timeout=5)
        assert state.status_code == 200
        assert (state.json()["org"], state.json()["epoch"]) == ("acme", mine.epoch)
        intruder = {"Authorization": "Bearer intruder"}
        assert httpx.get(f"{mine.endpoint}/", headers=intruder, timeout=5).status_code == 401
        assert client.renew(claim.id).state == "bound"

        # The server's own activations still go through: release, claim again (reuse).
        client.release(claim.id)
        again = client.create_claim("demo", "acme")
        assert (again.source, again.worker.id) == ("reuse", mine.id)
        assert again.worker.epoch > mine.epoch
        listing = json.dumps(client.get_claim(again.id).raw) + json.dumps(
            [w.id for w in client.workers()]
        )
        client.release(again.id)

    # Nothing that could activate a worker is written anywhere the server shows or keeps.
    secrets = [key.worker_secret(w) for w in (mine.id, spare.id)]
    fleet_key = (server.workdir / "stoker.db.activation-key").read_text().strip()
    raw_listing = httpx.get(f"{server.url}/v1/workers", timeout=5).text
    store = b"".join(
        p.read_bytes() for p in server.workdir.glob("stoker.db*") if "key" not in p.name
    )
    for secret in [*secrets, fleet_key]:
        assert secret not in server.log()
        assert secret not in raw_listing and secret not in listing
        assert secret.encode() not in store


def sign(secret: str, body: bytes) -> str:
    return signature(secret, "POST", "/activate", body)
