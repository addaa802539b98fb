"""Claims over HTTP with 1 and with 3 `stoker serve` replicas on one PostgreSQL, and how
long the fleet goes without a leader when the leader is SIGKILLed.

    python benchmarks/replicas.py [--postgres URL] [--workers 96] [--duration 10]
                                  [--concurrency 24] [--rounds 3] [--failovers 3]
                                  [--timings default|short] [--only throughput|failover]

Runs `--rounds` rounds of 1 replica and of 3 (alternating which goes first; each on a
fresh schema, the clients' requests spread round robin over the replicas' ports, as a load
balancer would) and prints each run, then the median of each figure and the median of
the paired ratios 3 replicas / 1 (each ratio of one round, so that the machine's load at
the time cancels out):

  warm path    a burst of `--workers` simultaneous claims by as many orgs against as many
               warm workers, activation included: claims/s (burst size / time until all
               are bound) and p50/p99 latency. The leader spawns the warm workers (the
               replica that spawned each is printed): with 3 replicas two claims in three
               land on a replica that did not, which reserves one from the store and
               adopts the process. The compare-and-sets that found their row taken are
               counted (`stoker_fence_misses`).
  reuse path   `--concurrency` orgs claim and release their parked worker for `--duration`
               seconds, each request to the next replica: claims/s, p99 of claims.

and for each phase the CPU per claim of the replica processes (summed, and the busiest),
of PostgreSQL's processes (all of this machine's) and how many cores the machine was busy.

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
import psycopg
import uvloop

from chaos_soak import (
    DEFAULT_POSTGRES,
    ReplicaSet,
    Timings,
    demo_pool,
    postgres_reachable,
    read_workers,
)
from claim_burst import Profiler, claim, percentile, release, timed

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


def cpu_seconds(pids: list[int]) -> list[float]:
    """CPU seconds (user + system) used so far by each of `pids` (0 for one that is gone)."""
    used = []
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            used.append(0.0)
            continue
        used.append(t.user + t.system)
    return used


async def backends(fleet: ReplicaSet) -> list[int]:
    """The pids of the PostgreSQL backends serving the fleet's replicas (their connections
    carry `application_name=<fleet>-r<index>`)."""
    async with await psycopg.AsyncConnection.connect(fleet.postgres_url, autocommit=True) as c:
        cur = await c.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s",
            (f"{fleet.fleet}-r%",),
        )
        return [pid for (pid,) in await cur.fetchall()]


class CpuMeter:
    """CPU used during one phase by each replica process, by the fleet's PostgreSQL
    backends, and by the whole machine."""

    def __init__(self, fleet: ReplicaSet, pids: list[int]) -> None:
        self.fleet = fleet
        self.pids = pids

    async def __aenter__(self) -> CpuMeter:
        self.backends = dict(zip(db := await backends(self.fleet), cpu_seconds(db), strict=True))
        self.replicas = cpu_seconds(self.pids)
        self.machine = _busy()
        self.started = time.perf_counter()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self.started
        self.machine = _busy() - self.machine
        after = cpu_seconds(self.pids)
        self.replicas = [b - a for a, b in zip(self.replicas, after, strict=True)]
        # A backend that started during the phase counts from 0; one that ended is lost.
        db = await backends(self.fleet)
        self.database = sum(
            b - self.backends.get(pid, 0.0) for pid, b in zip(db, cpu_seconds(db), strict=True)
        )

    def per(self, figures: dict[str, float], phase: str, count: int) -> None:
        """Record milliseconds of CPU per `count` (claims or cycles) of the phase."""
        count = max(count, 1)
        figures[f"{phase} replica CPU/claim (ms)"] = 1000 * sum(self.replicas) / count
        figures[f"{phase} replica CPU/claim, busiest (ms)"] = 1000 * max(self.replicas) / count
        figures[f"{phase} database CPU/claim (ms)"] = 1000 * self.database / count
        figures[f"{phase} machine busy (cores)"] = self.machine / self.elapsed


async def fence_misses(fleet: ReplicaSet, metric: str = "stoker_fence_misses") -> float:
    """Compare-and-set writes of the fleet that found their row changed, so far (with
    `metric` "stoker_misses": claims that found no worker to take at once)."""
    scrapes = await fleet.scrape_all(timeout=10.0)
    return sum(s.total(metric) for s in scrapes.values() if s is not None)


def _busy() -> float:
    """CPU seconds the machine spent busy so far (all cores)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0)


async def throughput(args: argparse.Namespace, replicas: int, workdir: Path) -> dict[str, float]:
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
    figures: dict[str, float] = {}
    async with ReplicaSet(
        postgres_url=args.postgres,
        count=replicas,
        pools=[pool],
        timings=DEFAULT_TIMINGS,
        workdir=workdir,
    ) as fleet:
        await fleet.start()
        fill = await wait_warm(fleet, args.workers)
        urls = fleet.urls
        await asyncio.sleep(2)  # let the janitor see the pool full
        warm = await read_workers(fleet.postgres_url, fleet.schema)
        owners = Counter(w.owner for w in warm if w.state == "warm")
        owner_of = {w.id: w.owner for w in warm}
        instances = [r.read_instance() for r in fleet.replicas]
        print(
            f"{replicas} replica(s): {args.workers} warm workers after {fill:.1f} s, spawned by "
            + ", ".join(
                f"replica {instances.index(o) if o in instances else '?'} ({n})"
                for o, n in owners.items()
            )
        )
        pids = [r.proc.pid for r in fleet.replicas if r.proc is not None]
        connector = aiohttp.TCPConnector(limit=0)
        headers = fleet.headers
        async with aiohttp.ClientSession(connector=connector, headers=headers) as http:
            await open_connections(http, urls, max(1, args.workers // replicas))
            misses = await fence_misses(fleet)
            waits = await fence_misses(fleet, "stoker_misses")
            profilers = [
                Profiler(args.profile / f"{replicas}-replicas-r{r.index}", pid)
                if args.profile is not None
                else Profiler(None, pid)
                for r, pid in zip(fleet.replicas, pids, strict=True)
            ]
            for profiler in profilers:
                profiler.start("burst")
            async with CpuMeter(fleet, pids) as meter:
                started = time.perf_counter()
                results = await asyncio.gather(
                    *(
                        timed(lambda i=i: claim(http, urls[i % replicas], f"org-{i}", pool="demo"))
                        for i in range(args.workers)
                    )
                )
                elapsed = time.perf_counter() - started
            for profiler in profilers:
                profiler.stop()
            meter.per(figures, "burst", args.workers)
            figures["burst fence misses"] = await fence_misses(fleet) - misses
            figures["burst claims that waited"] = await fence_misses(fleet, "stoker_misses") - waits
            sources = Counter(answer["source"] for _, answer in results)
            # Round robin: claim i went to replica i % replicas; did it own the worker?
            foreign = sum(
                1
                for i, (_, answer) in enumerate(results)
                if owner_of.get(answer["worker"]["id"]) != instances[i % replicas]
            )
            seconds = [s for s, _ in results]
            figures["burst p99 (ms)"] = 1000 * percentile(seconds, 0.99)
            figures["burst p50 (ms)"] = 1000 * percentile(seconds, 0.5)
            figures["burst claims/s"] = args.workers / elapsed
            print(
                f"  warm path: {args.workers / elapsed:.0f} claims/s ({args.workers} bound in "
                f"{elapsed * 1000:.0f} ms; sources {dict(sources)}; {foreign} on a replica "
                f"that did not spawn the worker; {figures['burst fence misses']:.0f} missed "
                f"compare-and-sets; {figures['burst claims that waited']:.0f} claims waited)"
            )
            print("    " + latency("claim", seconds))
            # Each burst org's worker parks for it: the reuse phase claims it again.
            await asyncio.gather(
                *(release(http, urls[i % replicas], a["id"]) for i, (_, a) in enumerate(results))
            )
            misses = await fence_misses(fleet)
            async with CpuMeter(fleet, pids) as meter:
                cycles = await reuse(http, urls, args.concurrency, args.duration, figures)
            meter.per(figures, "reuse", cycles)
            figures["reuse fence misses"] = await fence_misses(fleet) - misses
    for phase in ("burst", "reuse"):
        replica = figures[f"{phase} replica CPU/claim (ms)"]
        busiest = figures[f"{phase} replica CPU/claim, busiest (ms)"]
        print(
            f"  {phase} CPU per claim: replicas {replica:.2f} ms (busiest {busiest:.2f}), "
            f"PostgreSQL {figures[f'{phase} database CPU/claim (ms)']:.2f} ms; machine busy "
            f"{figures[f'{phase} machine busy (cores)']:.2f} cores"
        )
    return figures


async def reuse(
    http: aiohttp.ClientSession,
    urls: list[str],
    concurrency: int,
    duration: float,
    figures: dict[str, float],
) -> int:
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
    figures["reuse claims/s"] = cycles / elapsed
    figures["reuse claim p99 (ms)"] = 1000 * percentile(claims, 0.99)
    print(
        f"  reuse path: {cycles / elapsed:.0f} claims/s ({cycles} claim+release cycles by "
        f"{concurrency} orgs in {elapsed:.1f} s; sources {dict(sources)})"
    )
    print("    " + latency("claim", claims))
    print("    " + latency("release", releases))
    return cycles


async def rounds(args: argparse.Namespace, workdir: Path) -> None:
    """`--rounds` rounds of 1 and 3 replicas, alternating which goes first; then the medians
    and the median of the paired ratios (3 replicas / 1 of the same round)."""
    runs: dict[int, list[dict[str, float]]] = {1: [], 3: []}
    for round_ in range(args.rounds):
        for count in (1, 3) if round_ % 2 == 0 else (3, 1):
            print(f"-- round {round_ + 1}/{args.rounds}: {count} replica(s)")
            runs[count].append(
                await throughput(args, count, workdir / f"throughput-{round_}-{count}")
            )
    print(
        f"{args.rounds} round(s) (medians; ratio: median of the paired ratios, 3 replicas / 1, "
        "each ratio of one round):"
    )
    for name in runs[1][0]:
        one = [figures[name] for figures in runs[1]]
        three = [figures[name] for figures in runs[3]]
        ratios = [t / o if o else float("nan") for t, o in zip(three, one, strict=True)]
        print(
            f"  {name:38s} 1: {statistics.median(one):8.2f} | 3: {statistics.median(three):8.2f}"
            f" | ratio {statistics.median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})"
        )


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
            await rounds(args, workdir)
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
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of 1 and 3 replicas, alternating order"
    )
    parser.add_argument("--failovers", type=int, default=3, help="leader kills to time")
    parser.add_argument("--timings", choices=("default", "short"), default="default")
    parser.add_argument("--only", choices=("throughput", "failover"), default=None)
    parser.add_argument(
        "--profile", type=Path, default=None, help="py-spy each replica's burst into this directory"
    )
    args = parser.parse_args()
    problem = asyncio.run(postgres_reachable(args.postgres))
    if problem is not None:
        print(f"PostgreSQL at {args.postgres} is not reachable: {problem}")
        return 2
    uvloop.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
