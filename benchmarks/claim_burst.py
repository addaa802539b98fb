"""Claims over HTTP against a real `stoker serve` with real demo workers.

    python benchmarks/claim_burst.py [--workers 300] [--duration 10] [--concurrency 32]
                                     [--profile DIR] [--baseline SRC [--rounds 3]]

Prints:
  1. burst: N simultaneous `POST /v1/claims` (N distinct orgs) against N warm workers,
     activation included: p50/p90/p99 claim latency and the time until all N are bound;
  2. sustained: claim + release cycles per second over HTTP with reuse (each of
     `--concurrency` orgs of the burst claims its parked worker, releases it, claims it
     again, ...), with the latency of both requests and the CPU each process used.

The pool holds exactly `--workers` workers, so nothing spawns during the measurements;
`--refill` lets it grow to twice that, and the burst then competes with the start-up of
the replacement workers for this machine's cores.

The server runs as a user runs it (the `stoker` command, uvloop and httptools, default
logging); the load comes from one aiohttp client on uvloop in this process, with its
connections opened before the clock starts, as an SDK client with keep-alive would have
them. With `--profile DIR`, py-spy samples the server during each phase and the script
prints where the server's time goes (by function, self and inclusive).

With `--baseline SRC` (the `src` folder of another version of stoker, e.g. from
`git worktree add /tmp/before main`), the script measures that version and this one side
by side: `--rounds` rounds of one run each, in alternating order (baseline first, then
this tree first, ...), the baseline's server started with `PYTHONPATH=SRC`. It prints the
median of each figure per side and the median of the paired ratios (this / baseline), so
that a change can be judged on a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import uvloop

STOKER = str(Path(sys.executable).with_name("stoker"))
DEMO = ["{python}", "-m", "stoker.demo_worker", "--port", "{port}", "--worker-id", "{worker_id}"]


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(name: str, seconds: list[float]) -> str:
    ms = [s * 1000 for s in seconds]
    return (
        f"{name}: n={len(ms)} p50={percentile(ms, 0.5):.1f} ms p90={percentile(ms, 0.9):.1f} ms "
        f"p99={percentile(ms, 0.99):.1f} ms max={max(ms):.1f} ms mean={statistics.fmean(ms):.1f} ms"
    )


class Server:
    """`stoker serve` in a temporary directory, stopped with its workers at the end."""

    def __init__(
        self,
        workdir: Path,
        workers: int,
        refill: bool,
        source: Path | None = None,
        *,
        store: str = "sqlite:///./stoker.db",
        env: dict[str, str] | None = None,
    ) -> None:
        self.workdir = workdir
        self.fleet = "bench-" + uuid.uuid4().hex[:8]
        pool = {
            "name": "bench",
            "command": DEMO,
            "warm_target": workers,
            # Without --refill the pool is exactly `workers` big: the burst's claims leave no
            # room to spawn replacements, so no process start-up competes for the two cores.
            "max_workers": 2 * workers if refill else workers,
            "memory_mb": 32,
            "lease_s": 600,
            "claim_timeout_s": 60,
            "hot_idle_ttl": 600,
        }
        config = {
            "store": store,
            "fleet": self.fleet,
            "api": {"port": 0},
            "runtime": {"memory_budget_mb": 64 * 1024},
            # Fill the pool quickly; the janitor's passes are part of the measured load.
            "intervals": {"spawn_rate": 100, "spawn_burst": 100, "janitor_interval_s": 2},
            "pools": [pool],
        }
        (workdir / "stoker.yaml").write_text(json.dumps(config))
        self.log = open(workdir / "server.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [STOKER, "serve", "-c", "stoker.yaml", "--stop-workers"],
            cwd=workdir,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**server_env(source), **(env or {})},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = re.search(r"listening on (http://\S+)", line)
        if not match:
            raise SystemExit(f"stoker serve did not start: {line}\n{self.log_text()}")
        self.url = match.group(1)

    def log_text(self) -> str:
        return (self.workdir / "server.log").read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()
        # Whatever is left of the fleet (there should be nothing) goes too.
        for process in psutil.process_iter():
            try:
                if process.environ().get("STOKER_FLEET") == self.fleet:
                    process.kill()
            except psutil.Error:
                continue


def server_env(source: Path | None) -> dict[str, str]:
    """The server's environment: ours without STOKER_ settings; `source` first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STOKER_")}
    if source is not None:
        env["PYTHONPATH"] = str(source)
    return env


class Profiler:
    """py-spy sampling the server process while a phase runs."""

    def __init__(self, directory: Path | None, pid: int) -> None:
        self.directory = directory
        self.pid = pid
        self.proc: subprocess.Popen[bytes] | None = None
        self.path: Path | None = None

    def start(self, name: str) -> None:
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"{name}.folded"
        py_spy = str(Path(sys.executable).with_name("py-spy"))
        self.proc = subprocess.Popen(
            [
                py_spy,
                "record",
                "--pid",
                str(self.pid),
                "--format",
                "raw",
                "--rate",
                "250",
                "--nonblocking",
                "--output",
                str(self.path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # py-spy attaches before the phase starts

    def stop(self) -> None:
        if self.proc is None or self.path is None:
            return
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(60)
        self.proc = None
        print_profile(self.path)


#: Where a sample's time goes, by the file of its innermost Python frame (first match wins).
CATEGORIES = [
    ("sqlite store (stoker/adapters/sqlite, sqlite3)", ("stoker/adapters/sqlite/", "_rows.py")),
    (
        "activation client (activator_http + aiohttp)",
        ("activator_http.py", "aiohttp/", "yarl/", "multidict/"),
    ),
    ("control plane (stoker/control, policy)", ("stoker/control/", "stoker/policy/")),
    ("logging (one line per state change)", ("logging/__init__.py", "stoker/bootstrap.py")),
    ("stoker API layer (stoker/api)", ("stoker/api/",)),
    ("FastAPI + Starlette", ("fastapi/", "starlette/", "anyio/")),
    ("pydantic", ("pydantic",)),
    ("uvicorn + httptools", ("uvicorn/", "httptools/")),
    ("prometheus metrics", ("prometheus_client/",)),
    ("json", ("json/",)),
    ("event loop (asyncio, uvloop)", ("asyncio/", "uvloop/", "selectors.py")),
    ("process spawning (pool refill)", ("subprocess.py", "psutil/")),
]


def print_profile(path: Path, top: int = 15) -> None:
    """Self time by component and by function, and inclusive time, from py-spy stacks."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    components: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = [
            re.sub(r" \(/.*?/(site-packages|src|lib/python3\.\d+)/", " (", f)
            for f in stack.split(";")
        ]
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
        leaf = stack.split(";")[-1]
        component = next(
            (name for name, needles in CATEGORIES if any(n in leaf for n in needles)), "other"
        )
        components[component] += count
    if not total:
        print(f"  (no samples in {path})")
        return
    print(f"  server profile {path} ({total} samples at 250 Hz)")
    print("  self time by component:")
    for name, count in components.most_common():
        print(f"    {100 * count / total:5.1f}%  {name}")
    print("  self time by function:")
    for frame, count in own.most_common(top):
        print(f"    {100 * count / total:5.1f}%  {frame}")
    print("  inclusive time (below the server's entry points):")
    shown = 0
    for frame, count in inclusive.most_common():
        if count / total > 0.85:
            continue
        print(f"    {100 * count / total:5.1f}%  {frame}")
        shown += 1
        if shown == top:
            break


async def wait_warm(http: aiohttp.ClientSession, url: str, workers: int, timeout: float) -> float:
    started = time.perf_counter()
    deadline = started + timeout
    while time.perf_counter() < deadline:
        async with http.get(f"{url}/v1/pools/bench") as response:
            counts = (await response.json())["counts"]
        if counts["warm"] >= workers:
            return time.perf_counter() - started
        await asyncio.sleep(0.5)
    raise SystemExit(f"the pool did not reach {workers} warm workers in {timeout}s: {counts}")


async def wait_settled(http: aiohttp.ClientSession, url: str) -> None:
    """Wait (bounded) until nothing spawns any more (the pool refilled, or it is at its cap)."""
    deadline = time.perf_counter() + 600
    quiet = 0
    while time.perf_counter() < deadline:
        async with http.get(f"{url}/v1/pools/bench") as response:
            counts = (await response.json())["counts"]
        quiet = quiet + 1 if not counts["spawning"] else 0
        if quiet >= 4:
            return
        await asyncio.sleep(0.5)
    raise SystemExit("the pool kept spawning for 10 minutes")


async def timed(call: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    """(seconds, result) of one awaited call."""
    started = time.perf_counter()
    result = await call()
    return time.perf_counter() - started, result


async def claim(
    http: aiohttp.ClientSession, url: str, org: str, pool: str = "bench"
) -> dict[str, Any]:
    """POST /v1/claims; raises on anything but 201."""
    body = {"pool": pool, "org": org, "timeout_s": 60}
    async with http.post(f"{url}/v1/claims", json=body) as response:
        answer: dict[str, Any] = await response.json(content_type=None)
        if response.status != 201:
            raise RuntimeError(f"claim failed: {response.status} {answer}")
        return answer


async def release(http: aiohttp.ClientSession, url: str, claim_id: str) -> None:
    """DELETE /v1/claims/{id}; raises on anything but 200."""
    async with http.delete(f"{url}/v1/claims/{claim_id}") as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"release failed: {response.status}")


async def open_connections(http: aiohttp.ClientSession, url: str, count: int) -> None:
    """Open `count` keep-alive connections (concurrent requests force one each)."""

    async def probe() -> None:
        async with http.get(f"{url}/healthz") as response:
            await response.read()

    await asyncio.gather(*(probe() for _ in range(count)))


async def burst(
    http: aiohttp.ClientSession, url: str, workers: int, server_pid: int, figures: dict[str, float]
) -> list[str]:
    await open_connections(http, url, workers)
    cpu = CpuMeter(server_pid)
    started = time.perf_counter()
    results = await asyncio.gather(
        *(timed(lambda i=i: claim(http, url, f"org-{i}")) for i in range(workers))
    )
    all_bound = time.perf_counter() - started
    latencies = [seconds for seconds, _ in results]
    sources = collections.Counter(answer["source"] for _, answer in results)
    print(f"burst of {workers} simultaneous claims against {workers} warm workers:")
    print("  " + summary("claim latency", latencies))
    print(f"  all {workers} bound after {all_bound * 1000:.0f} ms; sources: {dict(sources)}")
    print("  " + cpu.report(all_bound))
    ms = [seconds * 1000 for seconds in latencies]
    figures["burst p50 (ms)"] = percentile(ms, 0.5)
    figures["burst p99 (ms)"] = percentile(ms, 0.99)
    figures["all bound (ms)"] = all_bound * 1000
    return [answer["id"] for _, answer in results]


class CpuMeter:
    """CPU seconds used by the server, its workers, this load generator, and everything else
    on the machine (other work on a shared machine skews the figures: it is reported)."""

    def __init__(self, server_pid: int) -> None:
        self.server = psutil.Process(server_pid)
        self.me = psutil.Process()
        self.start = self.sample()

    def sample(self) -> tuple[float, float, float, float]:
        def used(p: psutil.Process) -> float:
            t = p.cpu_times()
            return t.user + t.system

        workers = 0.0
        for child in self.server.children():
            try:
                workers += used(child)
            except psutil.Error:
                continue
        machine = psutil.cpu_times()
        busy = machine.user + machine.system + machine.nice + getattr(machine, "softirq", 0.0)
        return used(self.server), workers, used(self.me), busy

    def report(self, elapsed: float) -> str:
        end = self.sample()
        server, workers, client, busy = (b - a for a, b in zip(self.start, end, strict=True))
        other = max(0.0, busy - server - workers - client)
        return (
            f"CPU over {elapsed:.2f} s ({psutil.cpu_count()} cores = "
            f"{psutil.cpu_count() * elapsed:.2f} s): server {server:.2f} s, workers "
            f"{workers:.2f} s, load generator {client:.2f} s, other processes {other:.2f} s"
        )


async def sustained(
    http: aiohttp.ClientSession,
    url: str,
    concurrency: int,
    duration: float,
    profiler: Profiler,
    figures: dict[str, float],
) -> None:
    claims: list[float] = []
    releases: list[float] = []
    sources: collections.Counter[str] = collections.Counter()
    await open_connections(http, url, concurrency)
    # The orgs of the burst: each has a parked worker to reuse. Spawning that is still
    # going on (with --refill) would overlap the measurement: wait for it to end.
    await wait_settled(http, url)
    profiler.start("sustained")
    cpu = CpuMeter(profiler.pid)
    deadline = time.perf_counter() + duration

    async def loop(org: str) -> int:
        cycles = 0
        while time.perf_counter() < deadline:
            took, answer = await timed(lambda: claim(http, url, org))
            claims.append(took)
            sources[answer["source"]] += 1
            claim_id = answer["id"]
            took, _ = await timed(lambda: release(http, url, claim_id))  # noqa: B023
            releases.append(took)
            cycles += 1
        return cycles

    started = time.perf_counter()
    counts = await asyncio.gather(*(loop(f"org-{i}") for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    total = sum(counts)
    print(f"sustained claim+release over HTTP, {concurrency} orgs in parallel, {elapsed:.1f} s:")
    print(f"  {total / elapsed:.0f} cycles/s ({total} cycles); sources: {dict(sources)}")
    print("  " + summary("claim latency", claims))
    print("  " + summary("release latency", releases))
    print("  " + cpu.report(elapsed))
    figures["cycles/s"] = total / elapsed
    figures["cycle claim p99 (ms)"] = percentile([s * 1000 for s in claims], 0.99)


async def run(args: argparse.Namespace, source: Path | None = None) -> dict[str, float]:
    """One measurement (fill, burst, sustained) of the server from `source` (default: ours)."""
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="stoker-bench-") as tmp:
        server = Server(Path(tmp), args.workers, args.refill, source)
        profiler = Profiler(args.profile, server.proc.pid)
        try:
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            async with aiohttp.ClientSession(connector=connector) as http:
                fill = await wait_warm(http, server.url, args.workers, timeout=600)
                print(f"server at {server.url}: {args.workers} warm workers after {fill:.1f} s")
                await asyncio.sleep(2)  # let the janitor settle after the fill
                profiler.start("burst")
                ids = await burst(http, server.url, args.workers, server.proc.pid, figures)
                profiler.stop()
                # The burst's workers park for their orgs (hot_idle): the next phase reuses them.
                await asyncio.gather(*(release(http, server.url, i) for i in ids))
                await sustained(
                    http, server.url, args.concurrency, args.duration, profiler, figures
                )
                profiler.stop()
        finally:
            server.stop()
    return figures


async def compare(args: argparse.Namespace) -> None:
    """Rounds of the baseline and this tree in alternating order; medians and paired ratios."""
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "this": []}
    for round_ in range(args.rounds):
        order = ["baseline", "this"] if round_ % 2 == 0 else ["this", "baseline"]
        for side in order:
            print(f"-- round {round_ + 1}/{args.rounds}: {side}")
            runs[side].append(await run(args, args.baseline if side == "baseline" else None))
    print(f"side by side, {args.rounds} rounds (medians; ratio: median of this / baseline):")
    for name in runs["this"][0]:
        before = [figures[name] for figures in runs["baseline"]]
        after = [figures[name] for figures in runs["this"]]
        ratios = [a / b for a, b in zip(after, before, strict=True)]
        print(
            f"  {name:22s} baseline {statistics.median(before):8.1f}  this "
            f"{statistics.median(after):8.1f}  ratio {statistics.median(ratios):.3f} "
            f"(each round: {', '.join(f'{r:.2f}' for r in ratios)})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=300, help="warm workers and burst size")
    parser.add_argument("--duration", type=float, default=10.0, help="sustained phase, seconds")
    parser.add_argument("--concurrency", type=int, default=32, help="orgs cycling in parallel")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy output directory")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="src folder of another stoker version, measured side by side with this one",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds with --baseline")
    parser.add_argument(
        "--refill",
        action="store_true",
        help="let the pool grow to twice --workers, so that it refills during the burst",
    )
    args = parser.parse_args()
    uvloop.run(compare(args) if args.baseline is not None else run(args))


if __name__ == "__main__":
    main()
