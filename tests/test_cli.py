"""The `stoker` command as a user runs it: real processes, a real server, real workers.

Client commands print JSON or a table; every failure is one line on stderr with a non-zero
status and no traceback; `serve` refuses what it must refuse, and SIGTERM shuts it down
gracefully, leaving workers for the next start to adopt (or stopping them when asked).
"""

from __future__ import annotations

import asyncio
import json
import queue
import shlex
import signal
import socket
import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from servers import (
    DEMO,
    STOKER,
    Server,
    environment,
    fleet_processes,
    kill_fleet,
    start_server,
    wait_until,
)
from stoker.adapters.sqlite import SqliteStore
from stoker.domain.pools import StoredPool
from stoker.domain.specs import PoolSpec, ProcessTemplate

pytestmark = pytest.mark.processes


def run(
    args: Sequence[str], *, url: str | None = None, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run `stoker ARGS` and return what it did."""
    extra = {"STOKER_URL": url} if url else {}
    return subprocess.run(
        [STOKER, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment(**extra, **env),
        stdin=subprocess.DEVNULL,
        check=False,
    )


def one_line_error(result: subprocess.CompletedProcess[str], status: int) -> str:
    """Assert a failure of exactly one stderr line and no traceback; returns the line."""
    assert result.returncode == status, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert lines[0].startswith("stoker: ")
    return lines[0]


def config(fleet: str, **pool: object) -> str:
    settings = {"name": "demo", "command": DEMO, "warm_target": 1, **pool}
    return (
        f"store: sqlite:///./stoker.db\nfleet: {fleet}\napi: {{port: 0}}\n"
        "intervals: {janitor_interval_s: 0.2, shutdown_grace_s: 5}\n"
        f"pools:\n  - {json.dumps(settings)}\n"
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    srv = start_server(
        tmp_path_factory.mktemp("cli"), config=config(fleet), args=["--stop-workers"]
    )
    try:
        yield srv
    finally:
        srv.stop()
        kill_fleet(fleet)


def test_claim_prints_json_and_release_frees_it(server: Server) -> None:
    claimed = run(
        ["claim", "--pool", "demo", "--org", "acme", "--set", "role=ro", "--set", "n=3"],
        url=server.url,
    )
    assert claimed.returncode == 0, claimed.stderr
    claim = json.loads(claimed.stdout)
    assert claim["state"] == "bound" and claim["org"] == "acme"
    answer = httpx.get(
        claim["worker"]["endpoint"] + "/",
        headers={"Authorization": f"Bearer {claim['worker']['token']}"},
        timeout=5,
    )
    assert answer.json()["config_keys"] == ["n", "role"]
    released = run(["release", claim["id"]], url=server.url)
    assert released.returncode == 0, released.stderr
    assert json.loads(released.stdout)["state"] == "released"


def test_claim_options(server: Server) -> None:
    claimed = run(
        [
            "claim",
            "-p",
            "demo",
            "-o",
            "globex",
            "--mode",
            "cold",
            "--timeout-s",
            "30",
            "--lease-s",
            "5",
            "--ttl-s",
            "7",
        ],
        url=server.url,
    )
    assert claimed.returncode == 0, claimed.stderr
    claim = json.loads(claimed.stdout)
    assert claim["source"] == "cold" and claim["mode"] == "cold" and claim["lease_s"] == 5
    assert claim["ttl_s"] == 7
    assert run(["release", claim["id"]], url=server.url).returncode == 0


def test_status_shows_pools_by_state(server: Server) -> None:
    assert wait_until(lambda: " demo " in run(["status"], url=server.url).stdout, timeout=10)
    result = run(["status"], url=server.url)
    assert result.returncode == 0, result.stderr
    header = next(line for line in result.stdout.splitlines() if "pool" in line)
    for column in ("target", "desired", "demand", "cap", "warm", "hot", "hot_idle"):
        assert column in header
    row = next(line for line in result.stdout.splitlines() if " demo " in line)
    assert row.split("│")[2].strip() == "1"


def test_status_and_pools_say_why_a_pools_spawns_fail(tmp_path: Path) -> None:
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    exits = {
        "name": "exits",
        "command": ["{python}", "-c", "raise SystemExit(3)"],
        "warm_target": 1,
    }
    text = config(fleet) + f"  - {json.dumps({**exits, 'claim_timeout_s': 1})}\n"
    srv = start_server(tmp_path, config=text, args=["--stop-workers"])
    try:
        said = "spawns failing"
        assert wait_until(lambda: said in run(["status"], url=srv.url).stdout, timeout=20)
        for args in (["status"], ["pools"], ["pools", "exits"]):
            shown = " ".join(run(args, url=srv.url).stdout.split())
            assert "pool exits: spawns failing (" in shown, (args, shown)
            assert "before ready: exited with code 3" in shown
            assert "pool demo:" not in shown
        # The claim that finds no worker says it too.
        refused = one_line_error(run(["claim", "-p", "exits", "-o", "acme"], url=srv.url), 1)
        assert "503" in refused and "exited with code 3" in refused
    finally:
        srv.stop()
        kill_fleet(fleet)


def test_status_and_pools_say_when_no_replica_sizes_a_pool() -> None:
    """A pool whose published sizing is stale (no replica led for three janitor
    intervals) gets a line saying so under the table: its desired and demand are old."""
    from stoker.cli.pools import _spawn_trouble
    from stoker.sdk import PoolInfo

    body = {
        "name": "db", "revision": "r1", "warm_target": 2, "desired_warm": 5, "demand": 3,
        "cap": 0, "max_workers_per_org": 0, "reuse": "same_org", "counts": {},
        "sized_by": "cp-1", "sizing_age_s": 42.4, "sizing_stale": True,
    }  # fmt: skip
    [line] = _spawn_trouble([PoolInfo.from_json(body)])
    assert line.plain == (
        "pool db: no replica has sized it for 42 s (none leads?); "
        "desired and demand are the last figures published"
    )
    fresh = {**body, "sizing_stale": False}
    assert _spawn_trouble([PoolInfo.from_json(fresh)]) == []
    # A server that does not say (older): nothing either.
    older = {k: v for k, v in body.items() if not k.startswith("siz")}
    assert _spawn_trouble([PoolInfo.from_json(older)]) == []


def ctrl_c_as_in_a_terminal() -> None:
    """In the child before exec: SIGINT at its default. A shell runs a background job
    with SIGINT ignored, and Python then never raises KeyboardInterrupt: a test suite
    started that way (`make test &`) would wait for a Ctrl-C that cannot arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_status_watch_refreshes_until_interrupted(server: Server) -> None:
    with subprocess.Popen(
        [STOKER, "status", "--watch", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_in_a_terminal,
        env=environment(STOKER_URL=server.url),
    ) as proc:
        # Interrupt only once two refreshes are out: a Ctrl-C while Python still starts
        # up (slow on a loaded machine) is an interrupted start, not an interrupted watch.
        seen: list[str] = []
        reader = threading.Thread(target=lambda: seen.extend(proc.stdout or ()), daemon=True)
        reader.start()
        for _ in range(1200):  # at most a minute
            if "".join(seen).count("demo") >= 2:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
        reader.join(timeout=10)
        err = proc.stderr.read() if proc.stderr else ""
    out = "".join(seen)
    assert proc.returncode == 0, err
    assert out.count("demo") >= 2, out
    assert "Traceback" not in err


def test_version() -> None:
    result = run(["version"])
    assert result.returncode == 0 and result.stdout.strip() == "stoker 0.1.0"


def test_bare_stoker_prints_the_help() -> None:
    result = run([])
    assert result.returncode == 0, result.stderr
    assert "Usage: stoker" in result.stdout
    for command in ("claims", "workers", "pools", "config", "status", "--install-completion"):
        assert command in result.stdout


def test_version_flag() -> None:
    result = run(["--version"])
    assert result.returncode == 0 and result.stdout.strip() == "stoker 0.1.0"


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["status", "--help"], "[default: 2.0]"),
        (["claim", "--help"], "[default: (prefer_warm)]"),
        (["claims", "list", "--help"], "[default: bound]"),
        (["workers", "list", "--help"], "[default: 1000]"),
    ],
)
def test_help_shows_the_defaults(args: list[str], shown: str) -> None:
    result = run(args, COLUMNS="200")
    assert result.returncode == 0, result.stderr
    assert shown in result.stdout


@pytest.mark.parametrize(
    "command",
    [["backtest"], ["scaletest"], ["pools", "set"], ["pools", "delete"], ["config", "check"]],
)
def test_help_paragraphs_wrap_once_in_80_columns(command: list[str]) -> None:
    """A command's description fills each line of a paragraph: its docstring's own line
    breaks (at about 88 characters) do not break an 80-column terminal's lines again."""
    result = run([*command, "--help"], COLUMNS="80")
    assert result.returncode == 0, result.stderr
    text = result.stdout.split("Usage:", 1)[1].split("╭", 1)[0]
    paragraphs: list[list[str]] = [[]]
    for line in text.splitlines()[1:]:  # after the usage line
        if line.strip():
            paragraphs[-1].append(line)
        elif paragraphs[-1]:
            paragraphs.append([])
    paragraphs = [p for p in paragraphs if p]
    assert len(paragraphs) >= 2, text
    for lines in paragraphs:
        # Every line but a paragraph's last is filled (within a word of 80 columns).
        short = [line for line in lines[:-1] if len(line.rstrip()) < 60]
        assert not short, text


@pytest.mark.parametrize(
    "args",
    [["release", ""], ["claims", "show", ""], ["claims", "renew", ".."], ["release", "."]],
)
def test_a_claim_id_that_is_no_id_says_so(args: list[str]) -> None:
    # Refused before anything is sent: the URL needs no server.
    line = one_line_error(run(args, url="http://127.0.0.1:9"), 1)
    assert f"invalid claim id {args[-1]!r}" in line and "307" not in line


def instant(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_claims_list_show_and_renew(server: Server) -> None:
    claim = json.loads(run(["claim", "-p", "demo", "-o", "initech"], url=server.url).stdout)
    listed = run(["claims", "list"], url=server.url)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if claim["id"] in line)
    assert "initech" in row and "bound" in row and claim["worker"]["id"] in row
    as_json = json.loads(run(["claims", "list", "--json"], url=server.url).stdout)
    [mine] = [c for c in as_json["claims"] if c["id"] == claim["id"]]
    # The listing never carries the session token.
    assert mine["worker"]["token"] is None and mine["org"] == "initech"

    shown = run(["claims", "show", claim["id"]], url=server.url)
    assert shown.returncode == 0, shown.stderr
    assert "initech" in shown.stdout and claim["worker"]["endpoint"] in shown.stdout
    assert (
        json.loads(run(["claims", "show", claim["id"], "--json"], url=server.url).stdout)["state"]
        == "bound"
    )

    renewed = run(["claims", "renew", claim["id"], "--lease-s", "120", "--json"], url=server.url)
    assert renewed.returncode == 0, renewed.stderr
    body = json.loads(renewed.stdout)
    # 120 s from the renewal, which came after the claim was made.
    lasts = instant(body["expires_at"]) - instant(body["created_at"])
    assert lasts.total_seconds() >= 120

    assert run(["release", claim["id"]], url=server.url).returncode == 0
    released = json.loads(
        run(["claims", "list", "--state", "released", "--json"], url=server.url).stdout
    )
    assert claim["id"] in {c["id"] for c in released["claims"]}
    assert claim["id"] not in run(["claims", "list"], url=server.url).stdout
    ended = one_line_error(run(["claims", "renew", claim["id"]], url=server.url), 1)
    assert "409" in ended
    assert "unknown claim" in one_line_error(
        run(["claims", "show", "c-missing"], url=server.url), 1
    )


def test_workers_list_with_filters(server: Server) -> None:
    claim = json.loads(run(["claim", "-p", "demo", "-o", "umbrella"], url=server.url).stdout)
    try:
        listed = run(["workers", "list"], url=server.url)
        assert listed.returncode == 0, listed.stderr
        assert claim["worker"]["id"] in listed.stdout
        hot = json.loads(
            run(
                ["workers", "list", "--state", "hot", "--org", "umbrella", "--json"],
                url=server.url,
            ).stdout
        )
        [worker] = hot["workers"]
        assert worker["id"] == claim["worker"]["id"] and worker["claim_id"] == claim["id"]
        other = run(["workers", "list", "--pool", "nope", "--json"], url=server.url)
        assert json.loads(other.stdout) == {"workers": [], "next": None}
        table = run(["workers", "list", "-s", "hot", "-o", "umbrella"], url=server.url)
        assert "1 workers" in table.stdout and claim["id"] in table.stdout
    finally:
        run(["release", claim["id"]], url=server.url)


def test_listings_with_all_fetch_page_after_page(server: Server) -> None:
    # The server's fleet moves on meanwhile (refills, expiries): what is asserted is that
    # one-row pages bring every row this test made, each once, oldest first.
    claims = [
        json.loads(run(["claim", "-p", "demo", "-o", f"hooli{i}"], url=server.url).stdout)
        for i in range(2)
    ]
    try:
        mine = {
            "claims": {c["id"] for c in claims},
            "workers": {c["worker"]["id"] for c in claims},
        }
        for what in ("workers", "claims"):
            one = json.loads(run([what, "list", "-n", "1", "--json"], url=server.url).stdout)
            assert len(one[what]) == 1 and one["next"]
            # A script pages by hand: each page's `next` is the `--after` of the page after.
            ids, after = [one[what][0]["id"]], one["next"]
            while after is not None:
                args = [what, "list", "-n", "1", "--after", after, "--json"]
                page = json.loads(run(args, url=server.url).stdout)
                ids += [row["id"] for row in page[what]]
                after = page["next"]
            assert mine[what] <= set(ids) and len(ids) == len(set(ids))
            # The table of one page says that it is one, and how to ask for the next.
            table = " ".join(run([what, "list", "-n", "1"], url=server.url).stdout.split())
            assert "more may follow; --after=" in table
            paged = run([what, "list", "--all", "-n", "1", "--json"], url=server.url)
            assert paged.returncode == 0, paged.stderr
            every = json.loads(paged.stdout)
            # Every page was fetched: nothing follows.
            assert every["next"] is None
            rows = every[what]
            ids = [row["id"] for row in rows]
            assert mine[what] <= set(ids) and len(ids) == len(set(ids))
            # Oldest first (shown to the millisecond, so ties by id are not checked).
            created = [instant(row["created_at"]) for row in rows]
            assert created == sorted(created)
    finally:
        for claim in claims:
            run(["release", claim["id"]], url=server.url)


def test_pools_lists_and_shows_pools(server: Server) -> None:
    listed = run(["pools"], url=server.url)
    assert listed.returncode == 0, listed.stderr
    header = next(line for line in listed.stdout.splitlines() if "pool" in line and "reuse" in line)
    for column in ("revision", "target", "desired", "demand", "cap", "per org", "workers"):
        assert column in header
    as_json = json.loads(run(["pools", "--json"], url=server.url).stdout)
    assert [p["name"] for p in as_json["pools"]] == ["demo"]
    one = json.loads(run(["pools", "demo", "--json"], url=server.url).stdout)
    # Counts (the pool's and its revisions'), the sizing and its time and age move between
    # the two calls (a janitor pass may land between them); everything else is the same.
    moving = {
        k: one[k]
        for k in (
            "counts",
            "revisions",
            "sizing",
            "desired_warm",
            "demand",
            "sized_at",
            "sizing_age_s",
        )
    }
    assert one["warm_target"] == 1 and one == as_json["pools"][0] | moving
    assert "unknown pool 'nope'" in one_line_error(run(["pools", "nope"], url=server.url), 1)


def test_pools_set_and_drain_change_the_stored_pool(server: Server) -> None:
    before = json.loads(run(["pools", "show", "demo", "--json"], url=server.url).stdout)
    generation = before["generation"]
    try:
        changed = run(["pools", "set", "demo", "--lease-s", "45", "--json"], url=server.url)
        assert changed.returncode == 0, changed.stderr
        body = json.loads(changed.stdout)
        assert body["settings"]["lease_s"] == 45 and body["generation"] == generation + 1
        stale = run(
            ["pools", "set", "demo", "--lease-s", "30", "--generation", str(generation)],
            url=server.url,
        )
        assert "generation" in one_line_error(stale, 1)
        assert "nothing to change" in one_line_error(
            run(["pools", "set", "demo"], url=server.url), 2
        )
        drained = run(["pools", "drain", "demo"], url=server.url)
        assert drained.returncode == 0 and "demo (draining)" in drained.stdout
        shown = run(["pools", "show", "demo"], url=server.url).stdout
        assert "revisions (generation" in shown and "stable" in shown and "100 %" in shown
    finally:
        run(["pools", "drain", "demo", "--undo"], url=server.url)
        run(["pools", "set", "demo", "--lease-s", "60"], url=server.url)
    after = json.loads(run(["pools", "demo", "--json"], url=server.url).stdout)
    assert after["draining"] is False and after["settings"]["lease_s"] == 60


async def store_pool_gone_from_the_config(server: Server, name: str) -> None:
    """Store a drained pool the server's config file does not declare (as another
    replica's older file would have)."""
    spec = PoolSpec(name=name, template=ProcessTemplate(argv=tuple(DEMO)))
    store = SqliteStore(str(server.workdir / "stoker.db"))
    await store.open()
    try:
        await store.create_pool(StoredPool(spec, 0, draining=True), now=1.0)
    finally:
        await store.close()


def test_pools_delete_asks_for_yes_and_prints_what_it_removed(server: Server) -> None:
    asyncio.run(store_pool_gone_from_the_config(server, "gone"))
    asked = run(["pools", "delete", "gone"], url=server.url)
    assert "--yes" in one_line_error(asked, 2)
    in_config = run(["pools", "delete", "demo", "--yes"], url=server.url)
    assert "config file" in one_line_error(in_config, 1)
    deleted = run(["pools", "delete", "gone", "--yes"], url=server.url)
    assert deleted.returncode == 0, deleted.stderr
    assert deleted.stdout.startswith("deleted pool gone (generation 1): removed ")
    assert "pools: 1" in deleted.stdout and "revisions: 1" in deleted.stdout
    listed = json.loads(run(["pools", "--json"], url=server.url).stdout)
    assert "gone" not in [p["name"] for p in listed["pools"]]
    again = run(["pools", "delete", "gone", "--yes", "--json"], url=server.url)
    assert "unknown pool" in one_line_error(again, 1)


def test_rollout_start_takes_command_and_refuses_an_empty_one(server: Server) -> None:
    before = json.loads(run(["pools", "show", "demo", "--json"], url=server.url).stdout)
    for words in ('""', "''", "   ", "python ''"):
        empty = run(["rollout", "start", "demo", "--command", words], url=server.url)
        assert "--command" in one_line_error(empty, 2)
    unclosed = run(["rollout", "start", "demo", "--command", "python 'x"], url=server.url)
    assert "--command" in one_line_error(unclosed, 2)
    # argv is no option (the command line is --command everywhere).
    argv = run(["rollout", "start", "demo", "--argv", "python"], url=server.url)
    assert argv.returncode == 2 and "--argv" in argv.stderr and "Traceback" not in argv.stderr
    same = run(["rollout", "start", "demo", "--command", shlex.join(DEMO)], url=server.url)
    assert "serves this template already" in one_line_error(same, 1)
    bad_env = run(["rollout", "start", "demo", "--env", "1X=y"], url=server.url)
    assert "env" in one_line_error(bad_env, 1)
    after = json.loads(run(["pools", "show", "demo", "--json"], url=server.url).stdout)
    assert after["generation"] == before["generation"] and after["rollout"] is None


def test_pools_set_and_rollout_start_check_with_the_server_s_models(server: Server) -> None:
    # Refused before anything is sent (status 2), in the words the server would answer.
    before = json.loads(run(["pools", "show", "demo", "--json"], url=server.url).stdout)
    short = run(["pools", "set", "demo", "--lease-s", "0.001"], url=server.url)
    assert one_line_error(short, 2) == "stoker: lease_s: must be at least 1"
    many = run(["pools", "set", "demo", "--warm-target", "100001"], url=server.url)
    assert one_line_error(many, 2) == "stoker: warm_target: must be at most 100000"
    steps = run(["rollout", "start", "demo", "--env", "V=2", "--steps", "50,10"], url=server.url)
    assert one_line_error(steps, 2) == (
        "stoker: strategy.steps.1: must exceed the step before (50)"
    )
    after = json.loads(run(["pools", "show", "demo", "--json"], url=server.url).stdout)
    assert after["generation"] == before["generation"] and after["rollout"] is None


def test_config_check_prints_the_effective_config_with_secrets_masked(tmp_path: Path) -> None:
    secrets = ["hunter2-pass", "adm1n-token-0123456789abcdef", "org-token-0123456789abcdef"]
    key = "k" * 40
    (tmp_path / "stoker.yaml").write_text(
        f"store: postgresql://stoker:{secrets[0]}@db:5432/stoker\n"
        f"api: {{admin_tokens: [{secrets[1]}], org_tokens: {{{secrets[2]}: acme}}}}\n"
        "pools:\n  - {name: p, command: [x], warm_target: 3}\n"
    )
    result = run(
        ["config", "check", "-c", str(tmp_path / "stoker.yaml")],
        STOKER_ACTIVATION__KEY=key,
    )
    assert result.returncode == 0, result.stderr
    for secret in [*secrets, key]:
        assert secret not in result.stdout
    assert "STOKER_ACTIVATION__KEY" in result.stdout.splitlines()[0]
    shown = json.loads(
        run(
            ["config", "check", "-c", str(tmp_path / "stoker.yaml"), "--json"],
            STOKER_ACTIVATION__KEY=key,
        ).stdout
    )
    assert shown["store"] == "postgresql://stoker:***@db:5432/stoker"
    assert shown["api"]["admin_tokens"] == ["***"]
    assert shown["api"]["org_tokens"] == {"***1": "acme"}
    assert shown["activation"]["key"] == "***"
    # The effective config: defaults filled in.
    assert shown["pools"][0]["warm_target"] == 3 and shown["pools"][0]["lease_s"] == 60


def test_config_check_exits_1_with_the_config_errors(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(
        "api: {prot: 80}\npools:\n  - {name: p, command: [x], warm_target: -1}\n"
    )
    result = run(["config", "check", "-c", str(tmp_path / "bad.yaml")])
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"config error: api.prot: unknown key (from {tmp_path / 'bad.yaml'})",
        f"config error: pools[0].warm_target: must be >= 0 (from {tmp_path / 'bad.yaml'})",
    ]
    public = run(
        ["config", "check", "-c", str(tmp_path / "bad.yaml")],
        STOKER_API__HOST="0.0.0.0",
    )
    assert public.returncode == 1 and "Traceback" not in public.stderr


def test_status_stays_readable_at_80_columns(server: Server) -> None:
    result = run(["status"], url=server.url, COLUMNS="80")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), result.stdout
    assert "…" not in result.stdout
    headers = " ".join(line for line in lines if line.startswith("pool"))
    for column in ("target", "desired", "demand", "cap", *("warm", "hot", "hot_idle")):
        assert f" {column} " in f"{headers} "
    assert "updated" in lines[0]


def test_status_keeps_every_header_and_pool_in_a_narrow_terminal(server: Server) -> None:
    """Narrower than the workers-by-state table (a split pane), the states go in more
    tables, each led by the pool: no header is cut and no row loses its pool."""
    result = run(["status"], url=server.url, COLUMNS="50")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert all(len(line) <= 50 for line in lines), result.stdout
    assert "…" not in result.stdout
    tables = [line for line in lines if line.startswith("pool")]
    assert len(tables) >= 3
    headers = " ".join(tables)
    for column in ("spawning", "warm", "reserved", "activating", "hot", "hot_idle", "draining"):
        assert f" {column} " in f"{headers} "
    assert sum(line.startswith("demo ") for line in lines) == len(tables)


def test_status_json(server: Server) -> None:
    result = run(["status", "--json"], url=server.url)
    assert result.returncode == 0, result.stderr
    assert [p["name"] for p in json.loads(result.stdout)["pools"]] == ["demo"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_status_watch_rides_out_a_server_that_is_down(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [STOKER, "status", "--watch", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_in_a_terminal,
        env=environment(STOKER_URL=url),
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    def next_line_with(text: str) -> str:
        deadline = time.perf_counter() + 60
        while time.perf_counter() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r}")

    threading.Thread(target=pump, daemon=True).start()
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    srv = None
    try:
        error = next_line_with("cannot reach stoker")
        assert error.startswith("stoker: ") and "retrying every 0.2 s" in error
        assert proc.poll() is None
        srv = start_server(tmp_path, config=config(fleet).replace("port: 0", f"port: {port}"))
        assert next_line_with(f"stoker at {url} · updated ")
        next_line_with(" demo ")
        srv.stop()
        srv = None
        next_line_with("cannot reach stoker")
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
        if srv is not None:
            srv.stop()
        kill_fleet(fleet)
    assert proc.returncode == 0 and "Traceback" not in err


def test_an_unreachable_server_is_one_line() -> None:
    for args in (["status"], ["claim", "-p", "demo", "-o", "acme"], ["release", "c-1"]):
        line = one_line_error(run(args, url="http://127.0.0.1:9"), 1)
        assert "cannot reach stoker at http://127.0.0.1:9" in line


def test_server_side_errors_are_one_line(server: Server) -> None:
    assert "unknown pool 'nope'" in one_line_error(
        run(["claim", "-p", "nope", "-o", "acme"], url=server.url), 1
    )
    assert "unknown claim" in one_line_error(run(["release", "c-missing"], url=server.url), 1)
    invalid = one_line_error(run(["claim", "-p", "demo", "-o", " padded "], url=server.url), 1)
    assert "422" in invalid and "org" in invalid


@pytest.mark.parametrize(
    "args",
    [
        ["claim", "--pool", "demo"],
        ["claim", "--pool", "demo", "--org", "acme", "--timeout-s", "-1"],
        ["claim", "--pool", "demo", "--org", "acme", "--mode", "hot"],
        ["claim", "--pool", "demo", "--org", "acme", "--set", "no-equals-sign"],
        ["claim", "--pool", "demo", "--org", "acme", "--lease-s", "0"],
        ["claim", "--pool", "demo", "--org", "acme", "-c", "role=ro"],
        ["claim", "--url", "http://[::1", "--pool", "demo", "--org", "acme"],
        ["--url", "ftp://example.org", "status"],
        ["rollout", "start", "demo", "--command", "'unbalanced"],
        ["rollout", "start", "demo", "--argv", "'unbalanced"],
        ["release"],
        ["status", "--interval", "fast"],
        ["status", "--json", "--watch"],
        ["claims", "list", "--state", "open"],
        ["claims", "renew"],
        ["workers", "list", "--state", "dead"],
        ["workers", "list", "--limit", "0"],
        ["config", "check"],
        ["frobnicate"],
        ["serve", "--no-such-flag"],
    ],
)
def test_bad_arguments_are_one_line_and_status_2(args: list[str]) -> None:
    one_line_error(run(args, url="http://127.0.0.1:9"), 2)


def test_config_check_names_where_a_checked_key_was_set(tmp_path: Path) -> None:
    # The checks after loading (exposure, token files) name the file or the variable too.
    config = tmp_path / "stoker.yaml"
    config.write_text(f"api: {{admin_tokens_file: {tmp_path / 'missing'}}}\n")
    result = run(["config", "check", "-c", str(config)])
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"config error: api.admin_tokens_file: cannot read '{tmp_path / 'missing'}': No such "
        f"file or directory (from {config})"
    ]
    result = run(
        ["config", "check", "-c", str(config)],
        STOKER_API__ADMIN_TOKENS_FILE=str(tmp_path / "other"),
    )
    assert result.stderr.strip().splitlines() == [
        f"config error: api.admin_tokens_file: cannot read '{tmp_path / 'other'}': No such "
        "file or directory (from STOKER_API__ADMIN_TOKENS_FILE)"
    ]
    config.write_text("api: {host: 0.0.0.0}\n")
    result = run(["config", "check", "-c", str(config)])
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("config error: api.host: '0.0.0.0' is reachable from other machines")
    assert line.endswith(f"or listen on 127.0.0.1 (from {config})")


def test_serve_rejects_a_bad_config_naming_the_key(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(
        "api: {prot: 80}\npools:\n  - {name: p, command: [x], warm_target: -1}\n"
    )
    result = run(["serve", "-c", str(tmp_path / "bad.yaml")])
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    bad = tmp_path / "bad.yaml"
    assert f"config error: api.prot: unknown key (from {bad})" in lines
    assert f"config error: pools[0].warm_target: must be >= 0 (from {bad})" in lines
    assert "Traceback" not in result.stderr
    missing = run(["serve", "-c", str(tmp_path / "missing.yaml")])
    assert missing.returncode != 0 and "Traceback" not in missing.stderr


def test_serve_announces_its_runtime_and_elector(server: Server) -> None:
    line = server.lines[-1]
    assert "store: sqlite:///./stoker.db; runtime: local; leader election: none;" in line


def test_serve_names_the_key_when_kubernetes_credentials_do_not_load(tmp_path: Path) -> None:
    (tmp_path / "k8s.yaml").write_text(
        f"runtime: {{kind: kubernetes, kubeconfig: {tmp_path}/missing}}\n"
        "api: {port: 0}\npools:\n  - {name: db, pod: {image: 'worker:1'}}\n"
    )
    result = run(["serve", "-c", str(tmp_path / "k8s.yaml")])
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("config error: runtime.kubeconfig: cannot load the Kubernetes")
    assert f"{tmp_path}/missing" in line
    assert line.endswith(f" (from {tmp_path / 'k8s.yaml'})")
    assert "listening" not in result.stdout


def test_serve_refuses_a_public_address_without_tokens(tmp_path: Path) -> None:
    result = subprocess.run(
        [STOKER, "serve"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=environment(STOKER_API__HOST="0.0.0.0", STOKER_API__PORT="0"),
        check=False,
    )
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("config error: api.host: '0.0.0.0' is reachable from other machines")
    assert "no tokens are configured" in line
    assert line.endswith(" (from STOKER_API__HOST)")
    assert not (tmp_path / "stoker.db").exists()


def test_serve_on_a_port_in_use_is_one_line(server: Server, tmp_path: Path) -> None:
    port = server.url.rsplit(":", 1)[1]
    result = subprocess.run(
        [STOKER, "serve"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=environment(STOKER_API__PORT=port),
        check=False,
    )
    line = one_line_error(result, 1)
    assert f"cannot listen on 127.0.0.1:{port}" in line


@pytest.mark.parametrize(
    ("key", "says"),
    [
        # The default key file goes next to the database: its directory is missing first.
        (None, "config error: store: the activation key next to the SQLite file: cannot create"),
        ("k" * 40, "stoker: could not start: cannot open sqlite store"),
    ],
)
def test_serve_with_a_store_it_cannot_open_says_why(
    tmp_path: Path, key: str | None, says: str
) -> None:
    env = environment(STOKER_API__PORT="0", STOKER_STORE="sqlite:///./no/such/dir/s.db")
    if key is not None:
        env["STOKER_ACTIVATION__KEY"] = key
    result = subprocess.run(
        [STOKER, "serve"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 1
    assert says in result.stderr and "no/such/dir" in result.stderr
    assert "Traceback" not in result.stderr
    if says.startswith("config error: "):
        assert result.stderr.strip().endswith(" (from STOKER_STORE)")


def settled(url: str, fleet: str) -> bool:
    """Nothing spawning, the pool at its desired warm count, one process per live worker."""
    pool: dict[str, Any] = httpx.get(f"{url}/v1/pools/demo", timeout=5).json()
    counts = pool["counts"]
    return bool(
        counts["spawning"] == 0
        and counts["warm"] >= pool["desired_warm"]
        and len(fleet_processes(fleet)) == sum(counts.values())
    )


def test_sigterm_drains_and_leaves_workers_for_the_next_start(tmp_path: Path) -> None:
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    try:
        first = start_server(tmp_path, config=config(fleet, warm_target=2))
        claimed = json.loads(run(["claim", "-p", "demo", "-o", "acme"], url=first.url).stdout)
        # Wait for the pool to settle (the claim makes the janitor spawn a replacement),
        # so that the workers counted here are all the workers there will be.
        assert wait_until(lambda: settled(first.url, fleet), timeout=15)
        workers = {p.pid for p in fleet_processes(fleet)}
        assert len(workers) >= 2
        assert first.stop(signal.SIGTERM) == 0
        assert "stoker stopped" in first.tail
        assert "event=control_plane_stopped" in first.log()
        # The workers outlive the server ...
        assert {p.pid for p in fleet_processes(fleet)} == workers

        # ... and the next start adopts them: the session's worker is still bound to it.
        second = start_server(
            tmp_path, config=config(fleet, warm_target=2), args=["--stop-workers"]
        )
        held = json.loads(run(["release", claimed["id"]], url=second.url).stdout)
        assert held["state"] == "released"
        again = json.loads(run(["claim", "-p", "demo", "-o", "acme"], url=second.url).stdout)
        assert again["worker"]["id"] == claimed["worker"]["id"] and again["source"] == "reuse"
        assert "event=worker_adopted" in second.log()

        # --stop-workers: nothing is left behind.
        assert second.stop(signal.SIGTERM) == 0
        assert wait_until(lambda: not fleet_processes(fleet), timeout=15)
    finally:
        kill_fleet(fleet)


def test_a_replica_whose_registration_expired_exits_for_a_fresh_start(tmp_path: Path) -> None:
    # A replica paused (or cut off from the store) for longer than instance_expiry_s is
    # dead to the others: they adopt its workers. When it runs again it must not go on
    # under that identity; it exits, non-zero, so that its supervisor starts a new one.
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    text = config(fleet).replace(
        "intervals: {", "intervals: {instance_heartbeat_s: 0.2, instance_expiry_s: 30, "
    )
    try:
        srv = start_server(tmp_path, config=text)
        assert wait_until(lambda: settled(srv.url, fleet), timeout=15)
        workers = {p.pid for p in fleet_processes(fleet)}
        with sqlite3.connect(tmp_path / "stoker.db") as db:
            # What another replica's janitor does to an instance whose heartbeat is stale.
            db.execute("UPDATE instances SET state = 'expired' WHERE state = 'active'")
        assert wait_until(lambda: srv.proc.poll() is not None, timeout=20)
        assert srv.stop() == 1
        log = srv.log()
        assert "event=instance_expired_while_alive" in log
        problem = [line for line in log.splitlines() if line.startswith("stoker: ")]
        assert len(problem) == 1 and "expired while running" in problem[0], log
        assert "Traceback" not in log
        # Its workers are left for the next start (or the other replicas) to adopt.
        assert {p.pid for p in fleet_processes(fleet)} == workers
    finally:
        kill_fleet(fleet)


# -- --json on every command ----------------------------------------------------------------


def _leaf_commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for name, command in getattr(group, "commands", {}).items():
        if getattr(command, "commands", None):
            yield from _leaf_commands(command, (*path, name))
        else:
            yield (*path, name), command


def test_every_command_takes_json() -> None:
    import typer

    from stoker.cli.app import app

    leaves = list(_leaf_commands(typer.main.get_command(app)))
    assert len(leaves) >= 10
    lacking = [
        " ".join(path)
        for path, command in leaves
        if not any("--json" in getattr(p, "opts", ()) for p in command.params)
    ]
    assert lacking == []


def test_version_json() -> None:
    result = run(["version", "--json"])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"version": "0.1.0"}


def test_worker_check_json() -> None:
    command = ["{python}", "-m", "stoker.demo_worker", "--port", "{port}"]
    result = run(["worker-check", "--json", "--", *command, "--worker-id", "{worker_id}"])
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["passed"] is True and report["command"][:3] == command[:3]
    assert report["rules"] and all(rule["passed"] for rule in report["rules"])
    assert {"rule", "expected", "got", "passed"} <= set(report["rules"][0])


def test_scaletest_json_from_an_empty_directory(tmp_path: Path) -> None:
    args = ["scaletest", "cold-ramp", "--short", "--policy", "stoker", "--no-progress"]
    result = subprocess.run(
        [STOKER, *args, "--json", "--out", "out"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment(),
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["scenario"] == "cold-ramp" and summary["stoker_violations"] == 0
    assert set(summary["policies"]) == {"stoker"} == set(summary["headlines"])
    assert (tmp_path / "out" / "summary.json").exists()


def test_serve_json_announces_itself_and_logs_json(tmp_path: Path) -> None:
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    (tmp_path / "stoker.yaml").write_text(config(fleet))
    proc = subprocess.Popen(
        [STOKER, "serve", "-c", "stoker.yaml", "--json", "--stop-workers"],
        cwd=tmp_path,
        env=environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        started = json.loads(proc.stdout.readline())
        assert started["event"] == "listening" and started["pools"] == ["demo"]
        assert started["url"].startswith("http://127.0.0.1:")
        assert httpx.get(started["url"] + "/healthz", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        kill_fleet(fleet)
    assert proc.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"event": "stopped"}
    lines = [json.loads(line) for line in err.strip().splitlines()]
    assert any(line.get("event") == "control_plane_started" for line in lines)


def test_a_bad_choice_is_said_without_the_parser_s_words() -> None:
    line = one_line_error(run(["workers", "list", "--state", "bogus"]), 2)
    assert "'bogus' is not one of" in line and "Value error" not in line


# -- one grammar (#26): every case of the CLI paragraph ------------------------------


def test_url_and_token_work_before_the_command_and_after_it(server: Server) -> None:
    # Before the command (as docs/getting-started.md shows them) with no $STOKER_URL:
    # no "No such option".
    before = run(["--url", server.url, "pools", "list", "--json"])
    assert before.returncode == 0, before.stderr
    assert [p["name"] for p in json.loads(before.stdout)["pools"]] == ["demo"]
    rollout = run(["--url", server.url, "rollout", "status", "demo", "r-none"])
    assert "has no rollout" in one_line_error(rollout, 1)
    after = run(["rollout", "status", "demo", "r-none", "--url", server.url])
    assert "has no rollout" in one_line_error(after, 1)
    # Nearest the command wins: after it, over before it, over $STOKER_URL.
    nearest = run(["--url", "http://127.0.0.1:9", "status", "--url", server.url, "--json"])
    assert nearest.returncode == 0, nearest.stderr
    given = run(["--url", server.url, "status", "--json"], url="http://127.0.0.1:9")
    assert given.returncode == 0, given.stderr


def test_backtest_reads_the_server_given_before_the_command(server: Server) -> None:
    # A pool the log has no claim of: the answer says the server's log was read.
    before = run(["--url", server.url, "backtest", "--pool", "nosuch", "--no-progress"])
    assert "no claim of pool 'nosuch'" in one_line_error(before, 2)
    from_env = run(["backtest", "--pool", "nosuch", "--no-progress"], url=server.url)
    assert "no claim of pool 'nosuch'" in one_line_error(from_env, 2)


def test_every_list_is_noun_list(server: Server) -> None:
    for noun in ("pools", "claims", "workers"):
        listed = run([noun, "list", "--json"], url=server.url)
        assert listed.returncode == 0, (noun, listed.stderr)
        assert noun in json.loads(listed.stdout)
    # `stoker pools` alone still lists, and `pools list` is no pool named "list".
    assert json.loads(run(["pools", "--json"], url=server.url).stdout)["pools"]


def test_one_name_per_concept_across_commands() -> None:
    import typer

    from stoker.cli.app import app

    names: dict[str, set[str]] = {}
    for path, command in _leaf_commands(typer.main.get_command(app)):
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            for opt in getattr(param, "opts", ()):
                names.setdefault(opt, set()).add(" ".join(path))
    # Seconds are named as the API names them; the old names are hidden aliases only.
    for old in ("--lease", "--timeout", "--ttl", "--step-interval", "--ready-timeout"):
        assert old not in names, names[old]
    assert names["--lease-s"] >= {"claim", "claims renew", "pools set"}
    assert "claim" in names["--ttl-s"] and "claim" in names["--timeout-s"]
    # `-c` has one meaning: the config file.
    assert names["-c"] == {"serve", "config check", "backtest"}
    assert names["--config"] == {"serve", "config check", "backtest"}


def test_the_old_option_names_still_work_and_say_so(server: Server) -> None:
    claimed = run(["claim", "-p", "demo", "-o", "acme", "--lease", "5"], url=server.url)
    assert claimed.returncode == 0, claimed.stderr
    assert json.loads(claimed.stdout)["lease_s"] == 5
    assert claimed.stderr.strip() == "stoker: --lease is deprecated; use --lease-s"
    assert run(["release", json.loads(claimed.stdout)["id"]], url=server.url).returncode == 0


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["claim", "--url", "http://[::1", "-p", "demo", "-o", "acme"], "--url"),
        (["--url", "http://[::1", "claim", "-p", "demo", "-o", "acme"], "--url"),
        (["rollout", "start", "demo", "--command", "'unbalanced"], "--command"),
        (["rollout", "start", "demo", "--argv", "'unbalanced"], "--argv"),
    ],
)
def test_the_inputs_that_ended_in_a_traceback_are_one_line(args: list[str], said: str) -> None:
    assert said in one_line_error(run(args, url="http://127.0.0.1:9"), 2)


def test_config_check_masks_every_secret_of_a_url_and_says_schema(tmp_path: Path) -> None:
    secrets = ["userinfo-pw", "query-pw", "ssl-pw", "query-token", "env-pw"]
    (tmp_path / "stoker.yaml").write_text(
        f"store: 'postgresql://stoker:{secrets[0]}@db:5432/stoker?sslmode=require"
        f"&password={secrets[1]}&sslpassword={secrets[2]}&api_token={secrets[3]}'\n"
        "store_options: {schema: tenants}\n"
        f"pools:\n  - {{name: p, command: [x], env: {{DB_PASSWORD: {secrets[4]}, MODE: ro}}}}\n"
    )
    for args in ([], ["--json"]):
        result = run(["config", "check", "--config", str(tmp_path / "stoker.yaml"), *args])
        assert result.returncode == 0, result.stderr
        for secret in secrets:
            assert secret not in result.stdout
    shown = json.loads(result.stdout)
    assert shown["store"] == (
        "postgresql://stoker:***@db:5432/stoker?sslmode=require"
        "&password=***&sslpassword=***&api_token=***"
    )
    # The key names of the file and the documentation, not the code's.
    assert shown["store_options"]["schema"] == "tenants" and "db_schema" not in result.stdout
    assert shown["pools"][0]["env"] == {"DB_PASSWORD": "***", "MODE": "ro"}


def test_config_check_of_a_pod_pool_says_nothing_but_the_config(tmp_path: Path) -> None:
    (tmp_path / "k8s.yaml").write_text(
        "runtime: {kind: kubernetes}\n"
        "pools:\n  - {name: db, pod: {image: 'worker:1', cpu: 500m, memory: 256Mi}}\n"
    )
    result = run(["config", "check", "--config", str(tmp_path / "k8s.yaml"), "--json"])
    assert result.returncode == 0 and result.stderr == "", result.stderr
    pod = json.loads(result.stdout)["pools"][0]["pod"]
    assert (pod["command"], pod["args"], pod["tolerations"]) == ([], [], [])
