"""`stoker worker-check -- CMD...` on real worker processes, run as a user runs it.

The demo worker and a worker on `http.server` built with the kit pass every rule; a
deliberately broken worker (it trusts unsigned activations) fails with a row saying so;
a worker that never gets healthy, a command that cannot start and a missing command are
each one clear failure.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from servers import STOKER, environment

pytestmark = pytest.mark.processes

KIT_WORKER = str(Path(__file__).resolve().parent / "workers" / "kit_worker.py")
DEMO = ["{python}", "-m", "stoker.demo_worker", "--port", "{port}", "--worker-id", "{worker_id}"]


def worker_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [STOKER, "worker-check", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=environment(),
    )


def rows(output: str) -> dict[str, list[str]]:
    """The table's rows by rule: [expected, got, result]."""
    found = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip("│ ").split("│")]
        if len(cells) == 4 and cells[3] in ("pass", "FAIL"):
            found[cells[0]] = cells[1:]
    return found


@pytest.mark.parametrize(
    "command", [DEMO, [sys.executable, KIT_WORKER, "{port}"]], ids=["demo", "kit-http-server"]
)
def test_a_conforming_worker_passes_every_rule(command: list[str]) -> None:
    result = worker_check("--", *command)
    assert result.returncode == 0, result.stdout + result.stderr
    table = rows(result.stdout)
    assert len(table) == 20 and all(cells[2] == "pass" for cells in table.values())
    assert "all 20 rules passed" in result.stdout


def test_a_worker_that_trusts_unsigned_activations_fails_with_a_clear_row() -> None:
    result = worker_check("--", sys.executable, KIT_WORKER, "{port}", "--careless")
    assert result.returncode == 1
    table = rows(result.stdout)
    assert table["activation without a signature"] == ["401", "200", "FAIL"]
    assert table["GET /healthz answers 200 once ready"][2] == "pass"
    assert "rules failed" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_a_worker_that_never_gets_healthy_fails_the_first_row() -> None:
    result = worker_check(
        "--ready-timeout-s", "1", "--", sys.executable, "-c", "import time; time.sleep(30)"
    )
    assert result.returncode == 1
    assert rows(result.stdout) == {
        "GET /healthz answers 200 once ready": ["200", "no answer (ConnectError) after 1s", "FAIL"]
    }


def test_a_worker_that_exits_at_once_is_reported() -> None:
    result = worker_check(
        "--", sys.executable, "-c", "print('no secret here'); raise SystemExit(3)"
    )
    assert result.returncode == 1
    assert rows(result.stdout)["GET /healthz answers 200 once ready"][1] == "exited with status 3"
    assert "no secret here" in result.stdout


def test_a_command_that_cannot_start_or_no_command_is_one_line() -> None:
    missing = worker_check("--", "/nonexistent/worker")
    assert missing.returncode == 1
    assert missing.stderr.startswith("stoker: cannot start '/nonexistent/worker'")
    assert missing.stderr.count("\n") == 1
    usage = worker_check()
    assert usage.returncode == 2
    assert "Traceback" not in usage.stderr
