"""The backtest against a live run: a real `stoker serve` records claims, the backtest
replays them, and the cold shares agree within `TOLERANCE`.

The log is the server's own claim log, exported with `stoker claims export`; the live
cold share is what the clients saw. The spawn-to-ready time handed to the backtest is the
live run's own: the waits of its cold claims. The replicas' janitor interval is read from
the same config file. A recommendation is checked live too: the `stoker pools set` line
`--recommend --url` prints, run as printed, and the same traffic driven again.
"""

from __future__ import annotations

import json
import random
import re
import shlex
import statistics
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from servers import DEMO, STOKER, Server, environment, kill_fleet, start_server, wait_until

#: |backtest cold share - live cold share| at most this (absolute). The simulator's pods
#: are not the live run's local processes: a cold start there is the spawn-to-ready time
#: drawn from a log-normal fitted to the live cold waits, and the control plane's first
#: fill of the pool and its timer phases differ.
TOLERANCE = 0.15
ORGS = ("acme", "globex", "initech")
#: Arrivals are unix seconds in the log; only their differences matter to a replay.
EPOCH_S = 1_700_000_000.0
CLAIMS = 45
#: How long a demo worker of the live run takes to get ready once started.
START_DELAY_S = 1.0


def _config(fleet: str) -> str:
    # Workers ready a second after they start: a burst outruns the refill on any machine,
    # so the run has cold claims however fast this one is.
    command = [*DEMO, "--start-delay", str(START_DELAY_S)]
    pool = {"name": "demo", "command": command, "warm_target": 1, "hot_idle_ttl": 2}
    return (
        f"store: sqlite:///./stoker.db\nfleet: {fleet}\napi: {{port: 0}}\n"
        "intervals: {janitor_interval_s: 0.5, shutdown_grace_s: 5}\n"
        f"pools:\n  - {json.dumps(pool)}\n"
    )


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    workdir = tmp_path_factory.mktemp("live")
    srv = start_server(workdir, config=_config(fleet), args=["--stop-workers"])
    try:
        yield srv, workdir / "stoker.yaml"
    finally:
        srv.stop()
        kill_fleet(fleet)


def _drive(url: str) -> list[dict[str, Any]]:
    """Claims at random times (bursts of a few, pauses), each held 1-4 s, from 3 orgs."""
    rng = random.Random(7)
    sent: list[dict[str, Any]] = []
    threads = []
    lock = threading.Lock()

    def session(org: str, hold: float) -> None:
        at = EPOCH_S + time.perf_counter()
        with httpx.Client(base_url=url, timeout=60) as client:
            answer = client.post("/v1/claims", json={"pool": "demo", "org": org})
            waited = EPOCH_S + time.perf_counter() - at
            row: dict[str, Any] = {"at": at, "org": org, "wait_s": waited}
            if answer.status_code == 201:
                claim = answer.json()
                row.update(id=claim["id"], source=claim["source"])
                time.sleep(hold)
                client.delete(f"/v1/claims/{claim['id']}")
            else:
                row.update(id=None, source=None)
        with lock:
            sent.append(row)

    for i in range(CLAIMS):
        # Bursts of three every so often: more than the warm pool holds.
        time.sleep(rng.choice((0.1, 0.1, 0.3, 2.5)) if i % 3 else rng.uniform(2.0, 5.0))
        thread = threading.Thread(
            target=session, args=(rng.choice(ORGS), rng.uniform(1.0, 4.0)), daemon=True
        )
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(120)
    return sorted(sent, key=lambda r: r["at"])


def _export(url: str, path: Path) -> list[dict[str, Any]]:
    """`stoker claims export` of the run, once every claim of it is in the log (the
    replicas write the log in batches, each janitor pass)."""
    entries: list[dict[str, Any]] = []
    for _ in range(30):
        result = subprocess.run(
            [STOKER, "claims", "export", "--since", "1h", "--pool", "demo", "--url", url,
             "--out", str(path)],
            capture_output=True, text=True, timeout=60, env=environment(), check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        entries = [json.loads(line) for line in path.read_text().splitlines() if line]
        if len(entries) >= CLAIMS and all(e["outcome"] != "open" for e in entries):
            break
        time.sleep(1)
    return entries


@pytest.fixture(scope="module")
def recorded(
    live: tuple[Server, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[dict[str, Any]], Path]:
    """The live run: what the clients saw, and the server's log of it, exported."""
    server, _ = live
    time.sleep(3)  # the warm pool fills, as the backtest's lead lets it
    sent = _drive(server.url)
    log = tmp_path_factory.mktemp("recorded") / "claims.jsonl"
    exported = _export(server.url, log)
    assert len(exported) == CLAIMS
    return sent, log


def _spawn_s(bound: list[dict[str, Any]]) -> str:
    """The live run's spawn-to-ready time: its cold claims' waits, or (a machine fast
    enough that none was cold) the workers' start delay."""
    cold_waits = sorted(r["wait_s"] for r in bound if r["source"] == "cold")
    p50 = statistics.median(cold_waits) if cold_waits else START_DELAY_S
    p99 = max(cold_waits[-1], p50) if cold_waits else START_DELAY_S
    return f"{p50:.3f}:{p99:.3f}"


def test_the_backtest_reproduces_a_live_runs_cold_share(
    live: tuple[Server, Path], recorded: tuple[list[dict[str, Any]], Path]
) -> None:
    _, config = live
    sent, log = recorded
    bound = [r for r in sent if r["source"] is not None]
    assert len(bound) == CLAIMS
    live_cold = sum(r["source"] == "cold" for r in bound) / len(bound)
    assert live_cold < 1, "the run must have some warm claims"
    result = subprocess.run(
        [STOKER, "backtest", "--from", str(log), "--config", str(config),
         "--spawn-s", _spawn_s(bound), "--json", "--jobs", "1"],
        capture_output=True, text=True, timeout=600, env=environment(), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["recorded_cold_share"] == pytest.approx(live_cold)
    replayed = body["runs"][0]["cold_share"]
    print(f"cold share: live {live_cold:.3f}, backtest {replayed:.3f}")
    assert abs(replayed - live_cold) <= TOLERANCE, (replayed, live_cold)


def test_recommend_on_the_live_log_finds_settings_whose_rerun_meets_the_target(
    live: tuple[Server, Path], recorded: tuple[list[dict[str, Any]], Path]
) -> None:
    """The live run's warm target of 1 leaves bursts cold; a search for a cold share of
    at most 2 % (no cold claim of the 45) finds a warm target that meets it, confirmed by
    a re-run at another seed."""
    _, config = live
    sent, log = recorded
    bound = [r for r in sent if r["source"] is not None]
    result = subprocess.run(
        [STOKER, "backtest", "--from", str(log), "--config", str(config),
         "--spawn-s", _spawn_s(bound), "--recommend", "--target", "cold_share=0.02",
         "--search", "warm_target", "--json", "--jobs", "2"],
        capture_output=True, text=True, timeout=900, env=environment(), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    body = json.loads(result.stdout)
    assert body["confirmed_ok"] is True
    assert body["confirmed"]["cold_share"] <= 0.02
    assert body["confirmed"]["failed"] == 0


def test_the_backtest_reads_a_servers_log_page_after_page(
    live: tuple[Server, Path], recorded: tuple[list[dict[str, Any]], Path], tmp_path: Path
) -> None:
    """`stoker backtest --url` reads the whole log however many pages it takes: here the
    live run's log, 7 entries a page, is the log `stoker claims export` wrote."""
    from stoker.cli.backtest import _from_server

    server, _ = live
    exported = _export(server.url, tmp_path / "claims.jsonl")
    assert len(exported) >= CLAIMS  # the run of the test before, or its own claims
    replay, settings, _spawn, _cost, _sizes, _orgs, intervals, slots = _from_server(
        server.url, None, "1h", "demo", page_size=7
    )
    assert len(exported) > 7 * 3, "the log must span several pages"
    assert len(replay) == len(exported)
    arrivals = [replay.start + at for at in replay.at_s]
    assert arrivals == pytest.approx(sorted(e["at"] for e in exported), abs=1e-3)
    assert sorted(replay.orgs) == sorted({e["org"] for e in exported})
    assert settings["warm_target"] == 1
    # The replicas replay at the server's own passes (its config's 0.5 s janitor), which
    # `GET /v1/pools/{name}` states; the reaper's is the default (10 s).
    assert intervals == {"janitor_interval_s": 0.5, "reaper_interval_s": 10.0}
    # And at its machine's start-up slots (one per core, the config sets none), each held
    # as long as the server measured its workers' start-ups holding one.
    from stoker.adapters.runtime_local import default_start_limit

    assert slots is not None
    limit, hold = slots
    assert limit == default_start_limit()
    assert hold is not None and 0 < hold < 30


def _restart(server: Server) -> None:
    """Stop the module's server and start it again on its store, in place (the same
    `Server`, now the new process and its URL): the pools, their settings, the claim log
    and the ledger stay; the leader's demand windows, which only the leader holds, start
    empty, as they did before the first run."""
    server.stop()
    config = (server.workdir / "stoker.yaml").read_text()
    again = start_server(server.workdir, config=config, args=["--stop-workers"])
    server.proc, server.url, server.lines, server.tail = again.proc, again.url, again.lines, ""


def _pool(url: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}/v1/pools/demo", timeout=30)
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def _cold_share(sent: list[dict[str, Any]]) -> float:
    bound = [r for r in sent if r["source"] is not None]
    assert len(bound) == CLAIMS, "every claim of the run must be served"
    cold: int = sum(r["source"] == "cold" for r in bound)
    return cold / len(bound)


def test_the_recommended_settings_applied_live_bring_the_promised_cold_share(
    live: tuple[Server, Path], recorded: tuple[list[dict[str, Any]], Path]
) -> None:
    """What an operator does with `--recommend --url`: run the `stoker pools set` line it
    prints, as printed, against the server; the same traffic again then goes cold no more
    often than the confirming re-run promised (within `TOLERANCE`), and less often than
    before.

    The server restarts first (on its store: the log, the ledger and the settings stay).
    A pool's warm pool grows with its demand, the rate of the last 5 minutes, which the
    leader alone holds: right after the first run it still counts that run's claims and
    keeps more workers warm than any warm target asked, so the second run would go warm
    whatever the settings. The restart leaves the demand windows empty, as they were
    before the first run and as they are when a replay begins."""
    server, _ = live
    sent, _ = recorded
    before = _cold_share(sent)
    _restart(server)
    original = _pool(server.url)["settings"]["warm_target"]
    try:
        shown = subprocess.run(
            [STOKER, "backtest", "--url", server.url, "--pool", "demo", "--since", "1h",
             "--recommend", "--target", "cold_share=0.02", "--search", "warm_target",
             "--jobs", "2", "--no-progress"],
            capture_output=True, text=True, timeout=900, env=environment(), check=False,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stdout + shown.stderr
        # The live pool's own spawn-to-ready time: the ledger's, not an assumed one.
        assert "s p99 (the server's ledger)" in shown.stdout, shown.stdout
        # The confirming re-run's cold share: the table's row "confirm".
        confirm = re.search(r"confirm\s*│\s*([\d.]+)%", shown.stdout)
        assert confirm is not None, shown.stdout
        promised = float(confirm[1]) / 100
        line = next(x for x in shown.stdout.splitlines() if x.startswith("stoker pools set "))
        words = shlex.split(line)
        assert words[0] == "stoker"
        # As printed: nothing but the line says which server (no $STOKER_URL here).
        applied = subprocess.run(
            [STOKER, *words[1:]],
            capture_output=True, text=True, timeout=60, env=environment(), check=False,
        )  # fmt: skip
        assert applied.returncode == 0, applied.stdout + applied.stderr
        target = int(words[words.index("--warm-target") + 1])
        assert _pool(server.url)["settings"]["warm_target"] == target
        # The warm pool fills to the new target before the traffic, as the first run's did.
        assert wait_until(lambda: _pool(server.url)["counts"]["warm"] >= target, 60, 0.2)
        after = _cold_share(_drive(server.url))
        print(
            f"live cold share {before:.3f} before; {line!r} promised {promised:.3f}; "
            f"live {after:.3f} after"
        )
        # Lower than before; or none, when the first run had no cold claim to lower (a
        # quiet machine's workers can outrun its bursts: its replay goes cold all the same,
        # within TOLERANCE, and the search still raises the warm target). A weak check at
        # this size: at a warm target of 1 this traffic goes cold 0-2 times in 45, so the
        # promise is the check that counts: the target met live, with at most one cold
        # claim more than the replay promised (a spawn this machine happened to be slow
        # at), far tighter than TOLERANCE, the replay's agreement with a live run.
        assert after < before or after == before == 0, (before, after)
        assert after <= promised + 1 / CLAIMS, (after, promised)
    finally:
        httpx.patch(
            f"{server.url}/v1/pools/demo", json={"warm_target": original}, timeout=30
        ).raise_for_status()
