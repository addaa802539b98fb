"""Claims over HTTP with 1 and with 3 `stoker serve` replicas on one PostgreSQL, and how
long the fleet goes without a leader when the leader is SIGKILLed.

    python benchmarks/replicas.py [--postgres URL] [--workers 96] [--duration 10]
                                  [--concurrency 24] [--failovers 3] [--timings default|short]
                                  [--only throughput|failover]

Prints, for 1 replica and for 3 (each on a fresh schema, the clients' requests spread
round robin over the replicas' ports, as a load balancer would):

  warm path    a burst of `--workers` simultaneous claims by as many orgs against as many
               warm workers, activation included: claims/s (burst size / time until all
               are bound) and p50/p99 latency. With 3 replicas most claims land on a
               replica that did not spawn the worker: it reserves it from the store and
               adopts the process.
  reuse path   `--concurrency` orgs claim and release their parked worker for `--duration`
               seconds, each request to the next replica: claims/s, p50/p99 of claims and
               releases.

Then, with 3 replicas, `--failovers` times: SIGKILL the replica that leads the janitor and
measure from the kill until a survivor reports `stoker_janitor_is_leader` 1, until a
survivor's `stoker_janitor_last_success_timestamp_seconds` is later than the kill (the
next successful fleet-wide pass: reconcile, reap, sweep), until the survivors' fallback
reapers passed (`stoker_reaper_last_success_timestamp_seconds`, which does not wait for a
leader), and until the dead replica's warm workers are adopted. The killed replica is then
restarted on its port (a new instance). `--timings default` uses the shipped intervals and
lease (janitor 2 s, reaper 10 s, lease 15 s / renew 10 s / retry 2 s, instance expiry 20 s);
`short` uses the chaos soak's (janitor 0.5 s, lease 3 / 2 / 0.5 s, expiry 3 s).

Everything runs on this machine: the servers, their worker processes, PostgreSQL and the
load generator share its cores, which the figures depend on (the core count is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import psutil
import uvloop

from chaos_soak import (
    DEFAULT_POSTGRES,
    ReplicaSet,
    Timings,
    demo_pool,
    postgres_reachable,
    read_workers,
)
from claim_burst import claim, percentile, release, timed

#: The shipped defaults of `intervals` and `leader_election` (stoker.domain.specs).
DEFAULT_TIMINGS = Timings(
    janitor_interval_s=2.0,
    reaper_interval_s=10.0,
    instance_heartbeat_s=5.0,
    instance_expiry_s=20.0,
    lease_duration_s=15.0,
    renew_deadline_s=10.0,
    retry_period_s=2.0,
    stranded_grace_s=120.0,
    stranded_scan_s=60.0,
    demand_window_s=60.0,
    shutdown_grace_s=30.0,
)
SHORT_TIMINGS = Timings()


def latency(name: str, seconds: list[float]) -> str:
    """One line of p50/p99/max in milliseconds."""
    ms = [s * 1000 for s in seconds]
    return (
        f"{name}: p50 {percentile(ms, 0.5):.1f} ms, p99 {percentile(ms, 0.99):.1f} ms, "
        f"max {max(ms):.1f} ms (n={len(ms)})"
    )


async def open_connections(http: aiohttp.ClientSession, urls: list[str], count: int) -> None:
    """Open `count` keep-alive connections to each replica before the clock starts."""

    async def probe(url: str) -> None:
        async with http.get(f"{url}/healthz") as response:
            await response.read()

    await asyncio.gather(*(probe(url) for url in urls for _ in range(count)))


async def wait_warm(fleet: ReplicaSet, count: int, timeout: float = 600) -> float:
    """Seconds until the pool holds `count` warm workers."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        workers = await read_workers(fleet.postgres_url, fleet.schema)
        if sum(1 for w in workers if w.state == "warm") >= count:
            return time.perf_counter() - started
        await asyncio.sleep(0.5)
    raise SystemExit(f"the pool did not reach {count} warm workers in {timeout:g}s")


async def throughput(args: argparse.Namespace, replicas: int, workdir: Path) -> None:
    """The warm-path burst and the reuse-path cycles against `replicas` replicas."""
    pool = demo_pool(
        warm_target=args.workers,
        max_workers=args.workers,
        max_workers_per_org=0,
        hot_idle_ttl=600,
        scale_down_delay=600,
        lease_s=600,
        claim_timeout_s=60,
    )
    async with ReplicaSet(
        postgres_url=args.postgres,
        count=replicas,
        pools=[pool],
        timings=DEFAULT_TIMINGS,
        workdir=workdir / f"throughput-{replicas}",
    ) as fleet:
        await fleet.start()
        fill = await wait_warm(fleet, args.workers)
        urls = fleet.urls
        print(f"{replicas} replica(s): {args.workers} warm workers after {fill:.1f} s")
        await asyncio.sleep(2)  # let the janitor see the pool full
        connector = aiohttp.TCPConnector(limit=0)
        headers = fleet.headers
        async with aiohttp.ClientSession(connector=connector, headers=headers) as http:
            await open_connections(http, urls, max(1, args.workers // replicas))
            started = time.perf_counter()
            results = await asyncio.gather(
                *(
                    timed(lambda i=i: claim(http, urls[i % replicas], f"org-{i}", pool="demo"))
                    for i in range(args.workers)
                )
            )
            elapsed = time.perf_counter() - started
            sources = Counter(answer["source"] for _, answer in results)
            print(
                f"  warm path: {args.workers / elapsed:.0f} claims/s "
                f"({args.workers} bound in {elapsed * 1000:.0f} ms; sources {dict(sources)})"
            )
            print("    " + latency("claim", [s for s, _ in results]))
            # Each burst org's worker parks for it: the reuse phase claims it again.
            await asyncio.gather(
                *(release(http, urls[i % replicas], a["id"]) for i, (_, a) in enumerate(results))
            )
            await reuse(http, urls, args.concurrency, args.duration)


async def reuse(
    http: aiohttp.ClientSession, urls: list[str], concurrency: int, duration: float
) -> None:
    """Claim+release cycles of parked workers, each request to the next replica."""
    claims: list[float] = []
    releases: list[float] = []
    sources: Counter[str] = Counter()
    deadline = time.perf_counter() + duration

    async def cycle(org_index: int) -> int:
        done, turn, org = 0, org_index, f"org-{org_index}"
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            answer = await claim(http, urls[turn % len(urls)], org, pool="demo")
            claims.append(time.perf_counter() - started)
            sources[answer["source"]] += 1
            turn += 1
            started = time.perf_counter()
            await release(http, urls[turn % len(urls)], answer["id"])
            releases.append(time.perf_counter() - started)
            done += 1
        return done

    started = time.perf_counter()
    cycles = sum(await asyncio.gather(*(cycle(i) for i in range(concurrency))))
    elapsed = time.perf_counter() - started
    print(
        f"  reuse path: {cycles / elapsed:.0f} claims/s ({cycles} claim+release cycles by "
        f"{concurrency} orgs in {elapsed:.1f} s; sources {dict(sources)})"
    )
    print("    " + latency("claim", claims))
    print("    " + latency("release", releases))


async def failover(args: argparse.Namespace, workdir: Path) -> None:
    """SIGKILL the leader `--failovers` times; time to the next leader, pass and adoption."""
    timings = DEFAULT_TIMINGS if args.timings == "default" else SHORT_TIMINGS
    pool = demo_pool(warm_target=4, max_workers=20)
    async with ReplicaSet(
        postgres_url=args.postgres,
        count=3,
        pools=[pool],
        timings=timings,
        workdir=workdir / "failover",
    ) as fleet:
        await fleet.start()
        await wait_warm(fleet, 4)
        print(
            f"failover with {args.timings} timings (lease {timings.lease_duration_s:g} s, renew "
            f"deadline {timings.renew_deadline_s:g} s, retry {timings.retry_period_s:g} s, "
            f"janitor every {timings.janitor_interval_s:g} s, reaper every "
            f"{timings.reaper_interval_s:g} s, instance expiry {timings.instance_expiry_s:g} s):"
        )
        rows: dict[str, list[float]] = {"leader": [], "janitor": [], "reaper": [], "adopted": []}
        for round_ in range(args.failovers):
            leader = None
            while leader is None:
                leader = await fleet.leader()
                await asyncio.sleep(0.1)
            # The leader spawned the warm workers: they die with it unless adopted.
            owned = {
                w.id
                for w in await read_workers(fleet.postgres_url, fleet.schema)
                if w.state == "warm" and w.owner == leader.instance
            }
            survivors = [r for r in fleet.replicas if r is not leader]
            killed_at, killed_wall = time.perf_counter(), time.time()
            leader.kill()
            seen: dict[str, float] = {}
            while len(seen) < 4 and time.perf_counter() - killed_at < 120:
                elapsed = time.perf_counter() - killed_at
                scrapes = [s for s in (await fleet.scrape_all(timeout=1.0)).values() if s]
                if "leader" not in seen and any(
                    s.get("stoker_janitor_is_leader") == 1 for s in scrapes
                ):
                    seen["leader"] = elapsed
                stamps = [
                    s.get("stoker_janitor_last_success_timestamp_seconds") or 0 for s in scrapes
                ]
                if "janitor" not in seen and any(t > killed_wall for t in stamps):
                    seen["janitor"] = elapsed
                reaped = [
                    s.get("stoker_reaper_last_success_timestamp_seconds") or 0 for s in scrapes
                ]
                if "reaper" not in seen and reaped and all(t > killed_wall for t in reaped):
                    seen["reaper"] = elapsed
                if "adopted" not in seen:
                    workers = {
                        w.id: w for w in await read_workers(fleet.postgres_url, fleet.schema)
                    }
                    if all(workers[i].owner != leader.instance for i in owned if i in workers):
                        seen["adopted"] = elapsed
                await asyncio.sleep(0.05)
            print(
                f"  kill {round_ + 1}: "
                + ", ".join(f"{name} after {seen.get(name, float('nan')):.1f} s" for name in rows)
                + f" ({len(owned)} warm workers to adopt; survivors "
                f"{[r.index for r in survivors]})"
            )
            for name in rows:
                if name in seen:
                    rows[name].append(seen[name])
            leader.start()
            await fleet.ready(leader)
            await wait_warm(fleet, 4)
        for name, values in rows.items():
            if values:
                print(
                    f"  {name:<8} mean {statistics.fmean(values):.1f} s, "
                    f"max {max(values):.1f} s over {len(values)} kills"
                )


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="stoker-replicas-") as tmp:
        workdir = Path(tmp)
        print(
            f"machine: {psutil.cpu_count()} cores, PostgreSQL at {args.postgres}; "
            f"{args.workers} workers, {args.concurrency} orgs for {args.duration:g} s"
        )
        if args.only in (None, "throughput"):
            for count in (1, 3):
                await throughput(args, count, workdir)
        if args.only in (None, "failover") and args.failovers:
            await failover(args, workdir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--postgres", default=os.environ.get("STOKER_TEST_POSTGRES_URL", DEFAULT_POSTGRES)
    )
    parser.add_argument("--workers", type=int, default=96, help="warm workers and burst size")
    parser.add_argument("--duration", type=float, default=10.0, help="reuse phase, seconds")
    parser.add_argument("--concurrency", type=int, default=24, help="orgs cycling in parallel")
    parser.add_argument("--failovers", type=int, default=3, help="leader kills to time")
    parser.add_argument("--timings", choices=("default", "short"), default="default")
    parser.add_argument("--only", choices=("throughput", "failover"), default=None)
    args = parser.parse_args()
    problem = asyncio.run(postgres_reachable(args.postgres))
    if problem is not None:
        print(f"PostgreSQL at {args.postgres} is not reachable: {problem}")
        return 2
    uvloop.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
