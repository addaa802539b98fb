"""Claims over HTTP against a real `stoker serve` with real demo workers, with and
without the pool refilling while they are served.

    python benchmarks/claim_burst.py [--scale 1.0] [--burst 160] [--concurrency 48]
                                     [--duration 8] [--rounds 1] [--profile DIR]
    python benchmarks/claim_burst.py --baseline SRC [--variant refill] [--rounds 3]

The geometry (by default the seed's, `--scale` multiplies every count): a pool of twice
the burst (`warm_target` 320, `max_workers` 640) is filled; then

  1. burst: 160 simultaneous `POST /v1/claims` (160 distinct orgs), activation included:
     p50/p90/p99 claim latency and the time until all are bound; all are released, and
     the pool refills the 160 it handed out at once;
  2. sustained, while that refill runs: 48 of those orgs each claim (their parked worker),
     call the worker with the session token (`GET /` with `Authorization: Bearer`) and
     release, over and over for 8 s: cycles per second, latency of each request;
  3. the refill runs to its end: the most live workers seen from the burst on (spawning
     included) and the largest desired warm (a refill sized by the claim rate stays near
     `warm_target` plus the burst's parked workers, far below the cap).

Each run also measures the same without refill (a pool of exactly the burst, so nothing
spawns) and prints both side by side with the ratios (refill / no refill), the spawn
failures (from the server's log) and the connection errors the client saw, against the
targets: cycles ≥ 0.5x and claim p99 ≤ 3x the no-refill figures, no spawn failure, no
connection error. `--rounds N` alternates the order of the two and prints medians.

The server runs as a user runs it (the `stoker` command, uvloop and httptools, default
logging); the load comes from one aiohttp client on uvloop in this process, with its
connections opened before the clock starts and a keep-alive shorter than the server's,
as an SDK client with keep-alive would have them. With `--profile DIR`, py-spy samples
the server during each phase and the script prints where the server's time goes.

With `--baseline SRC` (the `src` folder of another version of stoker, e.g. from
`git worktree add /tmp/before main`), the script measures that version and this one side
by side in one variant (`--variant`, default refill): `--rounds` rounds in alternating
order, the baseline's server started with `PYTHONPATH=SRC`, medians per side and the
median of the paired ratios (this / baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
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
        """A pool of `workers` warm workers; with `refill`, twice as many may exist, so the
        pool refills what a burst of `workers` claims takes (else nothing spawns)."""
        self.workdir = workdir
        self.fleet = "bench-" + uuid.uuid4().hex[:8]
        pool = {
            "name": "bench",
            "command": DEMO,
            "warm_target": workers,
            # Without refill the pool is exactly `workers` big: the burst's claims leave no
            # room to spawn replacements, so no process start-up competes for the cores.
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
    ("sqlite store (stoker/adapters/sqlite, sqlite3)", ("stoker/adapters/sqlite/",)),
    (
        "postgres store (stoker/adapters/postgres, psycopg, psycopg_pool)",
        ("stoker/adapters/postgres/", "psycopg/", "psycopg_pool/"),
    ),
    ("rows of both stores (stoker/adapters/_rows.py)", ("stoker/adapters/_rows.py",)),
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

    def used(self) -> tuple[float, float, float, float]:
        """CPU seconds since the start: server, workers, load generator, whole machine."""
        end = self.sample()
        server, workers, client, busy = (b - a for a, b in zip(self.start, end, strict=True))
        return server, workers, client, busy

    def report(self, elapsed: float) -> str:
        server, workers, client, busy = self.used()
        other = max(0.0, busy - server - workers - client)
        return (
            f"CPU over {elapsed:.2f} s ({psutil.cpu_count()} cores = "
            f"{psutil.cpu_count() * elapsed:.2f} s): server {server:.2f} s, workers "
            f"{workers:.2f} s, load generator {client:.2f} s, other processes {other:.2f} s"
        )


class Errors:
    """What went wrong for the client: connection errors (a reset, a dropped connection)
    and failed requests, by kind, with the first message of each."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.first: dict[str, str] = {}

    def note(self, kind: str, exc: BaseException) -> None:
        self.counts[kind] += 1
        self.first.setdefault(kind, f"{type(exc).__name__}: {exc}")

    @property
    def connection(self) -> int:
        return self.counts["connection"]

    def report(self) -> str:
        if not self.counts:
            return "no connection errors, no failed requests"
        return "; ".join(
            f"{n} {kind} (first: {self.first[kind]})" for kind, n in self.counts.items()
        )


async def call_worker(http: aiohttp.ClientSession, answer: dict[str, Any]) -> None:
    """`GET /` on the claimed worker with the session token; raises on anything but 200."""
    worker = answer["worker"]
    headers = {"Authorization": f"Bearer {worker['token']}"}
    async with http.get(f"{worker['endpoint']}/", headers=headers) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"worker call failed: {response.status}")


async def sustained(
    http: aiohttp.ClientSession,
    url: str,
    concurrency: int,
    duration: float,
    profiler: Profiler,
    figures: dict[str, float],
    *,
    settle: bool = True,
    with_worker_call: bool = False,
    errors: Errors | None = None,
) -> None:
    """Cycles of `concurrency` orgs: claim, (call the worker with the token,) release.

    With `settle`, spawning still going on is waited out first; else the cycles overlap
    it. With `errors`, a failed request is counted there and its org goes on cycling.
    """
    claims: list[float] = []
    releases: list[float] = []
    sources: collections.Counter[str] = collections.Counter()
    await open_connections(http, url, concurrency)
    if settle:
        # The orgs of the burst: each has a parked worker to reuse. Spawning that is still
        # going on would overlap the measurement: wait for it to end.
        await wait_settled(http, url)
    profiler.start("sustained")
    cpu = CpuMeter(profiler.pid)
    deadline = time.perf_counter() + duration

    async def cycle(org: str) -> None:
        took, answer = await timed(lambda: claim(http, url, org))
        claims.append(took)
        sources[answer["source"]] += 1
        try:
            if with_worker_call:
                await call_worker(http, answer)
        finally:
            took, _ = await timed(lambda: release(http, url, answer["id"]))
            releases.append(took)

    async def loop(org: str) -> int:
        cycles = 0
        while time.perf_counter() < deadline:
            try:
                await cycle(org)
            except aiohttp.ClientConnectionError as exc:
                if errors is None:
                    raise
                errors.note("connection", exc)
                continue
            except RuntimeError as exc:
                if errors is None:
                    raise
                errors.note("failed request", exc)
                continue
            cycles += 1
        return cycles

    started = time.perf_counter()
    counts = await asyncio.gather(*(loop(f"org-{i}") for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    total = sum(counts)
    what = "claim + worker call + release" if with_worker_call else "claim + release"
    print(f"sustained {what} over HTTP, {concurrency} orgs in parallel, {elapsed:.1f} s:")
    print(f"  {total / elapsed:.0f} cycles/s ({total} cycles); sources: {dict(sources)}")
    print("  " + summary("claim latency", claims))
    print("  " + summary("release latency", releases))
    print("  " + cpu.report(elapsed))
    busy = cpu.used()[3]
    figures["cycles/s"] = total / elapsed
    # Everything the machine ran per cycle (server, workers, load generator, database):
    # on a machine that is fully busy, its cores divided by this bound the rate.
    figures["machine CPU/cycle (ms)"] = 1000 * busy / max(total, 1)
    figures["cycle claim p99 (ms)"] = percentile([s * 1000 for s in claims], 0.99)


class PoolWatch:
    """Samples the pool every half second while it runs: the most live workers (every
    state but retired, spawning included), the largest desired warm and spawn-to-ready
    estimate the leader's sizing showed."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http, self.url = http, url
        self.live = self.desired = 0
        self.ready_s = 0.0
        self.task = asyncio.create_task(self.run())

    async def run(self) -> None:
        while True:
            async with self.http.get(f"{self.url}/v1/pools/bench") as response:
                body = await response.json()
            self.live = max(self.live, sum(body["counts"].values()))
            self.desired = max(self.desired, body["desired_warm"])
            sizing = body.get("sizing") or {}
            self.ready_s = max(self.ready_s, sizing.get("ready_s") or 0.0)
            await asyncio.sleep(0.5)

    async def stop(self, figures: dict[str, float]) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        print(
            f"  peak live workers {self.live}, peak desired warm {self.desired}, "
            f"largest spawn-to-ready estimate {self.ready_s:.1f} s"
        )
        figures["peak live"] = self.live
        figures["peak desired warm"] = self.desired


async def pool_counts(http: aiohttp.ClientSession, url: str) -> dict[str, int]:
    async with http.get(f"{url}/v1/pools/bench") as response:
        counts: dict[str, int] = (await response.json())["counts"]
        return counts


#: Server log events that mean a worker was given up as a failed spawn.
SPAWN_FAILURE = re.compile(r"event=(worker_spawn_failed|spawn_failed)|reason=spawn_failure")


async def run(
    args: argparse.Namespace, source: Path | None = None, *, refill: bool
) -> dict[str, float]:
    """One measurement (fill, burst, sustained) of the server from `source` (default: ours):
    with `refill`, a pool of twice the burst refills during the sustained phase."""
    figures: dict[str, float] = {}
    workers = 2 * args.burst if refill else args.burst
    errors = Errors()
    with tempfile.TemporaryDirectory(prefix="stoker-bench-") as tmp:
        server = Server(Path(tmp), workers, refill, source)
        profiler = Profiler(args.profile, server.proc.pid)
        try:
            # Keep-alive shorter than the server's (5 s), as a well-configured client has.
            connector = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=4)
            async with aiohttp.ClientSession(connector=connector) as http:
                fill = await wait_warm(http, server.url, workers, timeout=900)
                pool = f"warm_target {workers}, max_workers {2 * workers if refill else workers}"
                print(f"server at {server.url} ({pool}): {workers} warm after {fill:.1f} s")
                await asyncio.sleep(2)  # let the janitor settle after the fill
                watch = PoolWatch(http, server.url)
                profiler.start("burst")
                ids = await burst(http, server.url, args.burst, server.proc.pid, figures)
                profiler.stop()
                # The burst's workers park for their orgs (hot_idle): the next phase reuses
                # them, while (with refill) the pool replaces the ones the burst took.
                await asyncio.gather(*(release(http, server.url, i) for i in ids))
                counts = await pool_counts(http, server.url)
                print(f"  after the releases: {counts['spawning']} spawning")
                await sustained(
                    http,
                    server.url,
                    args.concurrency,
                    args.duration,
                    profiler,
                    figures,
                    settle=False,
                    with_worker_call=True,
                    errors=errors,
                )
                profiler.stop()
                counts = await pool_counts(http, server.url)
                print(f"  after the cycles: {counts['spawning']} spawning, {counts['warm']} warm")
                # The refill runs to its end: how far it went is the pool's sizing.
                settled = await timed(lambda: wait_settled(http, server.url))
                counts = await pool_counts(http, server.url)
                print(
                    f"  refill settled {settled[0]:.1f} s later: {counts['warm']} warm, "
                    f"{sum(counts.values())} live"
                )
                await watch.stop(figures)
        finally:
            server.stop()
            failures = len(SPAWN_FAILURE.findall(server.log_text()))
    print(f"  client: {errors.report()}; server: {failures} spawn failures")
    figures["spawn failures"] = failures
    figures["connection errors"] = errors.connection
    figures["failed requests"] = sum(errors.counts.values()) - errors.connection
    return figures


async def side_by_side(args: argparse.Namespace) -> None:
    """No refill and refill in one run (`--rounds` in alternating order): medians, ratios
    and the targets."""
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for round_ in range(args.rounds):
        for refill in (False, True) if round_ % 2 == 0 else (True, False):
            name = "refill" if refill else "no refill"
            print(f"-- round {round_ + 1}/{args.rounds}: {name}")
            runs[refill].append(await run(args, refill=refill))
    median = {k: {n: statistics.median(f[n] for f in v) for n in v[0]} for k, v in runs.items()}
    base, load = median[False], median[True]
    print(
        f"burst {args.burst}, {args.concurrency} orgs cycling for {args.duration:g} s "
        f"(scale {args.scale:g}); medians of {args.rounds} round(s):"
    )
    print(f"  {'':22s} {'no refill':>10s} {'refill':>10s}  ratio")
    for name in base:
        ratio = f"{load[name] / base[name]:.2f}" if base[name] else "-"
        print(f"  {name:22s} {base[name]:10.1f} {load[name]:10.1f}  {ratio}")
    targets = [
        ("sustained cycles >= 0.5x", load["cycles/s"] >= 0.5 * base["cycles/s"]),
        ("claim p99 <= 3x", load["cycle claim p99 (ms)"] <= 3 * base["cycle claim p99 (ms)"]),
        ("no spawn failures", not any(f["spawn failures"] for f in runs[True] + runs[False])),
        (
            "no connection errors",
            not any(f["connection errors"] for f in runs[True] + runs[False]),
        ),
    ]
    for name, met in targets:
        print(f"  target {name}: {'met' if met else 'MISSED'}")


async def compare(args: argparse.Namespace) -> None:
    """Rounds of the baseline and this tree in alternating order; medians and paired ratios."""
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "this": []}
    refill = args.variant == "refill"
    for round_ in range(args.rounds):
        order = ["baseline", "this"] if round_ % 2 == 0 else ["this", "baseline"]
        for side in order:
            print(f"-- round {round_ + 1}/{args.rounds}: {side}")
            source = args.baseline if side == "baseline" else None
            runs[side].append(await run(args, source, refill=refill))
    print(f"side by side, {args.rounds} rounds (medians; ratio: median of this / baseline):")
    for name in runs["this"][0]:
        before = [figures[name] for figures in runs["baseline"]]
        after = [figures[name] for figures in runs["this"]]
        ratios = [a / b if b else float("nan") for a, b in zip(after, before, strict=True)]
        print(
            f"  {name:22s} baseline {statistics.median(before):8.1f}  this "
            f"{statistics.median(after):8.1f}  ratio {statistics.median(ratios):.3f} "
            f"(each round: {', '.join(f'{r:.2f}' for r in ratios)})"
        )


def stoker_src(text: str) -> Path:
    """`--baseline`: a folder holding the `stoker` package. A folder without one would start
    the baseline's server on this version (the installed one) and compare it with itself."""
    path = Path(text)
    if not (path / "stoker" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text} has no stoker package (want a src folder)")
    return path.resolve()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burst", type=int, default=160, help="claims of the burst (orgs)")
    parser.add_argument("--duration", type=float, default=8.0, help="sustained phase, seconds")
    parser.add_argument("--concurrency", type=int, default=48, help="orgs cycling in parallel")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiplies --burst and --concurrency"
    )
    parser.add_argument("--profile", type=Path, default=None, help="py-spy output directory")
    parser.add_argument(
        "--baseline",
        type=stoker_src,
        default=None,
        help="src folder of another stoker version, measured side by side with this one",
    )
    parser.add_argument(
        "--variant", choices=["refill", "no-refill"], default="refill", help="with --baseline"
    )
    parser.add_argument("--rounds", type=int, default=None, help="default 1, or 3 with --baseline")
    args = parser.parse_args()
    args.burst = max(1, round(args.burst * args.scale))
    args.concurrency = max(1, min(args.burst, round(args.concurrency * args.scale)))
    if args.rounds is None:
        args.rounds = 3 if args.baseline is not None else 1
    uvloop.run(compare(args) if args.baseline is not None else side_by_side(args))


if __name__ == "__main__":
    main()
