"""A live run against a real `stoker serve`, then `stoker backtest --url` of it: how close
the replay's cold share and claim p99 come to what the clients saw.

    python benchmarks/backtest_live.py --run C [--seed 44] [--keep DIR]

The server runs one demo pool of local processes on SQLite (a run's settings below);
concurrent clients claim it at Poisson arrivals in phases of different rates, each from
a random org, hold their worker an exponentially drawn time and release it, and time
their own claims. Right after the last release the script runs `stoker backtest --url`
against the server (its settings, cap, passes, spawn-to-ready time and start-up slots)
and prints the live figures beside the replay's.

Runs (docs/warmth.md, "Backtests against live runs"):

- A: `warm_target: 2`, `hot_idle_ttl: 10`, start delay 1.5 s; 360 claims of 8 orgs;
- B: `warm_target: 1`, `hot_idle_ttl: 5`, start delay 3 s; 360 claims of 12 orgs;
- C: `warm_target: 0`, `reuse: never`, start delay 2 s; 300 claims of 12 orgs.

A run takes 6-9 minutes of real time (the claims arrive as they did live).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

STOKER = str(Path(sys.executable).with_name("stoker"))
#: Run -> (pool settings, demo worker start delay s, claims, orgs, phase rates a second,
#: claims a phase, mean hold s).
RUNS: dict[str, tuple[dict[str, Any], float, int, int, tuple[float, ...], int, float]] = {
    "A": ({"warm_target": 2, "hot_idle_ttl": 10}, 1.5, 360, 8, (0.5, 1.0, 2.5), 40, 6.0),
    "B": ({"warm_target": 1, "hot_idle_ttl": 5}, 3.0, 360, 12, (0.3, 1.5, 4.0), 30, 8.0),
    "C": ({"warm_target": 0, "reuse": "never"}, 2.0, 300, 12, (0.5, 2.0), 50, 8.0),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def drive(url: str, run: str, seed: int) -> list[dict[str, Any]]:
    """The run's claims, each from its own thread: what every client saw."""
    _, _, claims, orgs, rates, per_phase, hold = RUNS[run]
    rng = random.Random(seed)
    seen: list[dict[str, Any]] = []
    lock = threading.Lock()

    def session(org: str, held: float) -> None:
        started = time.perf_counter()
        with httpx.Client(base_url=url, timeout=120) as client:
            answer = client.post("/v1/claims", json={"pool": "demo", "org": org})
            row: dict[str, Any] = {"wait_s": time.perf_counter() - started, "source": None}
            if answer.status_code == 201:
                claim = answer.json()
                row["source"] = claim["source"]
                time.sleep(held)
                client.delete(f"/v1/claims/{claim['id']}")
        with lock:
            seen.append(row)

    threads = []
    for i in range(claims):
        time.sleep(rng.expovariate(rates[(i // per_phase) % len(rates)]))
        org = f"org-{rng.randrange(orgs)}"
        thread = threading.Thread(target=session, args=(org, rng.expovariate(1 / hold)))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(600)
    return seen


def p99_ms(waits: list[float]) -> float:
    ordered = sorted(waits)
    return 1000 * ordered[math.ceil(0.99 * len(ordered)) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", choices=sorted(RUNS), default="C")
    parser.add_argument("--seed", type=int, default=44)
    parser.add_argument("--keep", type=Path, help="keep the server's directory here")
    args = parser.parse_args()
    settings, delay, *_ = RUNS[args.run]
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="stoker-backtest-live-"))
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = ["{python}", "-m", "stoker.demo_worker", "--port", "{port}"]
    command += ["--worker-id", "{worker_id}", "--start-delay", str(delay)]
    pool = {"name": "demo", "command": command, "max_workers": 60, "memory_mb": 256}
    pool |= settings | {"cost": {"per_worker_hour": 0.05}}
    (workdir / "stoker.yaml").write_text(
        f"store: sqlite:///./stoker.db\napi: {{host: 127.0.0.1, port: {port}}}\n"
        f"pools:\n  - {json.dumps(pool)}\n"
    )
    url = f"http://127.0.0.1:{port}"
    with (workdir / "serve.log").open("w") as log:
        server = subprocess.Popen(
            [STOKER, "serve", "-c", "stoker.yaml", "--stop-workers"],
            cwd=workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "NO_COLOR": "1"},
        )
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        time.sleep(5)  # the warm pool fills, as a replay's lead lets it
        seen = drive(url, args.run, args.seed)
        time.sleep(12)  # the claim log's last rows are written with a pass
        replay = subprocess.run(
            [STOKER, "backtest", "--url", url, "--since", "1h", "--json", "--jobs", "1"],
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        server.terminate()
        server.wait(60)
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    body = json.loads(replay.stdout)
    bound = [r for r in seen if r["source"] is not None]
    live_cold = sum(r["source"] == "cold" for r in bound) / len(bound)
    live_p99 = p99_ms([r["wait_s"] for r in seen])
    (figures,) = body["runs"]
    print(
        f"run {args.run} seed {args.seed}: {len(seen)} claims, {len(bound)} bound\n"
        f"  live:   cold share {live_cold:.2%}, claim p99 {live_p99:,.0f} ms\n"
        f"  replay: cold share {figures['cold_share']:.2%}, claim p99 "
        f"{figures['claim_p99_ms']:,.0f} ms (recorded {body['recorded_cold_share']:.2%})\n"
        f"  spawn-to-ready {body['spawn_s']['p50']:.2f} s median; start-up slots "
        f"{body.get('start_slots')}"
    )


if __name__ == "__main__":
    main()
