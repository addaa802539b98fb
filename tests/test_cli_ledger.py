"""`stoker pools ledger` and `stoker claims export` against a real `stoker serve`
(docs/warmth.md, docs/claim-log.md): the export round-trips the server's claim log line
for line, in the fixed format, with no token in it."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from servers import DEMO, STOKER, Server, environment, kill_fleet, start_server

pytestmark = pytest.mark.processes

EXPORT_KEYS = {"at", "pool", "org", "mode", "source", "wait_s", "held_s", "outcome", "revision"}


def run(args: list[str], url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [STOKER, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment(STOKER_URL=url),
        stdin=subprocess.DEVNULL,
        check=False,
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, list[str]]]:
    """A server whose log holds two released sessions and one open one; the tokens the
    claims were handed."""
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    pool = {"name": "demo", "command": DEMO, "warm_target": 2, "cost": {"per_worker_hour": 0.5}}
    config = (
        f"store: sqlite:///./stoker.db\nfleet: {fleet}\napi: {{port: 0}}\n"
        "intervals: {janitor_interval_s: 0.2, reaper_interval_s: 0.5, shutdown_grace_s: 5}\n"
        f"pools:\n  - {json.dumps(pool)}\n"
    )
    srv = start_server(
        tmp_path_factory.mktemp("cli-ledger"), config=config, args=["--stop-workers"]
    )
    tokens = []
    try:
        for org in ("acme", "globex", "acme"):
            made = httpx.post(
                srv.url + "/v1/claims", json={"pool": "demo", "org": org}, timeout=30
            ).json()
            tokens.append(made["worker"]["token"])
            if len(tokens) < 3:
                httpx.delete(f"{srv.url}/v1/claims/{made['id']}", timeout=30)
        # The replica writes its log rows with its next pass (every 0.5 s): bounded wait.
        for _ in range(150):
            entries = log(srv)
            if sorted(e["outcome"] for e in entries) == ["open", "released", "released"]:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the log never held the three claims: {entries}")
        # The ledger's cells are flushed in batches too, on their own pass: bounded wait.
        for _ in range(150):
            if claims_counted(srv) == 3:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the ledger never counted the three claims: {claims_counted(srv)}")
        yield srv, tokens
    finally:
        srv.stop()
        kill_fleet(fleet)


def claims_counted(srv: Server) -> int:
    """Claims the pool's ledger counts in the last hour, by any source."""
    answer = httpx.get(srv.url + "/v1/pools/demo/ledger", params={"since": "1h"}, timeout=30)
    assert answer.status_code == 200, answer.text
    total = answer.json()["total"]
    return int(total["claims_warm"] + total["claims_reuse"] + total["claims_cold"])


def log(srv: Server) -> list[dict[str, Any]]:
    answer = httpx.get(srv.url + "/v1/claims/log", params={"since": "1h"}, timeout=30)
    assert answer.status_code == 200, answer.text
    entries: list[dict[str, Any]] = answer.json()["entries"]
    return entries


def test_claims_export_round_trips_the_log(
    server: tuple[Server, list[str]], tmp_path: Path
) -> None:
    srv, tokens = server
    out = tmp_path / "claims.jsonl"
    done = run(["claims", "export", "--since", "1h", "--pool", "demo", "--out", str(out)], srv.url)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    lines = [json.loads(line) for line in text.splitlines()]
    assert lines == log(srv)
    assert all(set(line) == EXPORT_KEYS for line in lines)
    assert [line["at"] for line in lines] == sorted(line["at"] for line in lines)
    assert all(token not in text for token in tokens)
    printed = run(["claims", "export", "--since", "1h"], srv.url)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == text
    # A pool that is not there and has no claims (a typo) is an error, not an empty log;
    # an earlier export under that name is left as it was.
    kept = tmp_path / "kept.jsonl"
    kept.write_text(text)
    other = run(["claims", "export", "--since", "1h", "--pool", "dmeo", "-o", str(kept)], srv.url)
    assert other.returncode == 1 and other.stdout == ""
    assert other.stderr.strip() == "stoker: 404 Not Found: unknown pool 'dmeo'"
    assert kept.read_text() == text
    # A known pool with no claims in the window exports nothing, successfully.
    none = run(["claims", "export", "--since", "1h", "--until", "59m", "--pool", "demo"], srv.url)
    assert none.returncode == 0 and none.stdout == "", none.stderr


def test_pools_ledger_prints_a_table_and_json(server: tuple[Server, list[str]]) -> None:
    srv, _ = server
    table = run(["pools", "ledger", "demo", "--since", "1h", "--by", "org"], srv.url)
    assert table.returncode == 0, table.stderr
    assert "total" in table.stdout and "acme" in table.stdout
    assert "draining h" in table.stdout  # every state of the worker time, draining too
    as_json = run(["pools", "ledger", "demo", "--since", "1h", "--json"], srv.url)
    assert as_json.returncode == 0, as_json.stderr
    body = json.loads(as_json.stdout)
    assert body["cost"]["per_worker_hour"] == 0.5
    # Three claims, whatever their source (a claim before the warm pool was ready is cold).
    total = body["total"]
    assert total["claims_warm"] + total["claims_reuse"] + total["claims_cold"] == 3
    assert body["total"]["idle_warm_cost"] > 0


def test_a_bad_window_is_one_line(server: tuple[Server, list[str]]) -> None:
    srv, _ = server
    bad = run(["pools", "ledger", "demo", "--since", "yesterday"], srv.url)
    assert bad.returncode != 0
    assert bad.stderr.startswith("stoker: ") and len(bad.stderr.strip().splitlines()) == 1


def test_an_empty_window_or_pool_is_refused_not_widened(server: tuple[Server, list[str]]) -> None:
    """`--since ""` (an unset shell variable) is no window: refused, not the server's
    default day; `--pool ""` no pool, not every pool."""
    srv, _ = server
    for args in (
        ["claims", "export", "--since", ""],
        ["claims", "export", "--pool", ""],
        ["pools", "ledger", "demo", "--until", ""],
    ):
        bad = run(args, srv.url)
        assert bad.returncode != 0, args
        assert bad.stderr.startswith("stoker: ") and len(bad.stderr.strip().splitlines()) == 1
        assert bad.stdout == "", args


def test_a_refused_export_leaves_the_earlier_file_as_it_was(
    server: tuple[Server, list[str]], tmp_path: Path
) -> None:
    """The server refuses the window after `--out` was named: the file an earlier export
    wrote is neither emptied nor left with a partial file beside it."""
    srv, _ = server
    out = tmp_path / "claims.jsonl"
    out.write_text('{"earlier": "export"}\n')
    bad = run(["claims", "export", "--since", "yesterday", "--out", str(out)], srv.url)
    assert bad.returncode == 1, bad.stderr
    assert bad.stderr.startswith("stoker: ") and len(bad.stderr.strip().splitlines()) == 1
    assert out.read_text() == '{"earlier": "export"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["claims.jsonl"]
    done = run(["claims", "export", "--since", "1h", "--out", str(out)], srv.url)
    assert done.returncode == 0, done.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == log(srv)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["claims.jsonl"]
    # The mode a plain `open` gives, not the private one of a temporary file.
    umask = os.umask(0o022)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask
    # Through a symlink, the file it names is written; the link stays a link.
    link = tmp_path / "latest.jsonl"
    link.symlink_to(out.name)
    out.write_text("")
    done = run(["claims", "export", "--since", "1h", "--out", str(link)], srv.url)
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and out.read_text() == link.read_text() != ""


#: Org names a client may send that read as rich markup: a closing tag, a style.
MARKUP_ORGS = ("[/x]", "a[b]")


def _rendered(table: Any) -> str:
    from rich.console import Console

    console = Console(record=True, width=400)
    console.print(table)
    return console.export_text()


def test_the_ledger_by_org_shows_orgs_that_read_as_markup_as_they_are() -> None:
    """`--by org` of a pool an org named `[/x]` claimed from ended in `unexpected error:
    MarkupError`; `a[b]` showed as a bold `a`."""
    from stoker.cli.pools import _ledger_table

    counts = {
        "warm_s": 0.0, "hot_s": 7.0, "hot_idle_s": 0.0, "starting_s": 0.0,
        "placeholder_s": 0.0, "spawns": 0, "mean_ready_s": None, "claims_reuse": 0,
        "claims_warm": 1, "claims_cold": 0, "failed": 0, "idle_warm_cost": None,
        "idle_parked_cost": None, "headroom_cost": None, "total_cost": None,
        "cold_start_s_avoided": None,
    }  # fmt: skip
    rows = [{**counts, "hour": 1796623200, "group": org} for org in MARKUP_ORGS]
    body = {"pool": "demo", "by": "org", "rows": rows, "total": {**counts, "group": ""}}
    text = _rendered(_ledger_table(body))
    assert all(f" {org} " in text for org in MARKUP_ORGS), text


def test_claims_list_shows_orgs_that_read_as_markup_as_they_are(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from stoker.cli.claims import _CLAIM_COLUMNS, _claim_row
    from stoker.cli.output import print_listing
    from stoker.sdk import ClaimInfo

    claim = {
        "id": "c-1", "pool": "demo", "state": "bound", "source": "warm", "mode": "prefer_warm",
        "worker": {"id": "w-1", "endpoint": "http://127.0.0.1:1", "token": None, "epoch": 1},
        "lease_s": 600.0, "expires_at": "2026-12-07T07:06:16.965Z",
        "created_at": "2026-12-07T06:56:16.965Z", "ended_at": None, "reason": None,
        "ttl_s": None,
    }  # fmt: skip
    claims = [ClaimInfo.from_json({**claim, "org": org}) for org in MARKUP_ORGS]
    print_listing("claims", claims, _CLAIM_COLUMNS, _claim_row, as_json=False)
    printed = capsys.readouterr().out
    assert all(f" {org} " in printed for org in MARKUP_ORGS), printed


def test_workers_list_shows_orgs_that_read_as_markup_as_they_are(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`stoker workers list` while an org named `[/x]` held a worker ended in
    `unexpected error: MarkupError`: every listing's cells are shown as they are."""
    from stoker.cli.output import print_listing
    from stoker.cli.workers import _WORKER_COLUMNS, _worker_row
    from stoker.sdk import WorkerInfo

    worker = {
        "id": "w-1", "pool": "demo", "revision": "r-1", "state": "hot", "epoch": 1,
        "claim_id": "c-1", "endpoint": "http://127.0.0.1:1", "owner": "cp-1",
        "activated": True, "created_at": "2026-12-07T06:56:16.965Z",
        "updated_at": "2026-12-07T06:56:16.965Z", "idle_since": None, "ttl_s": None,
        "reason": "[bold]",
    }  # fmt: skip
    workers = [WorkerInfo.from_json({**worker, "org": org}) for org in MARKUP_ORGS]
    print_listing("workers", workers, _WORKER_COLUMNS, _worker_row, as_json=False)
    printed = capsys.readouterr().out
    assert all(f" {org} " in printed for org in MARKUP_ORGS), printed
    assert " [bold] " in printed


def test_a_piped_ledger_by_org_prints_each_row_on_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`stoker pools ledger --by org > file` is wider than 200 columns: piped, its rows
    broke in two (the hour on two lines, "reuse/warm/…"), which no grep or awk reads."""
    from stoker.cli.output import make_console
    from stoker.cli.pools import _ledger_table

    counts = {
        "warm_s": 900.0, "hot_s": 36.0, "hot_idle_s": 180.0, "starting_s": 1.0,
        "draining_s": 0.5, "placeholder_s": 0.0, "spawns": 2, "mean_ready_s": 0.46,
        "claims_reuse": 11, "claims_warm": 1, "claims_cold": 2, "failed": 0,
        "idle_warm_cost": 0.0125, "idle_parked_cost": 0.0025, "headroom_cost": 0.0,
        "total_cost": 0.0156, "cold_start_s_avoided": 6.82,
    }  # fmt: skip
    rows = [{**counts, "hour": 1796637600, "group": org} for org in ("acme", "initech-europe")]
    body = {"pool": "demo", "by": "org", "rows": rows, "total": {**counts, "group": ""}}
    make_console().print(_ledger_table(body))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 8, "\n".join(lines)  # title, top, header, rule, 3 rows, bottom
    assert any("│ 2026-12-07 10:00 │ initech-europe │" in line for line in lines)
    assert any("reuse/warm/cold" in line for line in lines)
