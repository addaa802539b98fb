"""The README's quick start, run as a user would, in an empty directory.

`stoker serve` with the embedded defaults (the port is moved off 8080 through the
documented `STOKER_API__PORT` override, so the test never collides with a server already
running on this machine), then the three-step tour: claim with the CLI, GET the worker
endpoint with the session token, release, claim again and get the same worker.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import textwrap
from pathlib import Path

import httpx
import pytest

from servers import STOKER, environment, fleet_processes, kill_fleet, start_server
from stoker.config import StokerConfig

pytestmark = pytest.mark.processes

README = Path(__file__).resolve().parents[1] / "README.md"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def readme_section() -> str:
    text = README.read_text()
    match = re.search(r"<!-- server:begin -->(.*)<!-- server:end -->", text, re.S)
    assert match, "README.md lacks the server section"
    return match.group(1)


def test_readme_shows_the_commands_this_test_runs() -> None:
    section = readme_section()
    for command in (
        "make serve",
        "stoker claim --pool demo --org acme",
        'curl -H "Authorization: Bearer $TOKEN" "$ENDPOINT/"',
        "stoker release",
        "stoker status",
    ):
        assert command in section, command


def shell_blocks() -> list[str]:
    """The `sh` code blocks of the README's server section, dedented."""
    blocks = re.findall(r"```sh\n(.*?)```", readme_section(), re.S)
    return [textwrap.dedent(re.sub(r"^ {3}", "", b, flags=re.M)) for b in blocks]


def json_documents(text: str) -> list[dict[str, object]]:
    """The JSON objects printed one after another in `text` (other lines skipped)."""
    decoder, found, i = json.JSONDecoder(), [], 0
    while (i := text.find("{", i)) >= 0:
        try:
            value, end = decoder.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        found.append(value)
        i = end
    return found


def test_quick_start(tmp_path: Path) -> None:
    serve, claim_block, curl_block, reuse_block = shell_blocks()[:4]
    assert serve.strip() == "make serve"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # `make serve` runs `.venv/bin/stoker serve`; the port moves off 8080 (STOKER_API__PORT).
    server_env = environment(STOKER_API__PORT=str(port))
    shell_env = environment(STOKER_URL=url, PATH=f"{Path(STOKER).parent}:{os.environ['PATH']}")
    # The default store is ./stoker.db in the working directory; so is the fleet's label.
    fleet = StokerConfig(store=f"sqlite:///{tmp_path}/stoker.db").fleet_name()

    def sh(script: str) -> str:
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=tmp_path,
            env=shell_env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, (script, result.stderr)
        assert "Traceback" not in result.stderr
        return result.stdout

    server = start_server(tmp_path, env=server_env)
    try:
        assert server.url == url
        assert "config: built-in defaults" in server.lines[-1]
        assert (tmp_path / "stoker.db").exists()

        # 1. Claim a worker with the CLI.
        [claim] = json_documents(sh(claim_block))
        assert json.loads((tmp_path / "claim.json").read_text()) == claim
        assert claim["state"] == "bound" and claim["pool"] == "demo"
        worker = claim["worker"]
        assert isinstance(worker, dict)

        # 2. Open the endpoint with the token (and see it refused without).
        [answer] = json_documents(sh(curl_block))
        assert answer["org"] == "acme" and answer["worker_id"] == worker["id"]
        assert httpx.get(f"{worker['endpoint']}/").status_code == 401

        # 3. Release, claim again: the same worker, reused for the same org.
        out = sh(reuse_block)
        released, again = json_documents(out)
        assert released["id"] == claim["id"] and released["state"] == "released"
        again_worker = again["worker"]
        assert isinstance(again_worker, dict)
        assert again_worker["id"] == worker["id"] and again["source"] == "reuse"
        assert " demo " in out and "hot" in out
        # The previous session's token was revoked by the new activation.
        old = httpx.get(
            f"{worker['endpoint']}/", headers={"Authorization": f"Bearer {worker['token']}"}
        )
        assert old.status_code == 401

        # Ctrl-C or SIGTERM: a clean stop that leaves the workers for the next start.
        assert server.stop(signal.SIGTERM) == 0
        assert "stoker stopped" in server.tail
        labels = {p.environ().get("STOKER_WORKER_ID") for p in fleet_processes(fleet)}
        assert worker["id"] in labels
    finally:
        server.stop(signal.SIGKILL)
        kill_fleet(fleet)
