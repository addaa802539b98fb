"""`make demo` (python -m stoker.demo): the README's tour against a real server and real
demo workers, from claim to reuse, and nothing left running afterwards."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from servers import environment

pytestmark = pytest.mark.processes


def test_the_demo_claims_uses_releases_and_reuses_a_worker() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "stoker.demo"],
        capture_output=True,
        text=True,
        timeout=180,
        env=environment(),
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    [claimed] = [line for line in lines if line.startswith("claimed ") and "(warm)" in line]
    worker = claimed.split()[1]
    assert any(line.startswith("  GET / with the session token: 200 ") for line in lines)
    assert "  GET / without it: 401" in lines
    assert f"released {worker}" in lines
    assert f"claimed {worker} for acme again (reuse)" in lines
    assert lines[-1] == "server stopped, workers stopped"
    leftover = [
        p.pid for p in psutil.process_iter(["cmdline"]) if worker in (p.info["cmdline"] or [])
    ]
    assert leftover == []
