"""The chaos soak of benchmarks/chaos_soak.py in its short form (about 50 s).

Three `stoker serve` replicas on one PostgreSQL schema under a steady claim load, with
every kind of fault at least once (replica SIGKILL and restart, worker SIGKILL, stalled
leader, lease blip, failed writes, terminated store connections), then the audit of the
store, the processes and the client's claim log. Longer runs:

    python benchmarks/chaos_soak.py --minutes 30 --seed 7

`STOKER_SOAK_MINUTES` and `STOKER_SOAK_SEED` lengthen or vary this test's run. A fast
test plants each kind of violation in a made-up history and checks that the audit reports
it, so that the soak's "0 violations" means something.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from servers import kill_fleet

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "chaos_soak.py"
FAULT_KINDS = (
    "replica_kill",
    "worker_kill",
    "leader_stall",
    "lease_blip",
    "write_failures",
    "connection_kill",
)


@pytest.mark.postgres
@pytest.mark.processes
@pytest.mark.slow
def test_a_short_chaos_soak_finds_no_violation(postgres_url: str, tmp_path: Path) -> None:
    minutes = float(os.environ.get("STOKER_SOAK_MINUTES", "0.6"))
    report_path = tmp_path / "report.json"
    token = uuid.uuid4().hex[:8]
    fleet, schema = f"soak-{token}", f"stoker_soak_{token}"
    argv = [
        sys.executable,
        str(SOAK),
        "--minutes",
        str(minutes),
        "--seed",
        os.environ.get("STOKER_SOAK_SEED", "1"),
        "--replicas",
        "3",
        "--rate",
        "12",
        "--postgres",
        postgres_url,
        "--workdir",
        str(tmp_path / "replicas"),
        "--json",
        str(report_path),
        "--fleet",
        fleet,
        "--schema",
        schema,
    ]
    # The soak and its replicas share a process group of their own; the workers carry the
    # fleet label. Whatever happens, all of them are killed and the schema dropped.
    soak = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        # Bounded: the load, a settle period of at most ~70 s, start-up and shutdown.
        output, _ = soak.communicate(timeout=minutes * 60 + 240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(soak.pid, signal.SIGKILL)
        soak.wait(30)
        kill_fleet(fleet)
        with (
            contextlib.suppress(psycopg.Error),
            psycopg.connect(postgres_url, autocommit=True) as conn,
        ):
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    assert soak.returncode == 0, output
    report: dict[str, Any] = json.loads(report_path.read_text())
    # The soak did what it says: it served claims while every kind of fault happened, and
    # each claim it tried was served or refused with a status (how many a machine serves
    # in the time is its speed, a benchmark's figure: benchmarks/chaos_soak.py)...
    claims = report["claims"]
    assert claims["served"] > 0, output
    assert claims["served"] + sum(claims["refused"].values()) == claims["attempted"], output
    for kind in FAULT_KINDS:
        assert report["faults"].get(kind, 0) >= 1, (kind, output)
    assert report["failed_writes"]["write"] > 0 and report["failed_writes"]["lease"] > 0, output
    assert report["server"]["persist_failures"] > 0, output
    # ... and the audit found nothing: no double assignment, no cross-org reuse, no leak,
    # every claim accounted for, never two leaders.
    assert report["violations"] == [], output
    assert report["claims"]["release_gave_up"] == 0, output


# -- the audit itself --------------------------------------------------------------------------


def _soak_module() -> Any:
    spec = importlib.util.spec_from_file_location("chaos_soak", SOAK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["chaos_soak"] = module  # dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


def test_the_audit_reports_every_planted_violation_and_nothing_else() -> None:
    """The soak's zero is meaningful: its audit finds each kind of violation it claims to."""
    soak = _soak_module()

    def worker(wid: str, org: str | None, state: str = "retired") -> Any:
        return soak.WorkerRow(
            wid, "demo", state, 1, "cp-a", org, None, {}, 0.0, 0.0, 0.0, None, None, None
        )

    def claim(cid: str, wid: str, org: str, epoch: int, start: float, end: float) -> Any:
        return soak.ClaimRow(cid, org, wid, epoch, "released", 0.0, start, end, None, "cp-a")

    def record(c: Any) -> Any:
        return soak.ClaimRecord(
            c.id, c.org, c.worker_id, c.worker_epoch, "warm", 0, c.created_at + 0.1,
            c.ended_at - 0.1, "released",
        )  # fmt: skip

    # A clean history: two sessions one after the other on each of two workers.
    workers = [worker("w1", "acme"), worker("w2", "globex")]
    claims = [
        claim("c1", "w1", "acme", 1, 0.0, 1.0),
        claim("c2", "w1", "acme", 2, 1.0, 2.0),
        claim("c3", "w2", "globex", 1, 0.0, 5.0),
    ]
    log = [record(c) for c in claims]
    assert soak.audit(log, workers, claims, soak.Leftovers(warm=3), 3) == []

    planted = [
        claim("c4", "w2", "globex", 2, 4.0, 6.0),  # I1: overlaps c3 on w2
        claim("c5", "w1", "initech", 3, 3.0, 4.0),  # I2: w1 served acme before
        claim("c6", "w1", "acme", 2, 5.0, 6.0),  # I1: epoch 2 again on w1
    ]
    stray = record(claim("c7", "w3", "acme", 1, 0.0, 1.0))  # accounting: not in the store
    left = soak.Leftovers(
        stray_processes=["pid 1 (w8)"],
        rows_without_process=["w9 warm pid 2"],
        in_flight=["w10 spawning (cp-a)"],
        warm=2,
    )
    found = soak.audit([*log, stray], workers, claims + planted, left, 3)
    by_kind = sorted(v.invariant for v in found)
    assert by_kind == ["I1", "I1", "I2", "I3", "I3", "I3", "I4", "accounting"], found
